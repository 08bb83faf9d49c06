"""Rows that start between 16-byte vectors (an odd vocabulary such as GPT-2's 50,257, a padded or
offset view): the kernels read each row's aligned body in whole vectors and its two ragged edges
apart (``kernels/vectors.py``). Small blocks make the body several tiles long, so the edges, the
body and their seams are all exercised; every result is held to the float64 oracle (greedy draws
to the first argmax, as the sampler reads shifted rows by their bodies only when greedy).
"""

import pytest
import torch

from fastppo.ops import token_logprobs_torch
from fastppo.ops.dispatch import TRITON_INSTALLED
from tests.oracles import assert_grad_close, assert_values_close, logprobs_grad_oracle, logprobs_oracle

pytestmark = pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")

V = 301  # odd: row r starts r * 301 elements in, at every offset modulo a vector


def shifted_rows(N, dtype, offset=0, pad=0):
    """(N, V) logits whose rows lie ``V + pad`` apart, starting ``offset`` elements into their storage."""
    storage = torch.randn(N * (V + pad) + offset) * 3
    rows = storage.to(dtype)[offset:].view(N, V + pad)[:, :V]
    rows[0, 0], rows[1, V - 1], rows[2, 150] = 12.0, 12.0, float("-inf")  # a head, a tail, a body column
    return rows


def labels_for(N):
    labels = torch.randint(0, V, (N,))
    labels[:4] = torch.tensor([0, V - 1, 3, 150])  # a head column, the last column, near the seams
    labels[5] = -100
    return labels


def test_the_rows_here_take_the_shifted_path():
    from fastppo.kernels.contract import row_unit
    from fastppo.kernels.vectors import row_shift

    for dtype, vec in ((torch.bfloat16, 8), (torch.float32, 4)):
        rows = shifted_rows(4, dtype, offset=1)
        assert row_shift(rows, row_unit(V, rows.stride(0))) == (vec, (rows.data_ptr() // rows.element_size()) % vec)
    aligned = torch.randn(4, 1024).bfloat16()
    assert row_shift(aligned, row_unit(1024, 1024))[0] == 1  # rows already on vectors: read as they are


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset,pad", [(0, 0), (1, 0), (3, 5)])
@pytest.mark.parametrize("block_v", [32, 64])
def test_log_probs_and_gradients_of_shifted_rows_match_the_oracle(dtype, offset, pad, block_v):
    from fastppo.kernels import token_logprobs as kernels

    N = 11
    x = shifted_rows(N, dtype, offset, pad)
    labels = labels_for(N)
    logp, entropy, lse = (torch.empty(N) for _ in range(3))
    kernels.logprobs_forward(x.unsqueeze(0), labels, None, 1 / 0.7, -100, logp, entropy, lse, block_v=block_v)
    ref_logp, ref_entropy = logprobs_oracle(x, labels, 0.7)
    assert_values_close(logp, ref_logp, dtype, logit_scale=12 / 0.7)
    assert_values_close(entropy, ref_entropy, dtype, logit_scale=12 / 0.7)

    g_logp, g_entropy = torch.randn(N), torch.randn(N)
    expected = logprobs_grad_oracle(x, labels, g_logp, g_entropy, 0.7)
    # Into a gradient laid out as the logits (its body stored in vectors too), and into a dense one.
    for grad in (torch.full_like(x, float("nan")), torch.full((N, V), float("nan"), dtype=dtype)):
        kernels.logprobs_backward(
            x.unsqueeze(0), grad.unsqueeze(0), labels, None, 1 / 0.7, -100, lse, entropy, g_logp, g_entropy,
            block_v=block_v,
        )  # fmt: skip
        assert_grad_close(grad, expected, dtype)


def test_statistics_of_shifted_rows_match_the_twin():
    from fastppo.kernels import token_logprobs as kernels

    N = 9
    x = shifted_rows(N, torch.float32, offset=1)
    x[6, 200] = x[6].max() + 1  # the label (below) is then the first argmax
    labels = labels_for(N)
    labels[6] = 200
    results = []
    for impl, block_v in ((kernels, {"block_v": 32}), (token_logprobs_torch, {})):
        out = [torch.empty(N) for _ in range(3)] + [torch.empty(N, 3)]
        impl.logprobs_forward(x.unsqueeze(0), labels, None, 1.0, -100, *out, **block_v)
        results.append(out)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    assert results[0][3][6, 2] == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("splits", [None, 2, 4])
def test_greedy_draws_from_shifted_rows_are_the_first_argmax_and_its_log_prob(dtype, offset, splits):
    from tests.ops.test_sample_tokens import run_kernel

    x = shifted_rows(13, dtype, offset)
    tokens, logprobs = run_kernel(x, 0, 0, block_v=32, splits=splits)
    assert torch.equal(tokens, x.double().argmax(dim=1))
    expected = torch.log_softmax(x.double(), dim=1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), expected, rtol=0, atol=1e-4 if dtype == torch.bfloat16 else 2e-5)


@pytest.mark.parametrize("offset", [0, 3])
def test_sampled_draws_from_rows_of_an_odd_vocabulary_are_the_oracle_draw(offset):
    # Drawn (not greedy), the rows are read as they lie; the draw is the oracle's all the same.
    from tests.ops.test_sample_tokens import gumbel_oracle, run_kernel

    x = shifted_rows(13, torch.bfloat16, offset)
    for splits in (None, 4):
        tokens, logprobs = run_kernel(x, 0.8, 2**40 + 7, block_v=32, splits=splits)
        ref_tokens, ref_logprobs, gap = gumbel_oracle(x, 0.8, 2**40 + 7)
        clear = gap > 1e-4
        assert clear.sum() >= 12 and torch.equal(tokens[clear], ref_tokens[clear])
        torch.testing.assert_close(logprobs.double()[clear], ref_logprobs[clear], rtol=0, atol=1e-4)


@pytest.mark.parametrize("splits,tile", [(1, 1), (2, 5)])  # with 2 splits the second's body starts at tile 5
def test_greedy_ties_across_the_head_the_body_and_the_tail_go_to_the_lowest_column(splits, tile):
    from tests.ops.test_sample_tokens import run_kernel

    x = shifted_rows(8, torch.float32, offset=1)
    x[:] = x.clamp(max=5)
    first = x.data_ptr() // 4 % 4
    head = [(-(row * V + first)) % 4 for row in range(8)]  # fp32 vectors of 4
    # A head column and a body column of the same lane in the same program (blocks of 32, the body
    # from column head on): the body is read first, so the tie must go back to the head's column.
    rows = {row: [head[row] - 1, head[row] + 32 * tile + head[row] - 1] for row in range(8) if head[row] > 0}
    assert len(rows) >= 4
    rows[next(iter(rows))] += [V - 1]  # and the last column too
    for row, tied in rows.items():
        x[row, tied] = 9.0
    tokens, _ = run_kernel(x, 0, 0, block_v=32, splits=splits)
    for row, tied in rows.items():
        assert tokens[row] == min(tied), (row, tied)


def test_a_half_gradient_of_fp32_logits_is_stored_in_vectors_by_the_wider_head():
    # As the ops from hidden states write on CUDA: fp32 logits chunks, a bf16 gradient of the same
    # rows. Heads are counted in 8-element (bf16) vectors, which are 4-element (fp32) ones too.
    from fastppo.kernels import token_logprobs as kernels
    from fastppo.kernels.contract import row_unit
    from fastppo.kernels.vectors import shared_shift

    N = 10
    x = shifted_rows(N, torch.float32)
    grad = torch.full((N, V), float("nan"), dtype=torch.bfloat16)
    if x.data_ptr() % 16 == 0 and grad.data_ptr() % 16 == 0:  # as CUDA allocations always are
        assert shared_shift(x, grad, row_unit(V, V)) == (8, 8, 0)
    labels = labels_for(N)
    logp, entropy, lse = (torch.empty(N) for _ in range(3))
    kernels.logprobs_forward(x.unsqueeze(0), labels, None, 1.0, -100, logp, entropy, lse, block_v=32)
    g_logp, g_entropy = torch.randn(N), torch.randn(N)
    kernels.logprobs_backward(
        x.unsqueeze(0), grad.unsqueeze(0), labels, None, 1.0, -100, lse, entropy, g_logp, g_entropy, block_v=32
    )
    assert_grad_close(grad, logprobs_grad_oracle(x, labels, g_logp, g_entropy), torch.bfloat16)
