"""``sequence_ppo_loss`` (GSPO) against a float64 oracle written sequence by sequence, its NaN
policy, and its on-policy equality with the fused token-level op."""

import math

import pytest
import torch

import fastppo
from tests.oracles import assert_grad_close, sequence_ppo_loss_oracle


def inputs(B=6, T=9, seed=0, spread=0.05):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    lengths = torch.tensor([9, 1, 4, 0, 7, 3])[:B]
    mask = torch.arange(T)[None] < lengths[:, None]
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ref = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return logp, old, adv, mask, ref, entropy


@pytest.mark.parametrize("clip", [(0.2, 0.2), (3e-4, 4e-4), (0.01, 0.05)])
@pytest.mark.parametrize("spread", [0.0, 0.05, 0.5])
def test_loss_and_gradient_equal_the_float64_oracle(clip, spread):
    logp, old, adv, mask, ref, entropy = inputs(spread=spread)
    x = logp.float().requires_grad_()
    ent = entropy.float().requires_grad_()
    loss, stats = fastppo.sequence_ppo_loss(
        x,
        old.float(),
        adv.float(),
        mask,
        clip_eps=clip[0],
        clip_eps_high=clip[1],
        ref_logprobs=ref.float(),
        kl_coef=0.1,
        entropy=ent,
        entropy_coef=0.01,
    )
    x64, e64 = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    expected = sequence_ppo_loss_oracle(
        x64, old, adv, mask, clip[0], clip[1], ref=ref, kl_coef=0.1, entropy=e64, entropy_coef=0.01
    )
    assert loss.dtype == torch.float32
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    loss.backward()
    expected.backward()
    assert_grad_close(x.grad, x64.grad, torch.float32, atol=1e-9)
    assert_grad_close(ent.grad, e64.grad, torch.float32, atol=1e-9)
    assert (x.grad[~mask] == 0).all()
    if spread == 0.5 and clip[0] < 0.1:
        assert 0 < float(stats["clipfrac"]) <= 1


def test_the_gradient_is_the_sequence_ratio_over_the_length_and_zero_when_clipped():
    logp = torch.zeros(2, 4, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, 1.0])
    loss, stats = fastppo.sequence_ppo_loss(logp, old, adv, mask, clip_eps=0.2)
    loss.backward()
    # row 0: s = 1, d/dlogp_t = -A s / |y| / 2 sequences; row 1: s = e > 1.2 with A > 0: clipped
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 3, -1 / 3, -1 / 3, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert float(stats["clipfrac"]) == 0.5 and float(stats["ratio_max"]) == pytest.approx(math.e)


def test_masked_positions_may_hold_nan_and_a_valid_nan_poisons_the_loss():
    logp, old, adv, mask, ref, _ = inputs()
    x = logp.float().masked_fill(~mask, float("nan")).requires_grad_()
    loss, _ = fastppo.sequence_ppo_loss(
        x,
        old.float().masked_fill(~mask, float("inf")),
        adv.float(),
        mask,
        ref_logprobs=ref.float().masked_fill(~mask, float("nan")),
        kl_coef=0.1,
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and (x.grad[~mask] == 0).all()
    poisoned = logp.float().clone()
    poisoned[0, 0] = float("nan")
    assert torch.isnan(fastppo.sequence_ppo_loss(poisoned, old.float(), adv.float(), mask)[0])


def test_on_policy_it_is_the_fused_token_loss_with_seq_mean_token_mean():
    """Every sequence ratio is 1 on-policy: GSPO's gradient is the fused op's with this agg."""
    g = torch.Generator().manual_seed(1)
    B, T, H, V = 5, 6, 8, 11
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(V, (B, T), generator=g)
    mask = torch.arange(T)[None] < torch.tensor([6, 2, 0, 4, 1])[:, None]
    adv = torch.randn(B, generator=g)
    fused, _ = fastppo.ppo_loss_from_hidden(
        hidden, weight, labels, None, adv[:, None].expand(B, T) * mask, mask, agg="seq-mean-token-mean"
    )
    fused.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logp = fastppo.token_logprobs_from_hidden(hidden, weight, labels.masked_fill(~mask, -100))
    sequence, _ = fastppo.sequence_ppo_loss(logp, logp.detach(), adv, mask, clip_eps=3e-4)
    sequence.backward()
    torch.testing.assert_close(sequence, fused, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(hidden.grad, grads[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad, grads[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(advantages=torch.zeros(3, 4)), r"advantages must be a floating \(B,\) = \(3,\) tensor"),
        (dict(clip_eps=1.0), "clip_eps must be < 1"),
        (dict(kl_coef=-0.1), "kl_coef must be >= 0"),
        (dict(kl_coef=0.1), "kl_coef > 0 needs ref_logprobs"),
        (dict(entropy_coef=0.1), "entropy_coef > 0 needs entropy"),
        (dict(old_logprobs=torch.zeros(3, 5)), "old_logprobs"),
        (dict(logprobs=torch.zeros(12)), r"logprobs must be \(B, T\)"),
    ],
)
def test_bad_input_names_the_argument(change, match):
    args = dict(
        logprobs=torch.zeros(3, 4),
        old_logprobs=torch.zeros(3, 4),
        advantages=torch.zeros(3),
        mask=torch.ones(3, 4, dtype=torch.bool),
    )
    args.update(change)
    options = {k: args.pop(k) for k in ("clip_eps", "kl_coef", "entropy_coef") if k in args}
    with pytest.raises(ValueError, match=match):
        fastppo.sequence_ppo_loss(args["logprobs"], args["old_logprobs"], args["advantages"], args["mask"], **options)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_sequence_log_ratio_beyond_20_is_clamped_as_the_token_loss_clamps(sign):
    """A mean token log-ratio of 100 would overflow exp (inf above ~88); clamped at +-20, the loss
    is the one at the bound and the gradient is 0, as in the token loss."""
    old = -torch.rand(2, 5) * 3
    logp = (old + sign * 100.0).requires_grad_()
    at_bound = (old + sign * 20.0).requires_grad_()
    mask = torch.ones(2, 5, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    loss, stats = fastppo.sequence_ppo_loss(logp, old, adv, mask, clip_eps=0.2)
    bound, _ = fastppo.sequence_ppo_loss(at_bound, old, adv, mask, clip_eps=0.2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(stats["ratio_max"])
    torch.testing.assert_close(loss, bound)
    assert torch.equal(logp.grad, torch.zeros_like(logp))
