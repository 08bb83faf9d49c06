"""fastppo.integrations.openrlhf against references written from OpenRLHF's documented semantics."""

import sys

import pytest
import torch

import fastppo.integrations.openrlhf as openrlhf
from tests.oracles import relative_error


def ref_masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim)


def ref_gae(values, rewards, mask, gamma, lambd):
    values, rewards = (mask * values).double(), (mask * rewards).double()
    last, reversed_adv = 0.0, []
    T = rewards.shape[1]
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t < T - 1 else 0.0
        last = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lambd * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values


def test_openrlhf_is_not_imported():
    assert "openrlhf" not in sys.modules


def test_gae_runs_through_holes_as_zero_steps():
    values, rewards = torch.randn(4, 19), torch.randn(4, 19)
    mask = (torch.rand(4, 19) > 0.3).float()
    mask[1, -5:] = 0
    for got, want in zip(openrlhf.get_advantages_and_returns(values, rewards, mask, 0.99, 0.95),
                         ref_gae(values, rewards, mask, 0.99, 0.95)):
        assert relative_error(got, want) <= 1e-5


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_compute_approx_kl(estimator):
    new = -torch.rand(6, 9) * 3
    base = new + torch.randn(6, 9) * 4  # reaches the [-10, 10] clamp
    d = new.double() - base.double()
    expected = {"k1": d, "k2": d**2 / 2, "k3": torch.exp(-d) - 1 + d}[estimator].clamp(-10, 10)
    torch.testing.assert_close(openrlhf.compute_approx_kl(new, base, estimator).double(), expected,
                               rtol=1e-5, atol=1e-5)


def test_log_probs_from_logits_leaves_the_logits_alone():
    logits, labels = torch.randn(2, 5, 23), torch.randint(0, 23, (2, 5))
    before = logits.clone()
    out = openrlhf.log_probs_from_logits(logits, labels, temperature=0.7)
    expected = torch.log_softmax(before.double() / 0.7, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)
    assert torch.equal(logits, before) and out.dtype == torch.float32
    assert openrlhf.log_probs_from_logits(logits.bfloat16(), labels).dtype == torch.bfloat16


def ref_policy_loss(new, old, adv, mask, low, high, dual, token_level):
    ratio = (new - old).exp()
    surr1, surr2 = ratio * adv, ratio.clamp(1 - low, 1 + high) * adv
    if dual is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        loss = -torch.where(adv < 0, torch.max(clip1, dual * adv), clip1)
    loss = ref_masked_mean(loss, mask) if token_level else ref_masked_mean(loss, mask, dim=-1).mean()
    return loss, ref_masked_mean((surr2 < surr1).float(), mask), ref_masked_mean(-(new - old).detach(), mask)


@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("token_level", [True, False])
def test_policy_loss(dual, token_level):
    new = (-torch.rand(4, 12) * 3).requires_grad_()
    old = new.detach() + torch.randn(4, 12) * 1.5
    adv = torch.randn(4, 12) * 2
    mask = (torch.rand(4, 12) > 0.3).float()
    mask[:, 0] = 1
    ours = openrlhf.PolicyLoss(0.2, 0.28, dual, token_level)(new, old, adv, mask)
    ref_new = new.detach().double().requires_grad_()
    expected = ref_policy_loss(ref_new, old.double(), adv.double(), mask.double(), 0.2, 0.28, dual, token_level)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-6)
    ours[0].backward()
    expected[0].backward()
    assert relative_error(new.grad, ref_new.grad) <= 1e-5


def test_policy_loss_empty_masks_are_nan_as_in_openrlhf():
    new, old, adv = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    mask = torch.ones(3, 4)
    mask[1] = 0
    assert torch.isfinite(openrlhf.PolicyLoss()(new, old, adv, mask)[0])
    assert torch.isnan(openrlhf.PolicyLoss(token_level_loss=False)(new, old, adv, mask)[0])
    assert all(torch.isnan(x) for x in openrlhf.PolicyLoss()(new, old, adv, torch.zeros(3, 4)))
    with pytest.raises(ValueError, match="policy_loss_type='ppo' only"):
        openrlhf.PolicyLoss(policy_loss_type="gspo")
