"""The units' attention split by their mask equals attention under the dense mask, in float64."""

import pytest
import torch

from fastppo.trainer.update import unit_attention
from fastppo.trainer.update.row_layout import SharedPrefix
from fastppo.trainer.update.unit_attention import IMPLEMENTATION, PLAN_ATTRIBUTE, plan_units, split_attention
from tests.oracles import masked_attention_oracle
from tests.trainer.runs import drifted, rolled_out
from tests.trainer.update.test_probe import batch_of, whole_gradient

WHOLE = SharedPrefix(key_cost=0.0)


def layout_of_two_prompts():
    """Three prompts of different lengths, their samples' responses of 1 to 4 tokens and one of
    none, two short units packed in one row, so rows hold pads and several units."""
    first, second, third = list(range(1, 13)), list(range(20, 26)), list(range(30, 37))
    rows = [
        (first, [40, 41, 42, 43]),
        (first, [44]),
        (first, [45, 46, 47]),
        (second, [48, 49]),
        (second, []),
        (third, [50]),
    ]
    return batch_of(rows, R=4).layout(WHOLE)


def test_the_split_is_the_dense_masked_attention_forward_and_backward_in_float64():
    layout = layout_of_two_prompts()
    plan = layout.plan
    assert plan is not None  # each unit's pairs padded are fewer than the rows' dense ones
    N, L = layout.input_ids.shape
    allowed = layout.attention_mask  # (N, L, L)
    real = torch.zeros(N * L, dtype=torch.bool)
    real[plan.scatter] = True  # every token of a unit, no pad
    assert layout.input_ids.shape == (2, 20)  # the units of 20 tokens, then of 8 and 8 in one row
    assert int(real.sum()) == 12 + 4 + 1 + 3 + 6 + 2 + 7 + 1
    generator = torch.Generator().manual_seed(0)
    H, KVH, D = 6, 2, 8

    def leaf(heads):
        return torch.randn(N, heads, L, D, dtype=torch.float64, generator=generator).requires_grad_()

    q, k, v = leaf(H), leaf(KVH), leaf(KVH)
    weights = torch.randn(N, L, H, D, dtype=torch.float64, generator=generator)
    split = split_attention(q, k, v, plan, 0.3)
    dense = masked_attention_oracle(q, k, v, allowed, 0.3)
    on_real = real.view(N, L)
    assert torch.allclose(split[on_real], dense[on_real], rtol=0, atol=1e-12)
    assert split[~on_real].eq(0).all()  # a layout pad's output
    grads = torch.autograd.grad((split * weights)[on_real].sum(), (q, k, v))
    expected = torch.autograd.grad((dense * weights)[on_real].sum(), (q, k, v))
    for got, want in zip(grads, expected):
        assert want.abs().max() > 0
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_a_long_tail_response_keeps_the_dense_mask():
    # a 10-token prompt and 8 responses in one row; padded to a 200-token one, they cost more than the row
    short = [(10 + 3 * i, 3, 0) for i in range(8)]
    assert plan_units([(0, 10)], short, 1, 34, "cpu") is not None
    tail = short[:7] + [(31, 200, 0)]
    assert plan_units([(0, 10)], tail, 1, 231, "cpu") is None
    assert plan_units([(0, 10)], [(10, 0, 0)], 1, 10, "cpu") is None  # no response token: nothing to split


def test_the_trainer_updates_through_the_split_and_its_gradient_is_the_padded_one(tmp_path, monkeypatch):
    trainer = drifted(tmp_path, kl_coef=0.05, recompute_old_logprobs=True)
    models = trainer.models
    assert models.shared_prefix is not None, models.padded_because
    assert models.policy.config._attn_implementation == IMPLEMENTATION
    assert models.reference.config._attn_implementation == IMPLEMENTATION
    calls = []
    split = unit_attention.split_attention
    monkeypatch.setattr(unit_attention, "split_attention", lambda *a: calls.append(1) or split(*a))
    _, batch = rolled_out(trainer)  # old and reference log-probs: forwards through the split
    layers = models.policy.config.num_hidden_layers
    assert len(calls) >= 2 * layers
    shared = whole_gradient(trainer, batch, WHOLE)
    padded = whole_gradient(trainer, batch, None)
    assert len(calls) >= 3 * layers
    assert (shared - padded).norm() <= 1e-5 * padded.norm()


def test_a_mask_without_a_plan_is_transformers_sdpa_attention(tmp_path):
    trainer = drifted(tmp_path)
    model = trainer.models.policy
    module = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, D = model.config.num_attention_heads, model.config.num_key_value_heads, module.head_dim
    q = torch.randn(2, heads, 5, D, generator=generator)
    k, v = (torch.randn(2, kv_heads, 5, D, generator=generator) for _ in range(2))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].expand(2, 1, 5, 5)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    got, _ = unit_attention.attend(module, q, k, v, mask, scaling=0.2)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.2)
    assert torch.equal(got, want)
    assert not hasattr(mask, PLAN_ATTRIBUTE)


@pytest.mark.parametrize("implementation", ["eager", "flash_attention_2"])
def test_only_an_sdpa_model_is_adopted(tmp_path, implementation):
    model = drifted(tmp_path).models.policy
    model.config._attn_implementation = implementation
    assert not unit_attention.adopt(model)
    assert model.config._attn_implementation == implementation
    model.config._attn_implementation = "sdpa"
    assert unit_attention.adopt(model) and model.config._attn_implementation == IMPLEMENTATION
    unit_attention.release(model)
    assert model.config._attn_implementation == "sdpa"


def test_an_adopted_model_generates_and_saves_as_before(tmp_path):
    """Outside the update (transformers' own generate, its 2-D masks, a saved config) the model is as
    it was: every call without a plan is SDPA's, and the implementation's name is not saved."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64,
        vocab_size=50, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids, mask = torch.tensor([[1, 2, 3, 4], [0, 5, 6, 7]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])

    def generated():
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)

    before = generated()
    assert unit_attention.adopt(model)
    assert torch.equal(generated(), before)
    model.config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path)._attn_implementation != IMPLEMENTATION
