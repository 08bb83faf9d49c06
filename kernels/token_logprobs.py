"""Triton kernels for per-token log-probs and entropy of a softmax over the vocabulary.

Two kernels, both one pass over the logits:

* ``_logprobs_fwd_kernel`` reads each row once and produces the label's log-prob, the entropy and
  the log-sum-exp (kept for the backward). It runs an online softmax over blocks of the
  vocabulary, so V may be any size, carrying for every row

      m = running max,   s = sum exp(z - m),   w = sum exp(z - m) * (z - m).

  Then ``lse = m + log s`` and ``entropy = log s - w / s``. Accumulating ``w`` relative to the
  running max (instead of ``sum p * z``) keeps the entropy free of the cancellation that
  ``lse - sum p z`` suffers when logits are large. With ``HAS_STATS`` the same pass also
  carries ``q = sum exp(2 (z - m))``, ``sum z`` and the largest ``z`` before the label, for
  three statistics of the head that SFT and preference trainers log (``stats`` ``(N, 3)``):
  ``log sum p^2 = log q - 2 log s``, the mean of ``z``, and whether the label is the first
  argmax (1.0 or 0.0). The loop runs in base 2 (log2(e) folded into each row's scale, one
  flush-to-zero ``exp2`` per element, ``fastmath.py``); ``lse`` and the entropy come out in
  natural units.

* ``_logprobs_bwd_kernel`` reads each row once more and writes the gradient with respect to the
  logits, for upstream gradients ``g_lp`` (of the log-prob) and ``g_ent`` (of the entropy):

      dz_j = g_lp * (onehot_j - p_j) - g_ent * p_j * (log p_j + entropy),   dlogits = dz / T.

  The output pointer may alias the input (on a CPU the ops from hidden states overwrite their
  fp32 logits chunk with its gradient), or have another dtype (on CUDA they write a half
  gradient for the matmuls): every element is read before it is written, by the same program.

Rows labelled ``ignore_index`` are never read: their outputs are 0, their gradient is written as
exact zeros, and in the forward a tile of such rows skips the vocabulary loop.

Logits are addressed as a ``(B, T, V)`` view with arbitrary strides, so slices such as
``logits[:, :-1]`` are read in place with no copy. Rows that start between 16-byte vectors (an
odd vocabulary: GPT-2's 50,257) are read, and their gradient written, as an aligned body in whole
vectors and two masked edges (``vectors.py``). Rows are indexed on grid axis 0 (no 65,535
limit) and all offsets are int64. A program handles ``BLOCK_N`` rows at once, so small
vocabularies do not waste a program per row. Temperature is a runtime value (a scalar or a
per-row tensor), never a compile-time constant.
"""

import triton
import triton.language as tl

from .contract import row_unit
from .fastmath import LN2, LOG2E, exp2, log2
from .vectors import EDGE_TILE, body_columns, body_start, edge_columns, row_shift, shared_shift

# Where exp2 underflows to 0 (flush to zero): differences below it are clamped before use.
_EXP2_FLOOR = tl.constexpr(126.0)


@triton.jit
def _row_offsets(rows, T, stride_b, stride_t, UNIT: tl.constexpr):
    # rows: (BLOCK_N,) int64 -> offset of each row's first element in a (B, T, V) strided view
    # whose row strides are given in units of UNIT elements (so the offsets are multiples of it)
    b = rows // T
    return (b * stride_b + (rows - b * T) * stride_t) * UNIT


@triton.jit
def _inverse_temperature(temp_ptr, rows, row_ok, inv_temp, HAS_TEMP: tl.constexpr):
    # -> (BLOCK_N,) fp32: 1 / the row's temperature, or the scalar for every row
    if HAS_TEMP:
        scale = 1.0 / tl.load(temp_ptr + rows, mask=row_ok, other=1.0).to(tl.float32)
    else:
        scale = tl.zeros_like(rows).to(tl.float32) + inv_temp
    return scale


@triton.jit
def _fwd_tile(x, cols, ok, labels, scale2, m_x, m, s, w, q, x_sum, before, HAS_STATS: tl.constexpr):
    # One tile of logits x (BLOCK_N, BLOCK_V) fp32, unscaled, -inf where not ok, at columns cols
    # (broadcastable to x) -> the running statistics of the online softmax, updated.
    # The scale is positive (or NaN, which then reaches every output): max(x) * scale2 is
    # max(y), so the scale costs one FFMA per element, inside d = x * scale2 - ref.
    m_x = tl.maximum(m_x, tl.max(x, axis=1))
    m_new = m_x * scale2
    # While a row has seen only -inf, keep its reference point finite so no inf - inf appears.
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    shift = tl.where(m == float("-inf"), 0.0, m - ref)  # <= 0
    decay = exp2(shift)
    d = x * scale2[:, None] - ref[:, None]
    e = exp2(d)
    # e * d is 0 * -inf = NaN at a -inf logit: clamping d (where e is already 0) costs one
    # instruction where a select on the logit cost two, and keeps a NaN logit's NaN.
    w = decay * (w + shift * s) + tl.sum(e * tl.maximum(d, -_EXP2_FLOOR), axis=1)
    s = decay * s + tl.sum(e, axis=1)
    if HAS_STATS:
        q = decay * decay * q + tl.sum(e * e, axis=1)
        x_sum += tl.sum(tl.where(ok, x, 0.0), axis=1)
        left = cols < labels[:, None]
        before = tl.maximum(before, tl.max(tl.where(left, x, float("-inf")), axis=1))
    return m_x, m_new, s, w, q, x_sum, before


@triton.jit(do_not_specialize=["first"])
def _logprobs_fwd_kernel(
    logits_ptr,
    stride_b,
    stride_t,
    stride_v,
    labels_ptr,
    temp_ptr,
    inv_temp,
    logp_ptr,
    ent_ptr,
    lse_ptr,
    stats_ptr,
    N,
    T,
    V_units,
    ignore_index,
    first,
    body,
    HAS_TEMP: tl.constexpr,
    HAS_STATS: tl.constexpr,
    UNIT: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    EDGE_V: tl.constexpr,
):
    V = V_units * UNIT
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < N
    base = _row_offsets(rows, T, stride_b, stride_t, UNIT)  # (BLOCK_N,)
    scale = _inverse_temperature(temp_ptr, rows, row_ok, inv_temp, HAS_TEMP)  # (BLOCK_N,)
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    ignored = labels == ignore_index
    live = row_ok & ~ignored  # an ignored row's logits are never read
    V_live = tl.where(tl.max(live.to(tl.int32), axis=0) > 0, V, 0)  # a tile of ignored rows skips the loop
    # The label's logit is loaded before the loop, so its latency passes while the first tile's does.
    in_range = (labels >= 0) & (labels < V)
    x_label = tl.load(logits_ptr + base + tl.where(in_range, labels, 0) * stride_v, mask=live & in_range, other=0.0).to(
        tl.float32
    )

    # Everything below is in base-2 units: y = x * scale * log2(e), so exp(z - m) = exp2(y - m2).
    scale2 = scale * LOG2E  # (BLOCK_N,)
    m_x = tl.full((BLOCK_N,), float("-inf"), tl.float32)  # the running max of the raw logits
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)  # = m_x * scale2: x * scale2 rounds monotonically
    s = tl.zeros((BLOCK_N,), tl.float32)
    w = tl.zeros((BLOCK_N,), tl.float32)
    q = tl.zeros((BLOCK_N,), tl.float32)
    x_sum = tl.zeros((BLOCK_N,), tl.float32)
    before = tl.full((BLOCK_N,), float("-inf"), tl.float32)  # the largest logit left of the label
    if VEC == 1:  # rows start at multiples of UNIT: one loop, masked at the row's end
        for v0 in range(0, V_live, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V)
            ok = live[:, None] & (cols < V)
            x = tl.load(logits_ptr + base[:, None] + cols.to(tl.int64) * stride_v, mask=ok, other=float("-inf"))
            m_x, m, s, w, q, x_sum, before = _fwd_tile(
                x.to(tl.float32), cols, ok, labels, scale2, m_x, m, s, w, q, x_sum, before, HAS_STATS
            )
    else:  # rows start between 16-byte vectors: an aligned body in whole vectors, then the edges
        head, start = body_start(base, first, VEC)  # (BLOCK_N,) each
        for v0 in range(0, tl.where(V_live > 0, body, 0), BLOCK_V):
            at = v0 + tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V) within the body
            x = tl.load(logits_ptr + start[:, None] + at, mask=live[:, None], other=float("-inf"))
            cols = head[:, None] + at  # (BLOCK_N, BLOCK_V)
            m_x, m, s, w, q, x_sum, before = _fwd_tile(
                x.to(tl.float32), cols, live[:, None], labels, scale2, m_x, m, s, w, q, x_sum, before, HAS_STATS
            )
        for r0 in range(0, tl.where(V_live > 0, V - body, 0), EDGE_V):  # fewer than BLOCK_V + VEC columns
            cols, ok = edge_columns(r0, head, body, V, live, EDGE_V)
            x = tl.load(logits_ptr + base[:, None] + cols, mask=ok, other=float("-inf"))
            m_x, m, s, w, q, x_sum, before = _fwd_tile(
                x.to(tl.float32), cols, ok, labels, scale2, m_x, m, s, w, q, x_sum, before, HAS_STATS
            )

    # s >= 1 in exact arithmetic (the max contributes exp2(0)); rounding in d may leave it a hair
    # under, which would make the max's log-prob positive. NaN passes; an all -inf row has
    # m_x = -inf and so lse = -inf, its log-prob NaN, as the distribution does not exist.
    log2_s = tl.maximum(log2(s), 0.0, propagate_nan=tl.PropagateNan.ALL)
    lse = m_x * scale + log2_s * LN2  # natural units, from the same rounding of z as the label's
    entropy = (log2_s - w / s) * LN2

    logp = tl.where(in_range, x_label * scale - lse, float("nan"))  # out-of-range labels are visible NaN
    tl.store(logp_ptr + rows, tl.where(ignored, 0.0, logp), mask=row_ok)
    tl.store(ent_ptr + rows, tl.where(ignored, 0.0, entropy), mask=row_ok)
    tl.store(lse_ptr + rows, tl.where(ignored, 0.0, lse), mask=row_ok)
    if HAS_STATS:
        # x * scale2 rounds monotonically, so a tie with the max is exact in either unit.
        top1 = in_range & (x_label * scale2 >= m) & (x_label > before)
        tl.store(stats_ptr + rows * 3, tl.where(ignored, 0.0, (log2(q) - 2.0 * log2_s) * LN2), mask=row_ok)
        tl.store(stats_ptr + rows * 3 + 1, tl.where(ignored, 0.0, x_sum * scale / V), mask=row_ok)
        tl.store(stats_ptr + rows * 3 + 2, tl.where(ignored | ~top1, 0.0, 1.0), mask=row_ok)


@triton.jit
def _bwd_tile(x, cols, labels, ignored, scale, lse, g_lp, entropy, g_ent, HAS_G_ENT: tl.constexpr):
    # One tile of logits x (BLOCK_N, BLOCK_V) fp32, unscaled, -inf where not read, at columns
    # cols (broadcastable to x) -> its gradient dz / T, fp32.
    log_p = x * scale[:, None] - lse[:, None]
    p = exp2(log_p * LOG2E)
    dz = tl.where(cols == labels[:, None], g_lp[:, None], 0.0) - g_lp[:, None] * p
    if HAS_G_ENT:
        # log p = -inf where p = 0: the clamp (below exp2's floor) keeps p * log p at 0, not NaN.
        dz -= g_ent[:, None] * (p * (tl.maximum(log_p, -_EXP2_FLOOR * LN2) + entropy[:, None]))
    # Exactly 0 in an ignored row, whatever its logits hold (0 * NaN would be NaN).
    return tl.where(ignored[:, None], 0.0, dz * scale[:, None])


@triton.jit(do_not_specialize=["first"])
def _logprobs_bwd_kernel(
    logits_ptr,
    stride_b,
    stride_t,
    stride_v,
    grad_ptr,
    gstride_b,
    gstride_t,
    gstride_v,
    labels_ptr,
    temp_ptr,
    inv_temp,
    lse_ptr,
    ent_ptr,
    g_lp_ptr,
    g_ent_ptr,
    N,
    T,
    V_units,
    ignore_index,
    first,
    body,
    HAS_TEMP: tl.constexpr,
    HAS_G_ENT: tl.constexpr,
    UNIT: tl.constexpr,
    VEC: tl.constexpr,
    GRAD_VEC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    EDGE_V: tl.constexpr,
):
    V = V_units * UNIT
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < N
    base = _row_offsets(rows, T, stride_b, stride_t, UNIT)
    gbase = _row_offsets(rows, T, gstride_b, gstride_t, UNIT)
    scale = _inverse_temperature(temp_ptr, rows, row_ok, inv_temp, HAS_TEMP)

    labels = tl.load(labels_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    in_range = (labels >= 0) & (labels < V)
    ignored = labels == ignore_index
    live = row_ok & ~ignored  # an ignored row's logits are never read; its zero gradient is written
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(g_lp_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    # An ignored row gets exactly zero gradient; an out-of-range label gets NaN (never a finite lie).
    g_lp = tl.where(ignored, 0.0, tl.where(in_range, g_lp, float("nan")))
    entropy, g_ent = lse, lse  # read only with HAS_G_ENT
    if HAS_G_ENT:
        entropy = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        g_ent = tl.where(ignored, 0.0, g_ent)

    if VEC == 1:  # rows start at multiples of UNIT: one loop, masked at the row's end
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V)
            ok = row_ok[:, None] & (cols < V)
            at = cols.to(tl.int64)
            x = tl.load(logits_ptr + base[:, None] + at * stride_v, mask=ok & live[:, None], other=float("-inf"))
            dz = _bwd_tile(x.to(tl.float32), cols, labels, ignored, scale, lse, g_lp, entropy, g_ent, HAS_G_ENT)
            tl.store(grad_ptr + gbase[:, None] + at * gstride_v, dz.to(grad_ptr.dtype.element_ty), mask=ok)
    else:  # rows start between 16-byte vectors: an aligned body in whole vectors, then the edges
        head, start = body_start(base, first, VEC)  # (BLOCK_N,) each
        # The gradient's rows are vector-aligned alike when its layout matches (``vectors.shared_shift``).
        gstart = tl.multiple_of(gbase + head * gstride_v, GRAD_VEC)
        for v0 in range(0, body, BLOCK_V):
            at = v0 + tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V) within the body
            x = tl.load(logits_ptr + start[:, None] + at, mask=live[:, None], other=float("-inf"))
            cols = head[:, None] + at  # (BLOCK_N, BLOCK_V)
            dz = _bwd_tile(x.to(tl.float32), cols, labels, ignored, scale, lse, g_lp, entropy, g_ent, HAS_G_ENT)
            tl.store(
                grad_ptr + gstart[:, None] + at * gstride_v, dz.to(grad_ptr.dtype.element_ty), mask=row_ok[:, None]
            )
        for r0 in range(0, V - body, EDGE_V):  # fewer than BLOCK_V + VEC columns
            cols, ok = edge_columns(r0, head, body, V, row_ok, EDGE_V)
            x = tl.load(logits_ptr + base[:, None] + cols, mask=ok & live[:, None], other=float("-inf"))
            dz = _bwd_tile(x.to(tl.float32), cols, labels, ignored, scale, lse, g_lp, entropy, g_ent, HAS_G_ENT)
            tl.store(grad_ptr + gbase[:, None] + cols * gstride_v, dz.to(grad_ptr.dtype.element_ty), mask=ok)


# Elements a program touches per loop iteration, and the widest vocabulary block. A block of the
# vocabulary is reduced across the program's threads three times per iteration (max, sum e,
# sum e * d): with 4 warps a thread holds 32 elements of a 4096 block, which amortises the
# cross-warp barriers to under 12 SASS instructions per bf16 element in the forward (see
# ``fastppo bench --sass``); 8 warps took 13.6. Vocabularies of 1024 or fewer run one warp per
# program, several rows each, so their reductions are warp shuffles with no barrier at all.
_TILE, _WARPS = 4096, 4
_SMALL_TILE = 1024
_MAX_BLOCK_N = 64


def _tiling(V, block_v):
    """(BLOCK_N, BLOCK_V, num_warps) for a vocabulary of V; ``block_v`` overrides for tests."""
    BLOCK_V = block_v or min(triton.next_power_of_2(V), _TILE)
    small = BLOCK_V <= _SMALL_TILE
    BLOCK_N = max(1, min(_MAX_BLOCK_N, (_SMALL_TILE if small else _TILE) // BLOCK_V))
    return BLOCK_N, BLOCK_V, 1 if small else _WARPS


def _launch(logits, temperature, inv_temperature, block_v, grad=None):
    """What both launchers pass besides tensors: grid, row strides and sizes, runtime scalars and
    compile-time switches. None when there are no rows. A per-row temperature tensor wins over the
    scalar, which otherwise rides along as a runtime argument.
    """
    B, T, V = logits.shape
    if B * T == 0:
        return None
    BLOCK_N, BLOCK_V, num_warps = _tiling(V, block_v)
    row_strides = (*logits.stride()[:2], *(grad.stride()[:2] if grad is not None else ()))
    unit = row_unit(V, *row_strides)
    if grad is None:
        vec, first = row_shift(logits, unit)
    else:
        vec, grad_vec, first = shared_shift(logits, grad, unit)
    body = body_columns(V, vec, BLOCK_V) if vec > 1 else 0
    has_temp = temperature is not None
    temperature_args = (temperature, 1.0) if has_temp else (None, inv_temperature)
    switches = dict(HAS_TEMP=has_temp, UNIT=unit, VEC=vec, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, num_warps=num_warps)
    switches["EDGE_V"] = min(BLOCK_V, EDGE_TILE)
    if grad is not None:
        switches["GRAD_VEC"] = grad_vec
    strides = tuple(stride // unit for stride in row_strides)
    sizes = (B * T, T, V // unit)
    return (triton.cdiv(B * T, BLOCK_N),), strides, temperature_args, sizes, (first, body), switches


def logprobs_forward(
    logits, labels, temperature, inv_temperature, ignore_index, logp, entropy, lse, stats=None, *, block_v=None
):
    """The launcher ``kernels/contract.py`` declares; ``block_v`` overrides the vocabulary tile."""
    launch = _launch(logits, temperature, inv_temperature, block_v)
    if launch is None:
        return
    if entropy is None:  # not wanted: the kernel computes it in its one pass anyway, into scratch
        entropy = lse.new_empty(lse.shape)
    grid, (stride_b, stride_t), temperature_args, sizes, shift, switches = launch
    _logprobs_fwd_kernel[grid](
        logits,
        stride_b,
        stride_t,
        logits.stride(2),
        labels,
        *temperature_args,
        logp,
        entropy,
        lse,
        stats,
        *sizes,
        ignore_index,
        *shift,
        HAS_STATS=stats is not None,
        **switches,
    )


def logprobs_backward(
    logits,
    grad,
    labels,
    temperature,
    inv_temperature,
    ignore_index,
    lse,
    entropy,
    grad_logp,
    grad_entropy,
    *,
    block_v=None,
):
    """The launcher ``kernels/contract.py`` declares; ``block_v`` overrides the vocabulary tile."""
    launch = _launch(logits, temperature, inv_temperature, block_v, grad)
    if launch is None:
        return
    grid, (stride_b, stride_t, gstride_b, gstride_t), temperature_args, sizes, shift, switches = launch
    _logprobs_bwd_kernel[grid](
        logits,
        stride_b,
        stride_t,
        logits.stride(2),
        grad,
        gstride_b,
        gstride_t,
        grad.stride(2),
        labels,
        *temperature_args,
        lse,
        entropy,
        grad_logp,
        grad_entropy,
        *sizes,
        ignore_index,
        *shift,
        HAS_G_ENT=grad_entropy is not None,
        **switches,
    )
