"""Triton kernel for generalised advantage estimation (GAE) as one reverse scan per row.

GAE is a first-order linear recurrence run right to left, ``A_t = delta_t + gamma * lam * A_t'``,
so instead of a Python loop over T (T launches of several kernels each) the whole batch is one
launch: each program owns ``BLOCK_B`` rows and walks them from the right in blocks of
``BLOCK_T`` positions, scanning each block in parallel and carrying the value at the block's
left edge into the next block.

Holes in the mask (tool output inside a response, say) are skipped as if absent. Two affine
recurrences ``x_t = a_t * x_{t+1} + b_t`` express that, both scanned with the same operator:

* the value at the next valid position: ``a_t = 1 - m_{t+1}``, ``b_t = m_{t+1} * V_{t+1}``;
* the advantage carried from the next valid position: ``a_t = m_t * gamma * lam + (1 - m_t)``,
  ``b_t = m_t * delta_t`` with ``delta_t = r_t + gamma * V_next(t) - V_t``.

A block is loaded right to left (index 0 is its rightmost position) and scanned forwards, so
the combine function only relies on the usual forward-scan order (accumulated, new element).
"""

import triton
import triton.language as tl


@triton.jit
def _compose(a_right, b_right, a_left, b_left):
    # (left o right)(x) = a_left * (a_right * x + b_right) + b_left
    return a_left * a_right, a_left * b_right + b_left


@triton.jit
def _left_edge(x, j, BLOCK_T: tl.constexpr):
    # x: (BLOCK_B, BLOCK_T) in right-to-left order -> (BLOCK_B,) value at the block's left edge
    return tl.sum(tl.where(j[None, :] == BLOCK_T - 1, x, 0.0), axis=1)


@triton.jit
def _gae_kernel(
    rewards_ptr, srb, srt, values_ptr, svb, svt, mask_ptr, smb, smt,
    adv_ptr, ret_ptr,
    B, T, gamma, gamma_lam,
    BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)  # (BLOCK_B,)
    row_ok = rows[:, None] < B
    j = tl.arange(0, BLOCK_T)  # position in the block, right to left
    next_value = tl.zeros((BLOCK_B,), tl.float32)  # V at the first valid position right of the block
    next_adv = tl.zeros((BLOCK_B,), tl.float32)  # A at the first valid position right of the block
    for start in range(0, T, BLOCK_T):
        t = (T - start - 1 - j).to(tl.int64)[None, :]  # (1, BLOCK_T) positions, decreasing
        ok = row_ok & (t >= 0)  # the last block runs past the row's start: those lanes read nothing
        ok_next = ok & (t + 1 < T)
        m = (tl.load(mask_ptr + rows[:, None] * smb + t * smt, mask=ok, other=0) != 0).to(tl.float32)
        # Masked positions may hold NaN or inf: select, never multiply by m (0 * NaN is NaN).
        r = tl.where(m != 0, tl.load(rewards_ptr + rows[:, None] * srb + t * srt, mask=ok, other=0.0), 0.0)
        v = tl.where(m != 0, tl.load(values_ptr + rows[:, None] * svb + t * svt, mask=ok, other=0.0), 0.0)
        r, v = r.to(tl.float32), v.to(tl.float32)
        m1 = (tl.load(mask_ptr + rows[:, None] * smb + (t + 1) * smt, mask=ok_next, other=0) != 0).to(tl.float32)
        v1 = tl.load(values_ptr + rows[:, None] * svb + (t + 1) * svt, mask=ok_next, other=0.0)
        v1 = tl.where(m1 != 0, v1, 0.0).to(tl.float32)

        a, b = tl.associative_scan((1.0 - m1, m1 * v1), axis=1, combine_fn=_compose)
        v_next = a * next_value[:, None] + b  # (BLOCK_B, BLOCK_T)
        delta = m * (r + gamma * v_next - v)
        a, b = tl.associative_scan((m * gamma_lam + (1.0 - m), delta), axis=1, combine_fn=_compose)
        carried = a * next_adv[:, None] + b
        adv = tl.where(m != 0, carried, 0.0)  # +0 exactly where masked, not m * carried = -0
        tl.store(adv_ptr + rows[:, None] * T + t, adv, mask=ok)
        tl.store(ret_ptr + rows[:, None] * T + t, tl.where(m != 0, adv + v, 0.0), mask=ok)
        next_value = _left_edge(v_next, j, BLOCK_T)
        next_adv = _left_edge(carried, j, BLOCK_T)


def _tiling(B, T, block_t):
    BLOCK_T = block_t or min(triton.next_power_of_2(max(T, 1)), 1024)
    BLOCK_B = max(1, min(triton.next_power_of_2(max(B, 1)), 2048 // BLOCK_T))
    return BLOCK_B, BLOCK_T


def gae(rewards, values, mask, gamma, lam, advantages, returns, *, block_t=None):
    """Fill ``advantages`` and ``returns`` (contiguous fp32 ``(B, T)``) from ``(B, T)`` inputs.

    ``rewards`` and ``values`` are any float dtype and strides; ``mask`` is bool or numeric,
    nonzero where the position is part of the trajectory.
    """
    B, T = rewards.shape
    if B == 0 or T == 0:
        return
    BLOCK_B, BLOCK_T = _tiling(B, T, block_t)
    _gae_kernel[(triton.cdiv(B, BLOCK_B),)](
        rewards, rewards.stride(0), rewards.stride(1), values, values.stride(0), values.stride(1),
        mask, mask.stride(0), mask.stride(1),
        advantages, returns,
        B, T, gamma, gamma * lam,
        BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T, num_warps=4,
    )
