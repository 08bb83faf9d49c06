"""The shared-prefix layout (each prompt encoded once for its samples) and micro-batches by tokens:
the same log-probs, values and update gradients as one padded row per sample, and the models that
must fall back to padded rows do, saying why."""

import copy

import pytest
import torch

from fastppo.trainer.update.batch import Batch, prepare
from fastppo.trainer.update.probe import check_shared_prefix, probe_batch
from fastppo.trainer.update.row_layout import SharedPrefix, _first_fit, groups, key_cost, microbatches, units
from tests.oracles import relative_error
from tests.trainer.runs import drifted, ops_on_triton, rolled_out

SHARED = SharedPrefix(key_cost=0.0)  # no unit cut


def batch_of(rows: list, R: int) -> Batch:
    """A batch of ``rows``, each ``(prompt ids, response ids)``."""
    L = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.tensor([p + r + [0] * (L - len(p) - len(r)) for p, r in rows])
    lens = torch.tensor([len(r) for _, r in rows])
    mask = torch.arange(R) < lens[:, None]
    response_ids = torch.tensor([r + [0] * (R - len(r)) for _, r in rows])
    return Batch(
        input_ids, torch.tensor([len(p) for p, _ in rows]), lens, response_ids, mask, torch.zeros(len(rows), R)
    )


def test_each_prompt_is_laid_out_once_and_every_token_sees_what_its_padded_row_shows_it():
    rows = [([1, 2, 3], [4, 5]), ([7, 8], [9]), ([1, 2, 3], [6, 6, 6]), ([7, 8], [])]
    batch = batch_of(rows, R=3)
    layout = batch.layout(SHARED)
    assert groups(batch.input_ids, [3, 2, 3, 2]) == [[0, 2], [1, 3]]
    # unit [1 2 3 | 4 5 | 6 6 6] is 8 tokens; [7 8 | 9] packs into a row of its own (no room)
    assert layout.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 6, 6], [7, 8, 9, 0, 0, 0, 0, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 2, 0, 0, 0, 0, 0]]
    # each response token is predicted by its own previous token, the first by the prompt's last;
    # past a response's end any real state serves (the mask drops it)
    assert layout.index[0, :2].tolist() == [2, 3] and layout.index[2].tolist() == [2, 5, 6]
    assert layout.index[1, 0] == 8 + 1
    allowed = layout.attention_mask  # (N, L, L): query, key
    assert allowed[0, 5].tolist() == [1, 1, 1, 0, 0, 1, 0, 0]  # the second response: prompt + itself
    assert allowed[0, 4].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert allowed[1, 5].tolist() == [0, 0, 0, 0, 0, 1, 0, 0]  # a pad sees itself alone: never NaN
    assert layout.tokens == 16 < batch.layout().tokens == 4 * 6


def test_short_units_fill_the_room_long_ones_leave():
    # rows of 10, longest first: 10 | 6 + 4 | 3 + 2
    assert sorted(map(sorted, _first_fit([10, 3, 6, 4, 2]))) == [[0], [1, 4], [2, 3]]


def test_a_group_of_long_answers_is_cut_where_dense_attention_would_cost_more_than_the_prompt_saves():
    input_ids = torch.zeros(4, 1, dtype=torch.long)  # one prompt (of one token id), four samples
    assert units(input_ids, [1] * 4, [5] * 4, key_cost=0.0) == [[0, 1, 2, 3]]
    # 20-token prompt, answers of 200: one unit of 820 costs 820 + 820^2 / 1000 = 1492, four rows of 220
    # cost 4 x 268 = 1072, two units of 420 cost 2 x 596 = 1192
    assert units(input_ids, [20] * 4, [200] * 4, key_cost=1e-3) == [[0], [1], [2], [3]]
    assert units(input_ids, [400] * 4, [20] * 4, key_cost=1e-3) == [[0, 1, 2, 3]]  # 480 + 230 < 4 x 588


def test_micro_batches_stay_within_the_budget_keep_units_whole_and_split_only_what_cannot_fit():
    prompt_lens, lens = [10, 10, 10, 4, 4, 30], [5, 5, 5, 2, 2, 40]
    groups = [[0, 1, 2], [3, 4], [5]]  # units of 25, 8 and 70 tokens
    assert microbatches(prompt_lens, lens, groups, max_tokens=30) == [[5], [0, 1, 2], [3, 4]]
    # 25 > 20: the unit splits, each piece with its prompt (20 and 15); 70 is a part of its own
    assert microbatches(prompt_lens, lens, groups, max_tokens=20) == [[5], [0, 1], [2], [3, 4]]
    assert microbatches(prompt_lens, lens, groups, max_tokens=None) == [[0, 1, 2, 3, 4, 5]]
    assert len(microbatches(prompt_lens, lens, groups, max_tokens=None, at_least=4)) == 4
    with pytest.raises(ValueError, match="cannot make 7"):
        microbatches(prompt_lens, lens, groups, max_tokens=None, at_least=7)


def whole_gradient(trainer, batch, shared, **algo) -> torch.Tensor:
    """Every optimizer step's whole gradient of one ``update`` of a copy of ``batch``, laid out
    as ``shared`` says (None: padded rows), concatenated (the steps themselves left out)."""
    trainer.models.shared_prefix = shared
    for name, value in algo.items():
        setattr(trainer.config.algo, name, value)
    grads = []

    def record(state):
        grads.extend(
            p.grad.flatten().clone() for m in trainer.models.trained() for p in m.parameters() if p.requires_grad
        )
        trainer.optimizers.zero_grad()

    trainer.optimizers.step = record
    trainer.update(copy.deepcopy(batch), 0)  # one iteration's minibatches, the same each time
    return torch.cat(grads)


CASES = {
    "grpo on-policy": {},
    "grpo off-policy two epochs": {"recompute_old_logprobs": True, "ppo_epochs": 2},
    "seq-mean-token-sum, two minibatches": {"agg": "seq-mean-token-sum", "minibatches": 2, "grad_accumulation": 2},
    "seq-mean-token-mean": {"agg": "seq-mean-token-mean", "recompute_old_logprobs": True},
    "rloo seq-mean-token-sum-norm": {"estimator": "rloo", "agg": "seq-mean-token-sum-norm"},
    "dr_grpo": {"estimator": "dr_grpo"},
    "gspo": {"sequence_ratio": True, "recompute_old_logprobs": True, "ppo_epochs": 2},
    "gae with a critic": {"estimator": "gae", "samples_per_prompt": 1, "prompts_per_iteration": 8},
    "lora": {"lora_rank": 4},
    "gradient checkpointing": {"estimator": "gae", "gradient_checkpointing": True},
    "eager attention": {"attention": "eager"},
}


@pytest.mark.parametrize("fields", CASES.values(), ids=CASES.keys())
def test_the_shared_prefix_update_is_the_padded_update(tmp_path, fields):
    fields = dict(fields)
    attention = fields.pop("attention", None)
    trainer = drifted(tmp_path, kl_coef=0.05, entropy_coef=0.01, **fields)
    if attention:
        for model in trainer.models.trained():
            model.config._attn_implementation = attention
    assert trainer.models.shared_prefix is not None, trainer.models.padded_because
    whole_units = SharedPrefix(key_cost=0.0)
    _, batch = rolled_out(trainer)
    assert len(batch.groups()) < len(batch.lens) or trainer.config.rollout.samples_per_prompt == 1
    shared = whole_gradient(trainer, batch, whole_units)
    padded = whole_gradient(trainer, batch, None)
    assert padded.norm() > 0
    assert relative_error(shared, padded) <= 1e-5


def test_micro_batches_by_tokens_make_the_same_update(tmp_path):
    trainer = drifted(tmp_path, kl_coef=0.05, agg="seq-mean-token-mean", recompute_old_logprobs=True)
    _, batch = rolled_out(trainer)
    whole = whole_gradient(trainer, batch, trainer.models.shared_prefix)
    parts = batch.parts(12, trainer.models.shared_prefix)
    assert len(parts) > 2
    split = whole_gradient(trainer, batch, trainer.models.shared_prefix, max_tokens_per_microbatch=12)
    assert relative_error(split, whole) <= 1e-5
    padded_split = whole_gradient(trainer, batch, None, max_tokens_per_microbatch=12)
    assert relative_error(padded_split, whole) <= 1e-5


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
def test_prepared_log_probs_and_values_are_the_padded_forwards(tmp_path, autocast):
    trainer = drifted(tmp_path, estimator="gae", kl_coef=0.05, autocast=autocast, recompute_old_logprobs=True)
    scores, batch = rolled_out(trainer)
    config, models = trainer.config, trainer.models
    fields = ("old_logprobs", "ref_logprobs", "values")
    shared = {k: getattr(batch, k) for k in fields}
    models.shared_prefix = None
    padded = prepare(copy.deepcopy(batch), scores, models, config, trainer.state.kl_coef)
    for k in fields:
        assert relative_error(shared[k], getattr(padded, k)) <= (1e-2 if autocast else 1e-5), k


def test_bf16_autocast_updates_agree_as_closely_as_bf16_allows(tmp_path):
    trainer = drifted(tmp_path, kl_coef=0.05, autocast=True, recompute_old_logprobs=True)
    _, batch = rolled_out(trainer)
    shared = whole_gradient(trainer, batch, trainer.models.shared_prefix)
    padded = whole_gradient(trainer, batch, None)
    assert relative_error(shared, padded) <= 1e-2


def test_models_that_cannot_share_a_prompt_run_padded_rows_and_say_why(tmp_path):
    trainer = drifted(tmp_path)
    models = trainer.models
    assert check_shared_prefix(models, False, 100) == (None, "--no-shared-prefix")

    models.policy.config._attn_implementation = "flash_attention_2"
    fmt, why = check_shared_prefix(models, True, 100)
    assert fmt is None and why == "the policy's flash_attention_2 attention takes no 4-D mask"
    models.policy.config._attn_implementation = "sdpa"

    models.policy.config.layer_types = ["chunked_attention"] * models.policy.config.num_hidden_layers
    fmt, why = check_shared_prefix(models, True, 40)
    assert fmt is None and why.startswith("the policy (llama): its layer types ['chunked_attention']")
    del models.policy.config.layer_types

    body = models.policy.base_model  # a model that places tokens by counting, not by position_ids
    forward = body.forward
    body.forward = lambda *args, position_ids=None, **kwargs: forward(*args, **kwargs)
    fmt, why = check_shared_prefix(models, True, 100)
    assert fmt is None and "the policy's states with the prompt shared differ from the padded forward's" in why
    body.forward = forward
    assert check_shared_prefix(models, True, 100)[0] is not None


def test_the_probe_shares_a_prompt_and_packs_two_units():
    batch = probe_batch(50, "cpu")
    layout = batch.layout(SHARED)
    assert len(batch.groups()) == 3 and layout.input_ids.shape == (2, 12)  # two units share a row
    assert layout.tokens < batch.layout().tokens


def test_the_shared_prefix_update_is_the_padded_update_on_the_triton_kernels_too(tmp_path, monkeypatch):
    """The same comparison with every op on its Triton kernel (the interpreter, without a GPU)."""
    pytest.importorskip("triton")
    launched = ops_on_triton(monkeypatch)
    trainer = drifted(tmp_path, kl_coef=0.05, entropy_coef=0.01, recompute_old_logprobs=True, max_new_tokens=4)
    _, batch = rolled_out(trainer)
    whole_units = SharedPrefix(key_cost=0.0)
    shared = whole_gradient(trainer, batch, whole_units)
    padded = whole_gradient(trainer, batch, None)
    assert launched and padded.norm() > 0
    assert relative_error(shared, padded) <= 1e-5


def test_a_keys_cost_is_the_blocks_own_whether_or_not_the_head_is_tied():
    from fastppo.trainer.modeling.default import char_tokenizer, tiny_policy

    untied = tiny_policy(char_tokenizer(), seed=0)
    tied = tiny_policy(char_tokenizer(), seed=0)
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    block = sum(p.numel() for p in untied.model.layers[0].parameters())
    norm = untied.model.norm.weight.numel() / untied.config.num_hidden_layers  # the final norm, shared out
    assert key_cost(tied) == key_cost(untied) == pytest.approx(2 * 64 / (block + norm))


def test_prompts_that_differ_in_their_last_token_alone_are_two_groups():
    ids = torch.tensor([[1, 2, 3, 9, 9], [1, 2, 4, 9, 9], [1, 2, 3, 8, 0]])
    assert groups(ids, [3, 3, 3]) == [[0, 2], [1]]


def test_a_micro_batch_one_token_over_its_budget_is_split():
    # two units of 8 tokens: 16 > 15, so two parts; 16 <= 16, one
    assert microbatches([5, 5], [3, 3], [[0], [1]], max_tokens=15) == [[0], [1]]
    assert microbatches([5, 5], [3, 3], [[0], [1]], max_tokens=16) == [[0, 1]]


def test_the_token_budget_counts_a_shared_prompt_once_per_unit():
    rows = [([1] * 10, [2, 3])] * 4  # one prompt of 10, four answers of 2: 18 tokens shared, 48 padded
    batch = batch_of(rows, R=2)
    assert len(batch.parts(20, SHARED)) == 1
    assert len(batch.parts(20, None)) == 4


def test_minibatches_are_drawn_in_a_new_order_each_time_with_a_prompts_samples_together():
    rows = [([p], [5]) for p in range(8) for _ in range(2)]  # 8 prompts, 2 samples each
    batch = batch_of(rows, R=1)
    generator = torch.Generator().manual_seed(0)
    orders = {tuple(torch.cat(batch.minibatches(2, generator)).tolist()) for _ in range(6)}
    assert len(orders) > 1 and tuple(range(16)) not in orders
    for order in orders:
        assert all(order[i] // 2 == order[i + 1] // 2 for i in range(0, 16, 2))  # samples kept together


def test_a_probe_that_gives_nan_is_a_disagreement(tmp_path):
    trainer = drifted(tmp_path)
    body = trainer.models.policy.base_model
    forward = body.forward

    def nan_when_shared(*args, position_ids=None, **kwargs):
        out = forward(*args, position_ids=position_ids, **kwargs)
        if position_ids is not None:
            out.last_hidden_state = torch.full_like(out.last_hidden_state, float("nan"))
        return out

    body.forward = nan_when_shared
    fmt, why = check_shared_prefix(trainer.models, True, 100)
    assert fmt is None and "differ from the padded forward's by nan" in why
