"""ppo_policy_loss and value_loss against float64 oracles: loss, every stat, gradients."""

import pytest
import torch

import fastppo
from fastppo.ops import ppo_policy_loss_torch
from tests.oracles import aggregate_oracle, ppo_loss_oracle, relative_error

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def make_batch(B=4, T=13, *, garbage=True):
    """Token tensors with holes, an all-masked row, and NaN / -inf where masked."""
    logp = -torch.rand(B, T) * 3
    old = logp + torch.randn(B, T) * 0.3  # ratios around 1, some outside the clip range
    adv = torch.randn(B, T)
    ref = logp + torch.randn(B, T) * 0.5
    entropy = torch.rand(B, T) * 2
    mask = torch.rand(B, T) > 0.25
    mask[1] = False
    if garbage:
        logp = logp.masked_fill(~mask, float("nan"))
        old = old.masked_fill(~mask, float("-inf"))
    return dict(logp=logp, old=old, adv=adv, ref=ref, entropy=entropy, mask=mask)


def check_loss(batch, backend, **options):
    logp = batch["logp"].clone().requires_grad_()
    entropy = batch["entropy"].clone().requires_grad_() if "entropy" in batch else None
    ref = batch.get("ref")
    loss, stats = fastppo.ppo_policy_loss(
        logp, batch["old"], batch["adv"], batch["mask"], ref_logprobs=ref, entropy=entropy, backend=backend, **options
    )
    ref_logp = batch["logp"].double().requires_grad_()
    ref_entropy = batch["entropy"].double().requires_grad_() if entropy is not None else None
    expected, expected_stats = ppo_loss_oracle(
        ref_logp, batch["old"], batch["adv"], batch["mask"], ref=ref, entropy=ref_entropy, **options
    )
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert set(stats) == set(expected_stats)
    for name, value in stats.items():
        assert value.dim() == 0 and value.dtype == torch.float32 and not value.requires_grad
        torch.testing.assert_close(
            value.double(), expected_stats[name].double(), rtol=1e-5, atol=1e-6, msg=lambda m: f"stat {name}: {m}"
        )
    loss.backward()
    expected.backward()
    for got, want in (
        (logp.grad, ref_logp.grad),
        (None if entropy is None else entropy.grad, None if ref_entropy is None else ref_entropy.grad),
    ):
        if want is None:
            continue
        if got is None:  # no gradient reached it: the oracle's must be zero
            assert (want == 0).all()
            continue
        assert torch.isfinite(got).all()
        if want.norm() == 0:
            assert (got == 0).all()
        else:
            assert relative_error(got, want) <= 1e-5
    return loss, stats


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
def test_agg_and_kl_estimators(backend, agg, kl_estimator):
    check_loss(make_batch(), backend, agg=agg, kl_estimator=kl_estimator, kl_coef=0.1)


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # the plain clipped objective
        dict(clip_eps=0.2, clip_eps_high=0.28),  # asymmetric ("clip higher")
        dict(dual_clip=3.0),
        dict(entropy_coef=0.01, kl_coef=0.05),
        dict(num_tokens=100),
        dict(clip_eps=0.0),
    ],
    ids=["plain", "asymmetric", "dual", "entropy+kl", "num_tokens", "clip0"],
)
def test_options(backend, options):
    check_loss(make_batch(), backend, **options)


def test_dual_clip_with_negative_advantages(backend):
    batch = make_batch(garbage=False)
    batch["adv"] = -batch["adv"].abs() - 0.1
    batch["old"] = batch["logp"] - 2.0  # ratio e^2 > 3: the dual bound binds
    _, stats = check_loss(batch, backend, dual_clip=3.0)
    assert stats["dual_clipfrac"] > 0.5


def test_num_tokens_as_a_tensor(backend):
    batch = make_batch()
    loss_int, _ = fastppo.ppo_policy_loss(
        batch["logp"], batch["old"], batch["adv"], batch["mask"], num_tokens=77, backend=backend
    )
    loss_tensor, _ = fastppo.ppo_policy_loss(
        batch["logp"], batch["old"], batch["adv"], batch["mask"], num_tokens=torch.tensor(77), backend=backend
    )
    torch.testing.assert_close(loss_int, loss_tensor)


def test_huge_log_ratios_are_clamped(backend):
    batch = make_batch(garbage=False)
    batch["old"] = batch["logp"] + torch.where(torch.rand_like(batch["logp"]) > 0.5, 40.0, -40.0)
    loss, stats = check_loss(batch, backend, kl_coef=0.1, kl_estimator="k3")
    assert torch.isfinite(loss) and stats["ratio_max"] <= torch.exp(torch.tensor(20.0)) * (1 + 1e-6)


def test_zero_advantages(backend):
    batch = make_batch()
    batch["adv"] = torch.zeros_like(batch["adv"])
    loss, stats = check_loss(batch, backend)
    assert loss == 0 and stats["clipfrac"] == 0


def test_all_masked_is_zero_and_finite(backend):
    batch = make_batch()
    batch["mask"] = torch.zeros_like(batch["mask"])
    for agg in AGGS:
        loss, stats = check_loss(batch, backend, agg=agg, kl_coef=0.1, entropy_coef=0.01)
        assert loss == 0 and all(torch.isfinite(v) for v in stats.values())


def test_bf16_logprobs_get_bf16_gradients(backend):
    batch = make_batch(garbage=False)
    logp = batch["logp"].bfloat16().requires_grad_()
    loss, _ = fastppo.ppo_policy_loss(logp, batch["old"], batch["adv"], batch["mask"], backend=backend)
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16
    ref = batch["logp"].bfloat16().double().requires_grad_()
    ppo_loss_oracle(ref, batch["old"], batch["adv"], batch["mask"])[0].backward()
    assert relative_error(logp.grad, ref.grad) <= 1e-2


def test_any_token_shape_for_token_mean(backend):
    batch = make_batch(garbage=False)
    flat = {k: v.reshape(-1) for k, v in batch.items()}
    loss_2d, _ = fastppo.ppo_policy_loss(batch["logp"], batch["old"], batch["adv"], batch["mask"], backend=backend)
    loss_1d, _ = fastppo.ppo_policy_loss(flat["logp"], flat["old"], flat["adv"], flat["mask"], backend=backend)
    torch.testing.assert_close(loss_1d, loss_2d)
    with pytest.raises(ValueError, match=r"needs \(B, T\) token tensors"):
        fastppo.ppo_policy_loss(flat["logp"], flat["old"], flat["adv"], flat["mask"], agg="seq-mean-token-sum")


def test_twin_chunk_boundaries(monkeypatch):
    monkeypatch.setattr(ppo_policy_loss_torch, "CHUNK", 7)  # 52 tokens: 8 chunks, the last one partial
    check_loss(make_batch(), "torch", kl_coef=0.1, entropy_coef=0.01, dual_clip=2.0)


def test_large_batch_spans_many_kernel_programs(backend):
    batch = make_batch(B=3, T=1500)  # 4500 tokens: several 1024-token programs on the Triton path
    check_loss(batch, backend, kl_coef=0.1, entropy_coef=0.01, dual_clip=2.0, agg="seq-mean-token-mean")


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(old=torch.randn(4, 12)), ValueError, r"old_logprobs has shape \(4, 12\) but logprobs has \(4, 13\)"),
        (dict(adv=torch.ones(4, 13, dtype=torch.long)), TypeError, "advantages must be a floating tensor"),
        (dict(mask=torch.ones(13, 4)), ValueError, "mask has shape"),
        (dict(agg="mean"), ValueError, "agg must be one of"),
        (dict(kl_estimator="k4", ref_logprobs=torch.randn(4, 13)), ValueError, "kl_estimator must be one of"),
        (dict(clip_eps_high=-0.1), ValueError, "clip_eps_high must be >= 0"),
        (dict(clip_eps=float("nan")), ValueError, "clip_eps must be a finite number"),
        (dict(dual_clip=1.0), ValueError, "dual_clip must be > 1"),
        (dict(kl_coef=0.1), ValueError, "no ref_logprobs"),
        (dict(entropy_coef=0.1), ValueError, "no entropy"),
        (dict(num_tokens=0), ValueError, "num_tokens must be a positive int"),
        (dict(num_tokens=10, agg="seq-mean-token-sum"), ValueError, "num_tokens applies to agg='token-mean' only"),
        (dict(ref_logprobs=torch.randn(4, 13, device="meta")), ValueError, "ref_logprobs is on meta"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = dict(logp=torch.randn(4, 13), old=torch.randn(4, 13), adv=torch.randn(4, 13), mask=torch.ones(4, 13))
    for key in ("logp", "old", "adv", "mask"):
        if key in kwargs:
            args[key] = kwargs.pop(key)
    with pytest.raises(error, match=match):
        fastppo.ppo_policy_loss(args["logp"], args["old"], args["adv"], args["mask"], **kwargs)


def value_loss_oracle(values, old_values, returns, mask, clip_eps, agg):
    mask = mask != 0
    v, old, R = (torch.where(mask, x.double(), 0.0) for x in (values, old_values, returns))
    error = (v - R) ** 2
    if clip_eps is None:
        return aggregate_oracle(0.5 * error, mask, agg), torch.zeros(())
    clipped_error = (old + (v - old).clamp(-clip_eps, clip_eps) - R) ** 2
    clipfrac = ((clipped_error > error) & mask).sum() / max(mask.sum().item(), 1)
    return aggregate_oracle(0.5 * torch.maximum(error, clipped_error), mask, agg), clipfrac


@pytest.mark.parametrize("clip_eps", [0.2, None])
@pytest.mark.parametrize("agg", AGGS)
def test_value_loss(clip_eps, agg):
    B, T = 4, 11
    values = torch.randn(B, T, requires_grad=True)
    old_values = values.detach() + torch.randn(B, T) * 0.3
    returns = torch.randn(B, T)
    mask = torch.rand(B, T) > 0.3
    mask[2] = False
    loss, stats = fastppo.value_loss(
        values, old_values, returns.masked_fill(~mask, float("nan")), mask, clip_eps=clip_eps, agg=agg
    )
    ref_values = values.detach().double().requires_grad_()
    expected, clipfrac = value_loss_oracle(ref_values, old_values, returns, mask, clip_eps, agg)
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["vf_clipfrac"].double(), clipfrac.double())
    torch.testing.assert_close(stats["value_mean"].double(), values.detach()[mask].double().mean())
    assert clip_eps is None or stats["vf_clipfrac"] > 0
    loss.backward()
    expected.backward()
    assert relative_error(values.grad, ref_values.grad) <= 1e-5


def test_value_loss_all_masked_and_bad_input():
    values = torch.randn(2, 3, requires_grad=True)
    loss, stats = fastppo.value_loss(values, values.detach(), torch.randn(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss == 0 and (values.grad == 0).all() and all(torch.isfinite(v) for v in stats.values())
    with pytest.raises(ValueError, match=r"returns has shape \(3, 2\) but values has \(2, 3\)"):
        fastppo.value_loss(values, values, torch.randn(3, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip_eps must be a finite number >= 0 or None"):
        fastppo.value_loss(values, values, values, torch.ones(2, 3), clip_eps=-1.0)


@pytest.mark.parametrize("agg", AGGS)
def test_rows_of_unequal_lengths_tell_the_aggregations_apart(backend, agg):
    """Rows with 1, 4 and 9 valid tokens: token-mean and seq-mean-token-mean differ, and each is its oracle."""
    batch = make_batch(B=4, T=10)
    lengths = torch.tensor([1, 4, 0, 9])
    batch["mask"] = torch.arange(10) < lengths[:, None]
    batch["logp"] = torch.where(batch["mask"], batch["logp"].nan_to_num(), float("nan"))
    batch["old"] = torch.where(batch["mask"], batch["old"].nan_to_num(), float("-inf"))
    loss, _ = check_loss(batch, backend, agg=agg, kl_coef=0.1, entropy_coef=0.01)
    other = "token-mean" if agg != "token-mean" else "seq-mean-token-mean"
    different, _ = fastppo.ppo_policy_loss(
        batch["logp"],
        batch["old"],
        batch["adv"],
        batch["mask"],
        ref_logprobs=batch["ref"],
        entropy=batch["entropy"],
        kl_coef=0.1,
        entropy_coef=0.01,
        agg=other,
        backend=backend,
    )
    assert abs(float(loss.detach()) - float(different)) > 1e-3
