"""Every loss variant through the trainer, against float64 definitions: the aggregation modes
over minibatches that accumulate into one step, Dr. GRPO's constant normaliser, REINFORCE++'s
advantages, and the clip options reaching the loss."""

import copy

import pytest
import torch

import fastppo
from fastppo.trainer.update.batch import Batch, response_hidden
from fastppo.trainer.update.estimators import ESTIMATORS
from fastppo.trainer.update.loss import minibatch_loss
from tests.oracles import aggregate_oracle, assert_grad_close
from tests.trainer.runs import TEMPERATURE, drifted, rolled_out, untrained


def float64_logprobs(model, batch):
    """The response tokens' log-probs under a float64 copy of ``model``: (B, R)."""
    model = copy.deepcopy(model).double()
    hidden = response_hidden(model, batch.layout())
    head = model.get_output_embeddings()
    logits = (hidden @ head.weight.T) / TEMPERATURE
    return logits.log_softmax(-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1), model


def step_gradient(trainer, batch) -> list:
    """The gradient of the one optimizer step ``update`` takes (the step itself left out)."""
    grads = []
    trainer.optimizers.step = lambda state: grads.extend(p.grad.clone() for p in trainer.policy.parameters())
    trainer.update(batch, 0)
    return grads


@pytest.mark.parametrize(
    "estimator,agg",
    [
        ("grpo", "token-mean"),
        ("grpo", "seq-mean-token-mean"),
        ("grpo", "seq-mean-token-sum"),
        ("rloo", "seq-mean-token-sum-norm"),
        ("dr_grpo", None),
    ],
)
def test_minibatches_of_one_step_minimise_the_whole_batchs_aggregated_loss(tmp_path, estimator, agg):
    """Two minibatches accumulated into one step: the gradient of the float64 loss of the whole
    batch, aggregated as the mode defines it (Dr. GRPO's default: over rows x max_new_tokens)."""
    trainer = drifted(tmp_path, estimator=estimator, agg=agg, minibatches=2, grad_accumulation=2, max_new_tokens=6)
    _, batch = rolled_out(trainer)
    # no response as long as the budget: the budget, not the longest response, is Dr. GRPO's width
    batch = Batch(
        **{k: v[:, :4] if k != "input_ids" and v is not None and v.dim() == 2 else v for k, v in batch.__dict__.items()}
    )
    assert batch.mask.sum(1).unique().numel() > 1  # rows of several lengths: the modes differ
    grads = step_gradient(trainer, batch)

    logp, model = float64_logprobs(trainer.policy, batch)
    ratio = torch.exp(logp - logp.detach())  # on-policy: 1, with the policy gradient's derivative
    per_token = -batch.advantages.double() * ratio
    if trainer.config.agg == "seq-mean-token-sum-norm":  # Dr. GRPO: a constant, the generation budget
        assert estimator != "dr_grpo" or agg is None
        loss = torch.where(batch.mask, per_token, 0.0).sum() / (batch.mask.shape[0] * 6)
    else:
        loss = aggregate_oracle(per_token, batch.mask, trainer.config.agg)
    loss.backward()
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())
    for actual, expected in zip(grads, (p.grad for p in model.parameters())):
        assert_grad_close(actual, expected, torch.float32, atol=1e-9)


def test_dr_grpo_is_unscaled_advantages_with_the_constant_normaliser(tmp_path):
    trainer = drifted(tmp_path, estimator="dr_grpo")
    assert trainer.config.agg == "seq-mean-token-sum-norm" and ESTIMATORS["grpo"].agg == "token-mean"
    scores, batch = rolled_out(trainer)
    groups = scores.view(-1, trainer.config.rollout.samples_per_prompt)
    expected = (groups - groups.mean(1, keepdim=True)).flatten()  # no division by the group's std
    torch.testing.assert_close(batch.advantages, expected[:, None] * batch.mask)


def test_reinforce_pp_whitens_the_reward_to_go_of_kl_shaped_token_rewards(tmp_path):
    trainer = drifted(tmp_path, estimator="reinforce_pp", kl_coef=0.1, gamma=0.9)
    assert trainer.critic is None and not trainer.config.old_logprobs_from_update
    scores, batch = rolled_out(trainer)
    mask, old, ref = batch.mask, batch.old_logprobs.double(), batch.ref_logprobs.double()
    B, R = mask.shape
    expected = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):  # the definition, token by token
        n = int(mask[b].sum())
        rewards = [-0.1 * float(old[b, t] - ref[b, t]) for t in range(n)]
        rewards[-1] += float(scores[b])
        to_go = 0.0
        for t in reversed(range(n)):
            to_go = rewards[t] + 0.9 * to_go
            expected[b, t] = to_go
    valid = expected[mask]
    whitened = torch.where(mask, (expected - valid.mean()) / valid.std(), 0.0)
    torch.testing.assert_close(batch.advantages.double(), whitened, rtol=1e-4, atol=1e-5)


def test_clip_higher_and_dual_clip_reach_the_loss(tmp_path):
    trainer = drifted(
        tmp_path, estimator="grpo", clip_eps=0.1, clip_eps_high=0.3, dual_clip=2.0, recompute_old_logprobs=True
    )
    _, batch = rolled_out(trainer)
    batch.old_logprobs = batch.old_logprobs + 0.4 * torch.randn_like(batch.old_logprobs) * batch.mask
    tokens = batch.mask.sum()
    loss, _ = minibatch_loss(batch, trainer.models, trainer.config, trainer.state.kl_coef, tokens, on_policy=False)
    hidden = response_hidden(trainer.policy, batch.layout())
    logits = hidden @ trainer.policy.get_output_embeddings().weight.T
    options = dict(temperature=TEMPERATURE, num_tokens=int(tokens))
    expected, _ = fastppo.ppo_loss_from_logits(
        logits,
        batch.response_ids,
        batch.old_logprobs,
        batch.advantages,
        batch.mask,
        clip_eps=0.1,
        clip_eps_high=0.3,
        dual_clip=2.0,
        **options,
    )
    symmetric, _ = fastppo.ppo_loss_from_logits(
        logits, batch.response_ids, batch.old_logprobs, batch.advantages, batch.mask, clip_eps=0.1, **options
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert abs(float(expected - symmetric)) > 1e-4  # the options matter for this batch


def test_mask_truncated_leaves_responses_that_hit_the_budget_out_of_the_loss(tmp_path):
    trainer = drifted(tmp_path, estimator="grpo", mask_truncated=True, max_new_tokens=3)
    scored = trainer.rollout(0)
    truncated = scored.no_stop
    assert 0 < int(truncated.sum()) < truncated.numel()
    batch = trainer.prepare(scored.rollout, scored.scores)
    assert not batch.mask[truncated].any()
    assert torch.equal(batch.mask[~truncated], scored.rollout.response_mask[~truncated])
    kept = fastppo.group_advantages(scored.scores, trainer.config.rollout.samples_per_prompt)  # all rows' baseline
    torch.testing.assert_close(batch.advantages, kept[:, None] * batch.mask)


@pytest.mark.parametrize("on_policy", [True, False])
def test_gspo_through_the_trainer_is_the_float64_sequence_loss_of_the_whole_batch(tmp_path, on_policy):
    """Two accumulated minibatches, on-policy (the fused path) or with old log-probs that differ
    (the sequence op), give the gradient of GSPO's float64 loss over the whole batch."""
    from tests.oracles import sequence_ppo_loss_oracle as oracle

    fields = dict(
        estimator="grpo", sequence_ratio=True, clip_eps=0.05, clip_eps_high=0.08, minibatches=2, grad_accumulation=2
    )
    trainer = drifted(tmp_path, **fields, recompute_old_logprobs=not on_policy)
    assert trainer.config.agg == "seq-mean-token-mean"
    _, batch = rolled_out(trainer)
    if not on_policy:
        batch.old_logprobs = batch.old_logprobs + 0.1 * torch.randn_like(batch.old_logprobs) * batch.mask
    old = None if on_policy else batch.old_logprobs.double()
    grads = step_gradient(trainer, batch)

    logp, model = float64_logprobs(trainer.policy, batch)
    per_row = batch.advantages.sum(1).double() / batch.mask.sum(1).clamp(min=1)
    loss = oracle(logp, logp.detach() if on_policy else old, per_row, batch.mask, 0.05, 0.08)
    loss.backward()
    for actual, expected in zip(grads, (p.grad for p in model.parameters())):
        assert_grad_close(actual, expected, torch.float32, atol=1e-9)


@pytest.mark.parametrize("fields", [dict(estimator="gae"), dict(agg="token-mean"), dict(dual_clip=2.0)])
def test_gspo_refuses_what_it_does_not_define(tmp_path, fields):
    from fastppo.errors import UsageError
    from tests.trainer.runs import config

    with pytest.raises(UsageError, match="sequence_ratio needs a group estimator"):
        config(tmp_path, sequence_ratio=True, **fields)


def test_a_new_estimator_is_one_registered_entry(tmp_path, monkeypatch, capsys):
    """A toy estimator, registered once: the config accepts it and checks its properties, --help and
    the documentation's table list it, and the trainer's advantages are its."""
    from fastppo.cli import main as fastppo_main
    from fastppo.errors import UsageError
    from fastppo.trainer.configuration.config import TrainConfig
    from fastppo.trainer.update import estimators

    monkeypatch.setattr(estimators, "ESTIMATORS", dict(estimators.ESTIMATORS))  # the registry as it was after

    def sign(scores, batch, algo, samples_per_prompt, kl_coef):
        """+1 above the batch's mean score, -1 below, at every token."""
        return torch.sign(scores - scores.mean())[:, None].expand_as(batch.mask) * batch.mask, None

    estimators.register(
        estimators.Estimator("sign", sign, "the sign of the score against the batch's mean", min_samples=3)
    )
    with pytest.raises(UsageError, match="samples_per_prompt must be >= 3 for estimator=sign"):
        TrainConfig.from_flat({"estimator": "sign", "samples_per_prompt": 2}).validate()
    with pytest.raises(SystemExit):
        fastppo_main(["train", "--help"])
    assert "sign (the sign of the score against the batch's mean)" in " ".join(capsys.readouterr().out.split())
    assert "| `sign` | the sign of the score against the batch's mean |" in estimators.markdown_table()

    trainer = untrained(tmp_path, estimator="sign", samples_per_prompt=4)
    scores, batch = rolled_out(trainer)
    assert trainer.critic is None and batch.returns is None
    torch.testing.assert_close(batch.advantages, torch.sign(scores - scores.mean())[:, None] * batch.mask)
    assert trainer.iteration(1)["reward_mean"] >= 0
