"""rollout_is_weights against float64, and the PPO loss it corrects against a float64 oracle that
weights each token's policy-gradient term (the definition), not its advantage (the shortcut)."""

import pytest
import torch

import fastppo
from tests.oracles import ppo_loss_oracle


def oracle(old, sampler, mask, cap):
    w = torch.exp((old.double() - sampler.double()).clamp(-20, 20)).clamp(max=cap)
    return torch.where(mask.bool(), w, 0.0)


@pytest.mark.parametrize("cap", [1.5, 2.0, 10.0])
def test_weights_match_float64(cap):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 33, generator=g) * 4
    sampler = old + torch.randn(6, 33, generator=g) * 0.7  # some ratios above the cap, most below
    sampler[0, 0] = old[0, 0] - 50.0  # a log-ratio past the clamp
    mask = torch.rand(6, 33, generator=g) > 0.3
    weights = fastppo.rollout_is_weights(old, sampler, mask, cap)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.double(), oracle(old, sampler, mask, cap), rtol=1e-6, atol=0)
    assert (weights[mask] <= cap).all() and (weights[mask] > 0).all()
    assert (weights > cap - 1e-6).sum() > 0  # the cap was reached


def test_masked_positions_are_zero_and_a_bad_valid_value_is_nan():
    old = torch.tensor([[-1.0, float("nan"), float("inf"), -2.0, float("nan")]])
    sampler = torch.tensor([[-1.2, 0.0, float("nan"), -2.0, -1.0]])
    mask = torch.tensor([[True, False, False, True, True]])
    weights = fastppo.rollout_is_weights(old, sampler, mask, 3.0)
    assert weights[0, 1] == 0 and weights[0, 2] == 0
    assert torch.isnan(weights[0, 4])
    torch.testing.assert_close(weights[0, [0, 3]], torch.tensor([0.2, 0.0]).exp())


def test_numeric_masks_other_than_0_1_poison():
    old, sampler = torch.zeros(1, 3), torch.zeros(1, 3)
    weights = fastppo.rollout_is_weights(old, sampler, torch.tensor([[1.0, 0.5, 0.0]]), 2.0)
    assert weights[0, 0] == 1 and torch.isnan(weights[0, 1]) and weights[0, 2] == 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_weighted_advantages_are_the_weighted_ppo_loss(agg, dual_clip, backend):
    g = torch.Generator().manual_seed(1)
    shape = (4, 19)
    old = -torch.rand(shape, generator=g) * 3
    logp = (old + torch.randn(shape, generator=g) * 0.4).requires_grad_()
    sampler = old + torch.randn(shape, generator=g) * 0.5
    adv = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.25
    weights = fastppo.rollout_is_weights(old, sampler, mask, 2.0)
    loss, stats = fastppo.ppo_policy_loss(logp, old, adv * weights, mask, dual_clip=dual_clip, agg=agg, backend=backend)
    loss.backward()
    logp64 = logp.detach().double().requires_grad_()
    expected, expected_stats = ppo_loss_oracle(
        logp64, old, adv, mask, dual_clip=dual_clip, agg=agg, is_weights=oracle(old, sampler, mask, 2.0)
    )
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logp.grad.double(), logp64.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(stats["clipfrac"].double(), expected_stats["clipfrac"].double())


def test_bad_arguments_are_named():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="cap must be > 1"):
        fastppo.rollout_is_weights(x, x, x > 0, 1.0)
    with pytest.raises(ValueError, match="sampler_logprobs has shape"):
        fastppo.rollout_is_weights(x, torch.zeros(3, 2), x > 0, 2.0)
    with pytest.raises(TypeError, match="old_logprobs must be a floating tensor"):
        fastppo.rollout_is_weights(x.long(), x, x > 0, 2.0)
