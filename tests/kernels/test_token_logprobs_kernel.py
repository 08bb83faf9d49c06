"""The log-prob kernels called through their launchers: many-block rows, multi-row tiles, in place.

The op tests cover semantics; these force small vocabulary blocks so that a handful of tokens
exercise the online-softmax loop across many blocks, a partial last block, and tiles of several
rows with a partial last tile, and they check the in-place mode the ops from hidden states rely on.
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastppo.ops import token_logprobs_torch
from fastppo.ops.dispatch import TRITON_INSTALLED
from tests.oracles import (
    LOGIT_SCALE_ATOL,
    assert_grad_close,
    assert_values_close,
    logprobs_grad_oracle,
    logprobs_oracle,
)

pytestmark = pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")

# CI checks a fixed set of examples; FASTPPO_HYPOTHESIS_EXAMPLES=N explores N fresh ones instead.
EXPLORE = os.environ.get("FASTPPO_HYPOTHESIS_EXAMPLES")


def run_kernels(logits, labels, inv_temperature, block_v, *, in_place=False):
    from fastppo.kernels import token_logprobs as kernels

    N = labels.numel()
    out = [torch.empty(N) for _ in range(3)]  # logp, entropy, lse
    rows = logits.view(1, N, -1)
    kernels.logprobs_forward(rows, labels, None, inv_temperature, -100, *out, block_v=block_v)
    g_logp, g_entropy = torch.randn(N), torch.randn(N)
    grad = rows if in_place else torch.empty_like(rows)
    kernels.logprobs_backward(
        rows, grad, labels, None, inv_temperature, -100, out[2], out[1], g_logp, g_entropy, block_v=block_v
    )
    return out[0], out[1], grad.view(N, -1), g_logp, g_entropy


@settings(max_examples=int(EXPLORE or 25), deadline=None, derandomize=EXPLORE is None)
@given(
    N=st.integers(1, 70),
    V=st.integers(1, 300),
    block_v=st.sampled_from([16, 32, 128]),
    temperature=st.floats(0.25, 4.0),
    scale=st.floats(0.1, 30.0),
    data=st.data(),
)
def test_kernels_match_oracle(N, V, block_v, temperature, scale, data):
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1)))  # the example fixes the tensors too
    logits = torch.randn(N, V) * scale
    labels = torch.tensor(data.draw(st.lists(st.sampled_from([-100, 0, V - 1, V // 2]), min_size=N, max_size=N)))
    logp, entropy, grad, g_logp, g_entropy = run_kernels(logits, labels, 1.0 / temperature, block_v)
    ref_logp, ref_entropy = logprobs_oracle(logits, labels, temperature)
    logit_scale = logits.abs().max().item() / temperature
    assert_values_close(logp, ref_logp, torch.float32, logit_scale)
    assert_values_close(entropy, ref_entropy, torch.float32, logit_scale)
    ref_grad = logprobs_grad_oracle(logits, labels, g_logp, g_entropy, temperature)
    if ref_grad.norm() > 0:
        floor = LOGIT_SCALE_ATOL * logit_scale * g_entropy.double().norm().item()
        assert_grad_close(grad, ref_grad, torch.float32, atol=floor)
    else:
        assert (grad == 0).all()


def test_in_place_backward_matches_out_of_place():
    logits = torch.randn(9, 130) * 5
    labels = torch.randint(0, 130, (9,))
    torch.manual_seed(1)
    *_, expected, _, _ = run_kernels(logits.clone(), labels, 0.7, 32)
    torch.manual_seed(1)
    buffer = logits.clone()
    *_, in_place, _, _ = run_kernels(buffer, labels, 0.7, 32, in_place=True)
    assert in_place.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(in_place, expected, rtol=0, atol=0)


def test_backward_writes_a_half_gradient_of_fp32_logits():
    # The ops from hidden states on CUDA: fp32 logits in, the gradient out in the matmuls' bf16.
    from fastppo.kernels import token_logprobs as kernels

    logits = torch.randn(1, 9, 130) * 5
    labels = torch.randint(0, 130, (9,))
    labels[3] = -100
    logp, entropy, lse = (torch.empty(9) for _ in range(3))
    kernels.logprobs_forward(logits, labels, None, 0.7, -100, logp, entropy, lse, block_v=32)
    g_logp, g_entropy = torch.randn(9), torch.randn(9)
    full = torch.empty_like(logits)
    half = torch.empty_like(logits, dtype=torch.bfloat16)
    for grad in (full, half):
        kernels.logprobs_backward(logits, grad, labels, None, 0.7, -100, lse, entropy, g_logp, g_entropy, block_v=32)
    torch.testing.assert_close(half.float(), full, rtol=2**-7, atol=0)  # one bf16 rounding (the interpreter's)
    assert (half[0, 3] == 0).all()


def test_kernels_and_twin_agree():
    from fastppo.kernels import token_logprobs as kernels

    logits = (torch.randn(3, 7, 300) * 3).bfloat16()
    labels = torch.randint(0, 300, (21,))
    labels[4] = -100
    temperature = torch.rand(21) + 0.5
    results = {}
    for name, impl in (("triton", kernels), ("torch", token_logprobs_torch)):
        out = [torch.empty(21) for _ in range(3)]
        impl.logprobs_forward(logits, labels, temperature, 1.0, -100, *out)
        grad = torch.empty_like(logits)
        impl.logprobs_backward(
            logits, grad, labels, temperature, 1.0, -100, out[2], out[1], torch.ones(21), torch.ones(21)
        )
        results[name] = (out, grad.float())
    for a, b in zip(results["triton"][0], results["torch"][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # The gradients are stored in bf16: equal up to one rounding step (2**-8 relative).
    torch.testing.assert_close(results["triton"][1], results["torch"][1], rtol=2**-7, atol=1e-6)


def test_temperature_and_ignore_index_are_runtime_arguments():
    # Only tile sizes and feature switches are compile-time constants: a new temperature or
    # ignore_index never compiles a new kernel.
    from fastppo.kernels import token_logprobs as kernels

    for kernel in (kernels._logprobs_fwd_kernel, kernels._logprobs_bwd_kernel):
        constexprs = set(kernel.fn.__annotations__)
        assert {"inv_temp", "ignore_index", "N", "T", "V_units"}.isdisjoint(constexprs)
        # UNIT, the power of two (1 to 16) dividing the row strides and V, takes five values at most;
        # VEC and GRAD_VEC (elements per 16 bytes, or 1) three each.
        assert constexprs <= {
            "HAS_TEMP",
            "HAS_G_ENT",
            "HAS_STATS",
            "UNIT",
            "VEC",
            "GRAD_VEC",
            "BLOCK_N",
            "BLOCK_V",
            "EDGE_V",
        }
        assert {"first", "body"}.isdisjoint(constexprs)


def test_the_row_unit_is_the_largest_power_of_two_up_to_16_dividing_every_row_stride_and_v():
    from fastppo.kernels.contract import row_unit

    assert row_unit(1000, 1000 * 7, 1000) == 8
    assert row_unit(151936, 151936) == 16
    assert row_unit(1000, 1004 * 7, 1004) == 4
    assert row_unit(17, 17) == 1
    assert row_unit(64, 0, 64) == 16  # an expanded dimension (stride 0) constrains nothing


@pytest.mark.parametrize("width", [1000, 1004, 1001])  # row units 8, 4 and 1 for V = 1000
def test_rows_read_in_units_agree_with_the_twin(width):
    # V = 1000 inside rows `width` apart: the launchers pass strides and V in units of 8, 4 or 1.
    from fastppo.kernels import token_logprobs as kernels

    logits = (torch.randn(2, 3, width) * 3).bfloat16()[:, :, :1000]
    labels = torch.tensor([0, 999, 5, -100, 998, 17])
    results = {}
    for name, impl in (("triton", kernels), ("torch", token_logprobs_torch)):
        out = [torch.empty(6) for _ in range(3)]
        impl.logprobs_forward(logits, labels, None, 1.0, -100, *out)
        grad = torch.zeros(2, 3, width, dtype=torch.bfloat16)
        impl.logprobs_backward(logits, grad[:, :, :1000], labels, None, 1.0, -100, out[2], out[1], torch.ones(6), None)
        results[name] = (out, grad.float())
    for a, b in zip(results["triton"][0], results["torch"][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results["triton"][1], results["torch"][1], rtol=2**-7, atol=1e-6)
    assert (results["triton"][1][:, :, 1000:] == 0).all()  # nothing written past a row's V
