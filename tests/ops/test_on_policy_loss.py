"""ppo_loss_from_hidden with the old log-probs taken from its own pass (old_logprobs=None) and with
rollout importance weights: against a float64 oracle that takes the old log-probs as the detached
oracle log-probs and weights each token's policy-gradient term."""

import pytest
import torch

import fastppo
from tests.ops.inputs import OPTIONS, make_inputs
from tests.oracles import logprobs_oracle, ppo_loss_oracle, relative_error


def oracle_weights(old, sampler, mask, cap):
    return torch.where(mask, torch.exp((old.double() - sampler.double()).clamp(-20, 20)).clamp(max=cap), 0.0)


@pytest.mark.parametrize("cap", [None, 1.3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_on_policy_loss_gradient_and_logprobs_match_float64(backend, cap, temperature):
    hidden, weight, labels, _, adv, ref, mask = make_inputs(B=4, T=9)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp64, entropy64 = logprobs_oracle(ref_h @ ref_w.T, labels.clamp(min=0), temperature)
    old64 = torch.where(mask, logp64.detach(), 0.0)
    sampler = (old64 + 0.3 * torch.randn_like(old64)).float()  # some weights over the cap
    extra = {} if cap is None else dict(sampler_logprobs=sampler, rollout_is_cap=cap)
    loss, stats, logp = fastppo.ppo_loss_from_hidden(
        h,
        w,
        labels,
        None,
        adv,
        mask,
        ref_logprobs=ref,
        chunk_size=5,
        temperature=temperature,
        backend=backend,
        return_logprobs=True,
        **OPTIONS,
        **extra,
    )
    loss.backward()
    weights = None if cap is None else oracle_weights(old64, sampler, mask, cap)
    expected, expected_stats = ppo_loss_oracle(
        logp64, old64, adv, mask, ref=ref, entropy=entropy64, is_weights=weights, **OPTIONS
    )
    expected.backward()
    torch.testing.assert_close(logp.double(), old64, rtol=0, atol=2e-5)
    assert logp.dtype == torch.float32 and not logp.requires_grad and (logp[~mask] == 0).all()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert stats["ratio_mean"] == 1 and stats["ratio_max"] == 1 and stats["clipfrac"] == 0
    for name in ("pg_loss", "kl", "entropy"):
        torch.testing.assert_close(stats[name].double(), expected_stats[name].double(), rtol=1e-5, atol=1e-6)
    assert relative_error(h.grad, ref_h.grad) <= 1e-5
    assert relative_error(w.grad, ref_w.grad) <= 1e-5
    if cap is not None:
        assert (weights[mask] == cap).any() and (weights[mask] < 1).any()  # the weights mattered


def test_off_policy_importance_weights_equal_weighted_advantages(backend):
    hidden, weight, labels, old, adv, ref, mask = make_inputs()
    sampler = old + 0.4 * torch.randn_like(old)
    weighted, _ = fastppo.ppo_loss_from_hidden(
        hidden,
        weight,
        labels,
        old,
        adv,
        mask,
        ref_logprobs=ref,
        sampler_logprobs=sampler,
        rollout_is_cap=2.0,
        backend=backend,
        **OPTIONS,
    )
    direct, _ = fastppo.ppo_loss_from_hidden(
        hidden,
        weight,
        labels,
        old,
        adv * fastppo.rollout_is_weights(old, sampler, mask, 2.0),
        mask,
        ref_logprobs=ref,
        backend=backend,
        **OPTIONS,
    )
    torch.testing.assert_close(weighted, direct, rtol=1e-6, atol=1e-7)


def test_returned_logprobs_are_token_logprobs_from_hidden():
    hidden, weight, labels, old, adv, _, mask = make_inputs()
    _, _, logp = fastppo.ppo_loss_from_hidden(
        hidden, weight, labels, old, adv, mask, return_logprobs=True, temperature=0.8
    )
    expected = fastppo.token_logprobs_from_hidden(hidden, weight, torch.where(mask, labels, -100), temperature=0.8)
    torch.testing.assert_close(logp, expected)


def test_bad_arguments_are_named():
    hidden, weight, labels, old, adv, _, mask = make_inputs()
    with pytest.raises(ValueError, match="sampler_logprobs and rollout_is_cap go together"):
        fastppo.ppo_loss_from_hidden(hidden, weight, labels, old, adv, mask, sampler_logprobs=old)
    with pytest.raises(ValueError, match="rollout_is_cap must be > 1"):
        fastppo.ppo_loss_from_hidden(hidden, weight, labels, old, adv, mask, sampler_logprobs=old, rollout_is_cap=1)
    with pytest.raises(ValueError, match="sampler_logprobs has shape"):
        fastppo.ppo_loss_from_hidden(
            hidden, weight, labels, old, adv, mask, sampler_logprobs=old[:, 1:], rollout_is_cap=2.0
        )
    with pytest.raises(TypeError, match="old_logprobs must be a torch.Tensor"):
        fastppo.ppo_policy_loss(old, None, adv, mask)  # only the fused op computes its own
