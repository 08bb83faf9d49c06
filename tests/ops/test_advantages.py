"""Whitening (local and across gloo ranks), group baselines, KL-shaped rewards, KL estimators."""

import pytest
import torch
import torch.distributed as dist

import fastppo
from tests.ranks import spawn


def whiten_oracle(x, mask, shift_mean=True, eps=1e-8):
    x = x.double()
    valid = x[mask]
    mean = valid.mean()
    var = valid.var(unbiased=True)
    out = (x - mean) / torch.sqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, 0.0)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_oracle(shift_mean):
    x = torch.randn(4, 30) * 3 + 5
    mask = torch.rand(4, 30) > 0.4
    out = fastppo.masked_whiten(x, mask, shift_mean=shift_mean)
    assert out.dtype == torch.float32 and (out[~mask] == 0).all()
    torch.testing.assert_close(out.double(), whiten_oracle(x, mask, shift_mean), rtol=1e-5, atol=1e-5)
    if shift_mean:
        assert abs(out[mask].double().mean().item()) < 1e-5
        assert abs(out[mask].double().std().item() - 1) < 1e-5


def test_whiten_large_offset_does_not_cancel():
    x = 1e4 + torch.randn(1000, dtype=torch.float64)
    mask = torch.ones(1000, dtype=torch.bool)
    out = fastppo.masked_whiten(x.float(), mask)
    torch.testing.assert_close(out.double(), whiten_oracle(x.float(), mask), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("valid_count", [0, 1])
def test_whiten_degenerate_masks_give_zeros(valid_count):
    x = torch.randn(2, 5)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask.view(-1)[:valid_count] = True
    for shift_mean in (True, False):
        out = fastppo.masked_whiten(x, mask, shift_mean=shift_mean)
        assert torch.isfinite(out).all()
        assert (out[~mask] == 0).all()
    assert (fastppo.masked_whiten(x, mask) == 0).all()


def _whiten_worker(rank, port, xs, masks, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out = fastppo.masked_whiten(xs[rank], masks[rank], group=dist.group.WORLD)
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_whiten_global_statistics_across_two_gloo_ranks(tmp_path):
    # gloo ranks on CPU tensors; ranks hold different amounts
    xs = [torch.randn(3, 8, device="cpu") + 2, torch.randn(5, 8, device="cpu") * 4 - 1]
    masks = [torch.rand(3, 8, device="cpu") > 0.3, torch.rand(5, 8, device="cpu") > 0.6]
    spawn(_whiten_worker, xs, masks, str(tmp_path))
    got = torch.cat([torch.load(tmp_path / f"rank{r}.pt") for r in range(2)])
    expected = whiten_oracle(torch.cat(xs), torch.cat(masks))
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # Each rank's own statistics would differ: the all-reduce changed the answer.
    local = fastppo.masked_whiten(xs[0], masks[0])
    assert not torch.allclose(local, got[:3], atol=1e-3)


def group_oracle(scores, G, estimator, eps=1e-6):
    out = []
    for group in scores.double().view(-1, G):
        for i, s in enumerate(group):
            mean = group.mean()
            if estimator == "grpo":
                std = group.std() if G > 1 else torch.tensor(0.0, dtype=torch.float64)
                out.append((s - mean) / (std + eps))
            elif estimator == "rloo":
                others = torch.cat([group[:i], group[i + 1 :]])
                out.append(s - others.mean())
            else:
                out.append(s - mean)
    return torch.stack(out)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_group_advantages(estimator, G):
    if estimator == "rloo" and G == 1:
        with pytest.raises(ValueError, match="group_size >= 2"):
            fastppo.group_advantages(torch.randn(4), 1, estimator="rloo")
        return
    scores = torch.randn(3 * G)
    out = fastppo.group_advantages(scores, G, estimator=estimator)
    assert out.shape == scores.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), group_oracle(scores, G, estimator), rtol=1e-5, atol=1e-6)


def test_group_advantages_identical_scores_are_zero():
    out = fastppo.group_advantages(torch.ones(8), 4, estimator="grpo")
    assert (out == 0).all()


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.randn(7), 2), "not a multiple of group_size=2"),
        ((torch.randn(4), 0), "group_size must be a positive int"),
        ((torch.randn(2, 2), 2), "scores must be a 1-D floating tensor"),
    ],
)
def test_group_advantages_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        fastppo.group_advantages(*args)
    with pytest.raises(ValueError, match="estimator must be one of"):
        fastppo.group_advantages(torch.randn(4), 2, estimator="ppo")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_token_rewards(estimator):
    B, T = 4, 9
    scores = torch.randn(B)
    logprobs, ref_logprobs = -torch.rand(B, T) * 3, -torch.rand(B, T) * 3
    mask = torch.rand(B, T) > 0.3
    mask[2] = False  # no valid token: no reward anywhere
    mask[3] = True
    mask[3, -1] = False  # last valid token is not the last position
    out = fastppo.token_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=0.05, kl_estimator=estimator)

    d = logprobs.double() - ref_logprobs.double()
    kl = {"k1": d, "k2": d**2 / 2, "k3": torch.exp(-d) + d - 1}[estimator]
    expected = torch.where(mask, -0.05 * kl, 0.0)
    for b in range(B):
        valid = mask[b].nonzero()
        if len(valid):
            expected[b, valid[-1]] += scores[b].double()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    assert (out[2] == 0).all()


def test_kl_penalty_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.5, 0.0])
    ref = torch.tensor([-1.0, -1.0, -3.0, -40.0])
    d = (logp - ref).double()
    torch.testing.assert_close(fastppo.kl_penalty(logp, ref, "k1").double(), d)
    torch.testing.assert_close(fastppo.kl_penalty(logp, ref, "k2").double(), d**2 / 2)
    k3 = fastppo.kl_penalty(logp, ref, "k3")
    clamped = d.clamp(-20, 20)
    torch.testing.assert_close(k3.double(), torch.exp(-clamped) + clamped - 1, rtol=1e-6, atol=1e-6)
    assert (k3 >= 0).all() and torch.isfinite(k3).all()
    assert fastppo.kl_penalty(logp, logp, "k3").abs().max() == 0
    with pytest.raises(ValueError, match="estimator must be one of"):
        fastppo.kl_penalty(logp, ref, "k4")
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        fastppo.kl_penalty(logp, ref[:3])


def test_kl_penalty_gradient():
    logp = torch.randn(6, requires_grad=True)
    ref = torch.randn(6)
    fastppo.kl_penalty(logp, ref, "k3").sum().backward()
    expected = 1 - torch.exp(-(logp.detach() - ref))  # d/dd (exp(-d) + d - 1)
    torch.testing.assert_close(logp.grad, expected)
