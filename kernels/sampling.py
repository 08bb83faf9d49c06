"""Triton kernel that draws the next token of every row and its log-prob in one pass over the logits.

A rollout step has to turn logits ``(B, V)`` into a token per row and the token's log-prob under
``softmax(logits / T)``. Done with separate PyTorch ops that is an fp32 copy, a scaled copy, a
tensor of uniforms, two logs, an argmax and a log-softmax: about eight full passes over ``B x V``
fp32 values. Here each row is read once, in blocks of the vocabulary, carrying

    m, s          the running max and ``sum exp(z - m)`` of ``z = logits / T`` (log-sum-exp), and
    best, i, z_i  the largest ``z + g`` seen, its column, and its ``z``,

where ``g = -log(-log(u))`` is Gumbel noise: ``argmax(z + g)`` is an exact draw from
``softmax(z)`` (the Gumbel-max trick), with no normalisation and no second pass. The log-prob is
``z_i - (m + log s)``. Greedy mode skips the noise (log-prob then at the given scale).

The uniforms come from Triton's counter-based Philox-4x32 generator keyed by ``seed``. One Philox
evaluation (ten rounds of 32-bit multiplies) is more arithmetic than everything else the kernel
does for a logit, and it yields four numbers, so all four are used: column ``c`` of row ``r``
takes output ``c % 4`` of counter ``r * ceil(V / 4) + c // 4`` (int64). A draw thus depends on
the seed and the logits only, never on the tiling.

Ties go to the lowest column, as ``torch.argmax`` does. Rows are on grid axis 0, all offsets are
int64, and the seed is a runtime value that is never specialised, so a new seed per step
does not recompile.
"""

import triton
import triton.language as tl

from .logprobs import _tiling

# Uniforms are clamped to [2**-32, 1): a zero would give the column noise -inf and rule it out.
_SMALLEST_UNIFORM = tl.constexpr(2.0 ** -32)


@triton.jit(do_not_specialize=["seed"])
def _sample_kernel(
    logits_ptr, stride_b, stride_v,
    tokens_ptr, logp_ptr,
    inv_temp, seed, B, V,
    GREEDY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < B

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    best_col = tl.zeros((BLOCK_N,), tl.int64)
    best_z = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)  # (BLOCK_V,)
        ok = row_ok[:, None] & (cols < V)[None, :]
        z = tl.load(logits_ptr + rows[:, None] * stride_b + cols[None, :] * stride_v,
                    mask=ok, other=float("-inf")).to(tl.float32) * inv_temp  # (BLOCK_N, BLOCK_V)

        m_new = tl.maximum(m, tl.max(z, axis=1))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite while a row has seen only -inf
        s = s * tl.exp(m - ref) + tl.sum(tl.exp(z - ref[:, None]), axis=1)
        m = m_new

        if GREEDY:
            score = z
        else:
            counters = rows[:, None] * tl.cdiv(V, 4) + v0 // 4 + tl.arange(0, BLOCK_V // 4)[None, :]
            u0, u1, u2, u3 = tl.rand4x(seed, counters)  # (BLOCK_N, BLOCK_V // 4) each
            # Interleave so that column 4k + j takes output j of counter k.
            u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), (BLOCK_N, BLOCK_V))
            score = z - tl.log(-tl.log(tl.maximum(u, _SMALLEST_UNIFORM)))
        score = tl.where(ok, score, float("-inf"))
        block_best = tl.max(score, axis=1)  # (BLOCK_N,)
        block_col = v0 + tl.argmax(score, axis=1, tie_break_left=True).to(tl.int64)
        block_z = tl.sum(tl.where(cols[None, :] == block_col[:, None], z, 0.0), axis=1)
        better = block_best > best  # strictly: an equal score in a later block loses the tie
        best = tl.where(better, block_best, best)
        best_col = tl.where(better, block_col, best_col)
        best_z = tl.where(better, block_z, best_z)

    lse = tl.where(m == float("-inf"), 0.0, m) + tl.log(s)
    tl.store(tokens_ptr + rows, best_col, mask=row_ok)
    tl.store(logp_ptr + rows, best_z - lse, mask=row_ok)


def _sample_tiling(V, block_v):
    """(BLOCK_N, BLOCK_V, num_warps): the log-prob kernels' tiling, with blocks of 4 columns or more."""
    return _tiling(max(V, 4), block_v)


def sample_forward(logits, inv_temperature, greedy, seed, tokens, logprobs, *, block_v=None):
    """Fill ``tokens`` (int64) and ``logprobs`` (fp32), both ``(B,)``, from ``logits`` ``(B, V)``.

    ``inv_temperature`` scales the logits; ``greedy`` takes the argmax instead of a draw;
    ``seed`` (an int in ``[0, 2**63)``) keys the draw. ``block_v`` (tests) must be a multiple of 4.
    """
    B, V = logits.shape
    if B == 0:
        return
    BLOCK_N, BLOCK_V, num_warps = _sample_tiling(V, block_v)
    _sample_kernel[(triton.cdiv(B, BLOCK_N),)](
        logits, *logits.stride(),
        tokens, logprobs,
        inv_temperature, seed, B, V,
        GREEDY=greedy, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, num_warps=num_warps,
    )
