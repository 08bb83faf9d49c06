"""Triton kernel for generalised advantage estimation (GAE) as one reverse scan per row.

GAE is a first-order linear recurrence run right to left, ``A_t = delta_t + gamma * lam * A_t'``,
so instead of a Python loop over T (T launches of several kernels each) the whole batch is one
launch: each program owns ``BLOCK_B`` rows and walks them from the right in blocks of
``BLOCK_T`` positions, scanning each block in parallel and carrying the state at the block's
left edge into the next block.

Holes in the mask (tool output inside a response, say) are skipped as if absent. With ``n(t)``
the next valid position after a valid ``t``::

    A_t = r_t - V_t + gamma * V_n(t) + gamma * lam * A_n(t)

so the pair ``S_t = (A_t, V_t)`` follows ``S_t = M S_n(t) + c_t`` with ``M = [[gamma * lam,
gamma], [0, 0]]`` and ``c_t = (r_t - V_t, V_t)``. Written for every position, with ``S(t)`` the
state at the first valid position at or after ``t``, a hole is the identity:
``S(t) = (m_t M + (1 - m_t) I) S(t + 1) + m_t c_t``. That is one affine recurrence of
upper-triangular 2x2 maps (five numbers: ``a, b, d`` of the matrix, ``e, f`` of the offset), and
it reads every input only at its own position: blocks are loaded in forward order, 16 bytes at
a time, and scanned with ``reverse=True``. (Two scalar recurrences, for the next valid value and
then the advantage, would need each value again one position to the right: a second, misaligned
load.)
"""

import triton
import triton.language as tl


@triton.jit
def _compose(a_r, b_r, d_r, e_r, f_r, a_l, b_l, d_l, e_l, f_l):
    # (left o right)(x) = L (R x + c_r) + c_l for L = [[a_l, b_l], [0, d_l]]: the reverse scan
    # combines the maps of later positions (right) with the next earlier one (left).
    return (a_l * a_r, a_l * b_r + b_l * d_r, d_l * d_r, a_l * e_r + b_l * f_r + e_l, d_l * f_r + f_l)


@triton.jit
def _left_edge(x, j):
    # x: (BLOCK_B, BLOCK_T) -> (BLOCK_B,) its value at the block's first (leftmost) position
    return tl.sum(tl.where(j[None, :] == 0, x, 0.0), axis=1)


@triton.jit
def _gae_kernel(
    rewards_ptr,
    srb,
    srt,
    values_ptr,
    svb,
    svt,
    mask_ptr,
    smb,
    smt,
    adv_ptr,
    ret_ptr,
    B,
    T,
    gamma,
    gamma_lam,
    BLOCK_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)  # (BLOCK_B,)
    row_ok = rows[:, None] < B
    j = tl.arange(0, BLOCK_T)  # position in the block, left to right
    next_adv = tl.zeros((BLOCK_B,), tl.float32)  # S at the first valid position right of the block
    next_value = tl.zeros((BLOCK_B,), tl.float32)
    blocks = tl.cdiv(T, BLOCK_T)
    for k in range(0, blocks):
        t = ((blocks - 1 - k) * BLOCK_T + j).to(tl.int64)[None, :]  # (1, BLOCK_T), blocks right to left
        ok = row_ok & (t < T)
        m = tl.load(mask_ptr + rows[:, None] * smb + t * smt, mask=ok, other=0) != 0
        # Masked positions may hold NaN or inf: select, never multiply by m (0 * NaN is NaN).
        r = tl.where(m, tl.load(rewards_ptr + rows[:, None] * srb + t * srt, mask=ok, other=0.0), 0.0).to(tl.float32)
        v = tl.where(m, tl.load(values_ptr + rows[:, None] * svb + t * svt, mask=ok, other=0.0), 0.0).to(tl.float32)
        one = tl.full(r.shape, 1.0, tl.float32)
        zero = tl.zeros_like(r)
        a, b, d, e, f = tl.associative_scan(
            (tl.where(m, gamma_lam, one), tl.where(m, gamma, zero), tl.where(m, zero, one), r - v, v),
            axis=1,
            combine_fn=_compose,
            reverse=True,
        )
        adv = a * next_adv[:, None] + b * next_value[:, None] + e  # (BLOCK_B, BLOCK_T): A at S(t)
        value = d * next_value[:, None] + f
        # +0 exactly where masked, not m * adv = -0; returns are A + V at valid positions.
        tl.store(adv_ptr + rows[:, None] * T + t, tl.where(m, adv, 0.0), mask=ok)
        tl.store(ret_ptr + rows[:, None] * T + t, tl.where(m, adv + v, 0.0), mask=ok)
        next_adv = _left_edge(adv, j)
        next_value = _left_edge(value, j)


def _tiling(B, T, block_t):
    """(BLOCK_B, BLOCK_T, num_warps): tiles of up to 1024 positions, one row of a long rollout per
    program. Two rows per program (2048-element tiles) halved the programs and lengthened each
    trip's scan: 58% of copy against 71% on triton 3.6, 98% against 100% on 3.9, at [512, 8192]
    (``fastppo bench --sass``)."""
    BLOCK_T = block_t or min(triton.next_power_of_2(max(T, 1)), 1024)
    BLOCK_B = max(1, min(triton.next_power_of_2(max(B, 1)), 1024 // BLOCK_T))
    return BLOCK_B, BLOCK_T, 4


def gae(rewards, values, mask, gamma, lam, advantages, returns, *, block_t=None):
    """The launcher ``kernels/contract.py`` declares; ``block_t`` overrides the time tile."""
    B, T = rewards.shape
    if B == 0 or T == 0:
        return
    BLOCK_B, BLOCK_T, num_warps = _tiling(B, T, block_t)
    _gae_kernel[(triton.cdiv(B, BLOCK_B),)](
        rewards,
        rewards.stride(0),
        rewards.stride(1),
        values,
        values.stride(0),
        values.stride(1),
        mask,
        mask.stride(0),
        mask.stride(1),
        advantages,
        returns,
        B,
        T,
        gamma,
        gamma * lam,
        BLOCK_B=BLOCK_B,
        BLOCK_T=BLOCK_T,
        num_warps=num_warps,
    )
