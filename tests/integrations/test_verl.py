"""fastppo.integrations.verl against references written from verl's documented semantics."""

import sys

import pytest
import torch

import fastppo.integrations.verl as verl
from tests.oracles import relative_error


def ref_masked_mean(x, mask):
    return torch.where(mask.bool(), x, 0.0).mul(mask).sum() / (mask.sum() + 1e-8)


def ref_whiten(x, mask):
    mean = ref_masked_mean(x, mask)
    var = ref_masked_mean((x - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def ref_gae(rewards, values, mask, gamma, lam):
    """verl's loop: masked positions carry the next valid position's value and advantage."""
    rewards, values, mask = rewards.double(), values.double(), mask.double()
    next_value, last = 0.0, 0.0
    reversed_adv = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last = candidate * mask[:, t] + (1 - mask[:, t]) * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return ref_whiten(advantages, mask), advantages + values


def test_verl_is_not_imported():
    assert "verl" not in sys.modules


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_gae_reproduces_verl_at_masked_positions_too(gamma, lam):
    rewards, values = torch.randn(4, 23), torch.randn(4, 23)
    mask = (torch.rand(4, 23) > 0.3).float()
    mask[0, :5] = 0  # a leading masked run
    mask[1, -6:] = 0  # a trailing one (verl writes 0 there)
    advantages, returns = verl.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    expected_adv, expected_ret = ref_gae(rewards, values, mask, gamma, lam)
    assert relative_error(advantages, expected_adv) <= 1e-5 and relative_error(returns, expected_ret) <= 1e-5
    assert (advantages[1, -6:] != 0).all()  # whitening moves the masked zeros too, as verl does


@pytest.mark.parametrize("mode", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_penalty(mode):
    logprob = -torch.rand(5, 7) * 3
    ref = logprob + torch.randn(5, 7) * 4  # large gaps reach verl's [-10, 10] clamp
    d = logprob.double() - ref.double()
    kl = ref.double() - logprob.double()
    expected = {"kl": d, "k1": d, "abs": d.abs(), "mse": 0.5 * d**2, "k2": 0.5 * d**2}.get(mode)
    if expected is None:
        kl = kl.clamp(-20, 20)
        expected = (torch.exp(kl) - kl - 1).clamp(-10, 10)
    torch.testing.assert_close(verl.kl_penalty(logprob, ref, mode).double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError):
        verl.kl_penalty(logprob, ref, "full")


def ref_agg(loss, mask, mode):
    if mode == "token-mean":
        return ref_masked_mean(loss, mask)
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / mask.sum(-1)).mean()
    return (loss * mask).sum() / mask.shape[-1]


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss(mode):
    loss, mask = torch.randn(4, 9), (torch.rand(4, 9) > 0.3).float()
    mask[:, 0] = 1
    torch.testing.assert_close(verl.agg_loss(loss, mask, mode), ref_agg(loss, mask, mode))
    mask[2] = 0  # an empty row: verl's seq-mean-token-mean is NaN, the others are finite
    out = verl.agg_loss(loss, mask, mode)
    assert torch.isnan(out) if mode == "seq-mean-token-mean" else torch.isfinite(out)


def ref_vanilla(old, new, adv, mask, mode, low=0.2, high=0.28, clip_c=3.0):
    lr = (new - old).clamp(-20, 20)
    ratio = lr.exp()
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
    clipped = torch.maximum(pg1, pg2)
    pg3 = -adv * clip_c
    losses = torch.where(adv < 0, torch.min(pg3, clipped), clipped)
    lower = ref_masked_mean((torch.gt(clipped, pg3) & (adv < 0)).float(), mask)
    return ref_agg(losses, mask, mode), ref_masked_mean((pg2 > pg1).float(), mask), ref_masked_mean(-lr, mask), lower


@pytest.mark.parametrize("mode", MODES)
def test_vanilla_policy_loss(mode):
    new = (-torch.rand(4, 11) * 3).requires_grad_()
    old = new.detach() + torch.randn(4, 11) * 1.5  # ratios past clip_ratio_c for some tokens
    adv = torch.randn(4, 11) * 2
    mask = (torch.rand(4, 11) > 0.3).float()
    mask[:, 0] = 1
    config = {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    ours = verl.compute_policy_loss_vanilla(old, new, adv, mask, mode, config)
    ref_new = new.detach().double().requires_grad_()
    expected = ref_vanilla(old.double(), ref_new, adv.double(), mask.double(), mode)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-6)
    ours[0].backward()
    expected[0].backward()
    assert relative_error(new.grad, ref_new.grad) <= 1e-5
    assert expected[3] > 0  # dual clipping was exercised


def test_logprobs_and_entropy():
    logits, labels = torch.randn(3, 5, 17).bfloat16(), torch.randint(0, 17, (3, 5))
    log_p = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(verl.logprobs_from_logits(logits, labels).double(),
                               log_p.gather(-1, labels[..., None])[..., 0], rtol=0, atol=1e-4)
    torch.testing.assert_close(verl.entropy_from_logits(logits).double(), -(log_p.exp() * log_p).sum(-1),
                               rtol=0, atol=1e-4)
