"""gae against a plain float64 double loop, on both backends, with holes and edge cases."""

import pytest
import torch

import fastppo
from fastppo.ops import gae_torch
from fastppo.ops.dispatch import TRITON_INSTALLED
from tests.oracles import gae_oracle, relative_error


def random_mask(B, T, *, p_hole=0.2):
    """Holes, plus the shapes trainers produce: left padding, right padding, empty rows."""
    mask = torch.rand(B, T) > p_hole
    if B >= 3:
        mask[0, : T // 3] = False  # a leading masked run (left-padded prompt)
        mask[1, -(T // 3 + 1) :] = False  # a trailing masked run (right padding)
        mask[2] = False  # an empty row
    return mask


def check_gae(rewards, values, mask, gamma, lam, backend):
    adv, ret = fastppo.gae(rewards, values, mask, gamma=gamma, lam=lam, backend=backend)
    ref_adv, ref_ret = gae_oracle(rewards.double(), values.double(), mask != 0, gamma, lam)
    assert adv.dtype == ret.dtype == torch.float32 and adv.shape == rewards.shape
    masked = mask == 0
    assert (adv[masked] == 0).all() and (ret[masked] == 0).all()
    assert not torch.signbit(adv[masked]).any()  # +0, not -0
    for out, ref in ((adv, ref_adv), (ret, ref_ret)):
        assert torch.isfinite(out).all()
        assert relative_error(out, ref) <= 1e-5
    return adv, ret


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.95, 1.0])
@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
def test_matches_oracle(backend, gamma, lam):
    rewards, values = torch.randn(5, 37), torch.randn(5, 37)
    check_gae(rewards, values, random_mask(5, 37), gamma, lam, backend)


@pytest.mark.parametrize("B,T", [(1, 1), (4, 1), (3, 2), (2, 5000), (70, 3)])
def test_shapes(backend, B, T):
    check_gae(torch.randn(B, T), torch.randn(B, T), random_mask(B, T), 0.99, 0.95, backend)


def test_sparse_reward_at_the_end(backend):
    # The usual PPO case: reward only at the last response token, values everywhere.
    B, T = 4, 50
    lengths = torch.tensor([50, 31, 7, 1])
    mask = torch.arange(T) < lengths.unsqueeze(1)
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randn(B)
    check_gae(rewards, torch.randn(B, T), mask, 1.0, 0.95, backend)


def test_input_dtypes_strides_and_mask_kinds(backend):
    base_r, base_v = torch.randn(6, 41), torch.randn(41, 6)
    mask = random_mask(6, 40)
    rewards = base_r[:, 1:].bfloat16()  # strided, half precision
    values = base_v.T[:, :-1]  # column-major view
    for m in (mask, mask.float(), mask.long()):
        check_gae(rewards, values, m, 0.9, 0.8, backend)


def test_gamma_one_lam_one_is_reward_to_go_minus_value(backend):
    rewards, values = torch.randn(3, 20), torch.randn(3, 20)
    mask = torch.ones(3, 20, dtype=torch.bool)
    adv, ret = fastppo.gae(rewards, values, mask, gamma=1.0, lam=1.0, backend=backend)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(ret, reward_to_go, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv, reward_to_go - values, rtol=1e-5, atol=1e-5)


def test_no_gradient_flows(backend):
    values = torch.randn(2, 6, requires_grad=True)
    adv, ret = fastppo.gae(torch.randn(2, 6), values, torch.ones(2, 6, dtype=torch.bool), backend=backend)
    assert not adv.requires_grad and not ret.requires_grad


@pytest.mark.parametrize("chunk_elements", [10, 40, 100])
def test_twin_row_chunks(monkeypatch, chunk_elements):
    # T = 37: one row per chunk (10, 40) or two rows per chunk with a partial last chunk (100).
    monkeypatch.setattr(gae_torch, "CHUNK_ELEMENTS", chunk_elements)
    check_gae(torch.randn(5, 37), torch.randn(5, 37), random_mask(5, 37), 0.9, 0.8, "torch")


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.parametrize("block_t", [4, 16])
def test_kernel_carries_across_blocks(block_t):
    from fastppo.kernels import gae as kernel

    B, T = 5, 45  # 45 positions in blocks of 4 or 16: a partial leftmost block
    rewards, values, mask = torch.randn(B, T), torch.randn(B, T), random_mask(B, T, p_hole=0.5)
    adv, ret = torch.empty(B, T), torch.empty(B, T)
    kernel.gae(rewards, values, mask, 0.97, 0.9, adv, ret, block_t=block_t)
    ref_adv, ref_ret = gae_oracle(rewards.double(), values.double(), mask, 0.97, 0.9)
    assert relative_error(adv, ref_adv) <= 1e-5 and relative_error(ret, ref_ret) <= 1e-5


def test_compiles_without_graph_breaks():
    rewards, values, mask = torch.randn(2, 9), torch.randn(2, 9), random_mask(2, 9)
    compiled = torch.compile(lambda r, v, m: fastppo.gae(r, v, m, gamma=0.9), fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(rewards, values, mask), fastppo.gae(rewards, values, mask, gamma=0.9)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(values=torch.randn(3, 5)), ValueError, r"values has shape \(3, 5\) but rewards has \(2, 5\)"),
        (dict(mask=torch.ones(2, 4)), ValueError, "mask has shape"),
        (dict(rewards=torch.randn(10)), ValueError, r"rewards must have shape \(B, T\)"),
        (dict(rewards=torch.ones(2, 5, dtype=torch.long)), TypeError, "rewards must be a floating tensor"),
        (dict(gamma=1.5), ValueError, r"gamma must be a number in \[0, 1\]"),
        (dict(lam=-0.1), ValueError, r"lam must be a number in \[0, 1\]"),
        (dict(mask=torch.ones(2, 5, device="meta")), ValueError, "mask is on meta but rewards is on "),
    ],
)
def test_bad_input(kwargs, error, match):
    args = dict(rewards=torch.randn(2, 5), values=torch.randn(2, 5), mask=torch.ones(2, 5))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        fastppo.gae(args.pop("rewards"), args.pop("values"), args.pop("mask"), **args)
