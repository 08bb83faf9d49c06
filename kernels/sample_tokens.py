"""Triton kernels that draw the next token of every row and its log-prob in one pass over the logits.

A rollout step has to turn logits ``(B, V)`` into a token per row and the token's log-prob under
``softmax(logits / T)``. Done with separate PyTorch ops that is an fp32 copy, a scaled copy, a
tensor of uniforms, two logs, an argmax and a log-softmax: about eight full passes over ``B x V``
fp32 values. Here each row is read once, in blocks of the vocabulary, and the draw is Gumbel-max:
``argmax(z + g)`` with ``g = -log(-log(u))`` is an exact draw from ``softmax(z)``, with no
normalisation and no second pass. In base-2 units (log2(e) folded into the scale, constants
dropped from the argmax) the score is ``x * scale * log2(e) - log2(-log2(u))``: two
flush-to-zero ``lg2`` instructions per element (``fastmath.py``), the inner one replaced by its
series within 2**-6 of u = 1, where ``lg2``'s error would exceed the log itself (``_gumbel2``).
Greedy mode scores the logit itself (log-prob then at the given scale).

What the loop carries is per *lane*, not per row, so a block costs one cross-thread reduction
(its max, for the log-sum-exp's reference point), not five:

    m_x            the running max of the row's raw logits (per row),
    s              sum exp2(y - m_x * scale2) over the lane's columns, rescaled as m_x grows,
    best, best_col the lane's best score so far and its column (ties keep the lower column).

At the end the lanes are reduced once: the row's best score, the lowest column holding it, and
``sum s``. The token's log-prob is ``z_token - lse`` with ``z_token`` read again from the logits.

Few rows leave most of the GPU idle (256 rows is 2 programs per multiprocessor on an H200), so
the vocabulary is split across ``SPLITS`` programs per row: each writes its partial
``(m_x, s, best, best_col)`` and ``_combine_kernel`` merges them per row. With one split the
main kernel finishes the row itself.

Greedy rows that start between 16-byte vectors (an odd vocabulary: GPT-2's 50,257) are read as
an aligned body in whole vectors and two masked edges (``vectors.py``); the last split merges the
edges into its row's result, where a tie with the head's columns, met last, compares columns.

The uniforms come from Triton's counter-based Philox-4x32 generator keyed by ``seed``. One Philox
evaluation yields four numbers, so all four are used: column ``c`` of row ``r`` takes output
``c % 4`` of counter ``r * ceil(V / 4) + c // 4`` (int64). A draw thus depends on the seed and
the logits only, never on the tiling or the split. Ties go to the lowest column, as
``torch.argmax`` does. Rows are on grid axis 0, all offsets are int64, and the seed is a runtime
value that is never specialised, so a new seed per step does not recompile.
"""

import triton
import triton.language as tl

from .contract import row_unit
from .fastmath import LN2, LOG2E, exp2, log2
from .vectors import EDGE_TILE, body_columns, body_start, edge_columns, row_shift

# Uniforms are clamped to [2**-32, 1): a zero would give the column noise -inf and rule it out.
_SMALLEST_UNIFORM = tl.constexpr(2.0**-32)
_NEAR_ONE = tl.constexpr(2.0**-6)  # below this distance from 1, -log2(u) comes from its series
_NO_COLUMN = tl.constexpr(2**31 - 1)  # above every column: the neutral value of a min over columns


@triton.jit
def _gumbel2(u):
    # u: uniforms in [0, 1) -> their Gumbel noise in base-2 units, -log2(-log2(u)). Near u = 1,
    # lg2.approx's absolute error (up to 2**-22 on [0.5, 2]) exceeds -log2(u) itself
    # (-log2(1 - 2**-24) = 8.6e-8 = 0.36 x 2**-22): it may round to 0 or below, and the noise to
    # +inf or NaN, where exact noise is at most 23.5. So within _NEAR_ONE of 1 the inner log is
    # the series of -ln(1 - d) with d = 1 - u (exact in fp32 for u >= 0.5), whose first omitted
    # term is d**5 / 5: a relative error below 2**-26. The noise is then finite for every fp32
    # uniform, and its distribution is the exact one's at fp32's resolution of u.
    u = tl.maximum(u, _SMALLEST_UNIFORM)
    d = 1.0 - u
    series = d * (1.0 + d * (0.5 + d * (0.3333333333 + d * 0.25))) * LOG2E
    return -log2(tl.where(d < _NEAR_ONE, series, -log2(u)))


@triton.jit
def _first_best(score, cols):
    # score, cols: (BLOCK_N, K) -> (BLOCK_N,) the best score and the lowest column holding it:
    # ties go to the lowest column, as torch.argmax's do. Scores are never NaN (a NaN never
    # beats the running best), so some column always holds the max.
    top = tl.max(score, axis=1)
    return top, tl.min(tl.where(score == top[:, None], cols, _NO_COLUMN), axis=1)


@triton.jit
def _finish(logits_ptr, rows, row_ok, stride_b, stride_v, m_x, s, col, inv_temp, tokens_ptr, logp_ptr):
    # m_x, s, col: (BLOCK_N,) a row's max raw logit, sum exp2(y - m_x * scale2), chosen column.
    # s >= 1 in exact arithmetic (the max contributes exp2(0)); the clamp keeps the max's
    # log-prob <= 0 against rounding. An all -inf row has lse = -inf and a NaN log-prob.
    log2_s = tl.maximum(log2(s), 0.0, propagate_nan=tl.PropagateNan.ALL)
    lse = m_x * inv_temp + log2_s * LN2
    col = col.to(tl.int64)
    z = tl.load(logits_ptr + rows * stride_b + col * stride_v, mask=row_ok, other=0.0).to(tl.float32) * inv_temp
    tl.store(tokens_ptr + rows, col, mask=row_ok)
    tl.store(logp_ptr + rows, z - lse, mask=row_ok)


@triton.jit
def _uniforms(seed, v0, per_row, rows, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    # The uniforms of columns v0 + 0 .. BLOCK_V - 1 (v0 a multiple of 4) of each row ->
    # (BLOCK_N, BLOCK_V): column c takes output c % 4 of counter rows * per_row + c // 4.
    counters = rows[:, None] * per_row + v0 // 4 + tl.arange(0, BLOCK_V // 4)[None, :]
    u0, u1, u2, u3 = tl.rand4x(seed, counters)  # (BLOCK_N, BLOCK_V // 4) each
    # Interleave so that column 4k + j takes output j of counter k.
    return tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), (BLOCK_N, BLOCK_V))


@triton.jit
def _rescale(m_x, x, scale2):
    # A row's running max m_x (BLOCK_N,) meets a tile x (BLOCK_N, K) -> the new max, the reference
    # point of the sums in base-2 units (finite while a row has seen only -inf), and the factor
    # that carries the sums so far over to it (anything: they are 0 until then).
    m_new = tl.maximum(m_x, tl.max(x, axis=1))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new * scale2)
    decay = exp2(tl.where(m_x == float("-inf"), 0.0, m_x * scale2 - ref))
    return m_new, ref, decay


@triton.jit
def _draw_tile(x, u, cols, ok, scale2, m_x, s, best, best_col, GREEDY: tl.constexpr):
    # One tile of logits x (BLOCK_N, BLOCK_V) fp32, unscaled, -inf where not ok, at columns cols,
    # with their uniforms u -> the lanes' running statistics, updated. Each lane meets its columns
    # in increasing order.
    m_new, ref, decay = _rescale(m_x, x, scale2)
    s = s * decay[:, None] + exp2(x * scale2 - ref[:, None])
    if GREEDY:
        score = x
    else:
        score = x * scale2 + _gumbel2(u)
    better = ok & (score > best)  # strictly: a later column with an equal score loses the tie
    best = tl.where(better, score, best)
    best_col = tl.where(better, cols, best_col)
    return m_new, s, best, best_col


@triton.jit
def _greedy_edge(x, cols, ok, scale2, m_x, s_row, top, col):
    # A tile of a row's edge columns x (BLOCK_N, EDGE_V), -inf where not ok, merged into the row's
    # max, sum and best logit with its column (BLOCK_N,) each. The head's columns come after the
    # body's here, so a tie goes to the lower column.
    m_new, ref, decay = _rescale(m_x, x, scale2)
    s_row = s_row * decay + tl.sum(exp2(x * scale2 - ref[:, None]), axis=1)
    edge_top, edge_col = _first_best(x, tl.where(ok, cols, _NO_COLUMN))
    take = (edge_top > top) | ((edge_top == top) & (edge_col < col))
    return m_new, s_row, tl.where(take, edge_top, top), tl.where(take, edge_col, col)


@triton.jit(do_not_specialize=["seed", "first"])
def _sample_kernel(
    logits_ptr,
    stride_b,
    stride_v,
    tokens_ptr,
    logp_ptr,
    part_ptr,
    part_col_ptr,
    inv_temp,
    seed,
    B,
    V_units,
    split_cols,
    first,
    body,
    GREEDY: tl.constexpr,
    SPLITS: tl.constexpr,
    UNIT: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    EDGE_V: tl.constexpr,
):
    # stride_b and V come in units of UNIT elements (``layout.row_unit``): rows start at multiples of it.
    V = V_units * UNIT
    per_row = tl.cdiv(V, 4)  # Philox counters per row
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_start = rows * stride_b * UNIT  # (BLOCK_N,) offset of each row's first logit
    row_ok = rows < B
    split = tl.program_id(1)
    v_begin = split * split_cols  # a multiple of BLOCK_V
    scale2 = inv_temp * LOG2E

    m_x = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    best = tl.full((BLOCK_N, BLOCK_V), float("-inf"), tl.float32)
    best_col = tl.zeros((BLOCK_N, BLOCK_V), tl.int32)
    # Pipelined: the compiler copies the next two tiles into shared memory (cp.async) while this
    # one is reduced, so a trip no longer waits the DRAM latency (``fastppo bench --sass``: the
    # greedy kernel's latency bound fell from 33 to 19 us at [256, 151936]).
    if VEC == 1:  # rows start at multiples of UNIT: one loop, masked at the split's end
        v_end = tl.minimum(V, v_begin + split_cols)
        for v0 in tl.range(v_begin, v_end, BLOCK_V, num_stages=3):
            cols = v0 + tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V)
            ok = row_ok[:, None] & (cols < v_end)
            x = tl.load(
                logits_ptr + row_start[:, None] + cols.to(tl.int64) * stride_v, mask=ok, other=float("-inf")
            ).to(tl.float32)  # (BLOCK_N, BLOCK_V), unscaled
            u = x
            if not GREEDY:
                u = _uniforms(seed, v0, per_row, rows, BLOCK_N, BLOCK_V)
            m_x, s, best, best_col = _draw_tile(x, u, cols, ok, scale2, m_x, s, best, best_col, GREEDY)
    else:  # greedy, rows start between 16-byte vectors: each split's share of the aligned body
        head, start = body_start(row_start, first, VEC)  # (BLOCK_N,) each
        v_end = tl.minimum(body, v_begin + split_cols)
        for v0 in tl.range(v_begin, v_end, BLOCK_V, num_stages=3):
            at = v0 + tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V) within the body
            x = tl.load(logits_ptr + start[:, None] + at, mask=row_ok[:, None], other=float("-inf")).to(tl.float32)
            cols = (head[:, None] + at).to(tl.int32)  # (BLOCK_N, BLOCK_V): V < 2**31
            m_x, s, best, best_col = _draw_tile(x, x, cols, row_ok[:, None], scale2, m_x, s, best, best_col, True)

    top, col = _first_best(best, best_col)  # (BLOCK_N,) each
    s_row = tl.sum(s, axis=1)
    if VEC > 1:
        if split == SPLITS - 1:  # the edges, by the last split, row by row in narrower tiles
            for r0 in range(0, V - body, EDGE_V):  # fewer than BLOCK_V + VEC columns
                edge_cols, ok = edge_columns(r0, head, body, V, row_ok, EDGE_V)
                x = tl.load(logits_ptr + row_start[:, None] + edge_cols, mask=ok, other=float("-inf"))
                m_x, s_row, top, col = _greedy_edge(
                    x.to(tl.float32), edge_cols.to(tl.int32), ok, scale2, m_x, s_row, top, col
                )
    if SPLITS == 1:
        _finish(logits_ptr, rows, row_ok, stride_b * UNIT, stride_v, m_x, s_row, col, inv_temp, tokens_ptr, logp_ptr)
    else:
        part = (rows * SPLITS + split) * 3  # (B, SPLITS, 3) fp32: m_x, s, best; (B, SPLITS) int64 columns
        tl.store(part_ptr + part, m_x, mask=row_ok)
        tl.store(part_ptr + part + 1, s_row, mask=row_ok)
        tl.store(part_ptr + part + 2, top, mask=row_ok)
        tl.store(part_col_ptr + rows * SPLITS + split, col, mask=row_ok)


@triton.jit
def _combine_kernel(
    logits_ptr,
    stride_b,
    stride_v,
    tokens_ptr,
    logp_ptr,
    part_ptr,
    part_col_ptr,
    inv_temp,
    B,
    SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < B
    k = tl.arange(0, SPLITS)  # (SPLITS,)
    at = rows[:, None] * SPLITS + k[None, :]  # (BLOCK_N, SPLITS)
    m_x = tl.load(part_ptr + at * 3, mask=row_ok[:, None], other=float("-inf"))
    s = tl.load(part_ptr + at * 3 + 1, mask=row_ok[:, None], other=0.0)
    best = tl.load(part_ptr + at * 3 + 2, mask=row_ok[:, None], other=float("-inf"))
    cols = tl.load(part_col_ptr + at, mask=row_ok[:, None], other=0)

    row_max = tl.max(m_x, axis=1)  # (BLOCK_N,)
    ref = tl.where(row_max == float("-inf"), 0.0, row_max)
    scale2 = inv_temp * LOG2E
    # A split that saw only -inf holds s = 0: its weight exp2(-inf) must not meet a 0 * inf.
    weight = exp2(tl.where(m_x == float("-inf"), float("-inf"), (m_x - ref[:, None]) * scale2))
    s_row = tl.sum(s * weight, axis=1)
    _, col = _first_best(best, cols)  # a tie across splits goes to the lower column
    _finish(logits_ptr, rows, row_ok, stride_b, stride_v, row_max, s_row, col, inv_temp, tokens_ptr, logp_ptr)


# Tiling: 4 warps per 2048-column block (16 columns per thread, each carrying three values), a few
# rows per program when the vocabulary is small. Against 8 warps x 4096 columns this halves the
# registers (about 110 per thread), so twice the programs are resident to cover memory latency
# (``fastppo bench --sass``).
_TILE, _WARPS = 2048, 4
_MAX_BLOCK_N = 64
# Programs to aim for when splitting the vocabulary: about 8 per multiprocessor of a 132-SM GPU.
_TARGET_PROGRAMS = 1024


def _sample_tiling(V, block_v):
    """(BLOCK_N, BLOCK_V, num_warps); blocks of 4 columns or more (Philox yields 4 at a time)."""
    BLOCK_V = block_v or min(triton.next_power_of_2(max(V, 4)), _TILE)
    BLOCK_N = max(1, min(_MAX_BLOCK_N, _TILE // BLOCK_V))
    return BLOCK_N, BLOCK_V, _WARPS


def _floor_power_of_2(n):
    return 1 << (max(1, n).bit_length() - 1)


def _splits(B, V, BLOCK_N, BLOCK_V):
    """Programs per row along the vocabulary: a power of two, each with at least 4 blocks."""
    wanted = triton.next_power_of_2(max(1, _TARGET_PROGRAMS // triton.cdiv(B, BLOCK_N)))
    return min(wanted, _floor_power_of_2(V // (4 * BLOCK_V)))


def sample_forward(logits, inv_temperature, greedy, seed, tokens, logprobs, *, block_v=None, splits=None):
    """The launcher ``kernels/contract.py`` declares. ``block_v`` (a multiple of 4) and ``splits`` (a
    power of two) override the tiling for tests; neither changes the draw."""
    B, V = logits.shape
    if B == 0:
        return
    BLOCK_N, BLOCK_V, num_warps = _sample_tiling(V, block_v)
    SPLITS = splits or _splits(B, V, BLOCK_N, BLOCK_V)
    unit = row_unit(V, logits.stride(0))
    # Greedy rows that start between vectors are read by their aligned bodies. Drawn rows are not:
    # a body's groups of 4 columns would straddle two Philox counters, and two evaluations per
    # group cost more instructions (71 per element against 52, ``fastppo bench --sass`` at
    # [256, 50257]) than the 2-byte loads they replace.
    vec, first = row_shift(logits, unit) if greedy else (1, 0)
    # The columns the splits share: all of V, or every row's aligned body (its edges go to the last split).
    body = body_columns(V, vec, BLOCK_V) if vec > 1 else V
    split_cols = triton.cdiv(triton.cdiv(body, SPLITS), BLOCK_V) * BLOCK_V
    part = logprobs.new_empty((B, SPLITS, 3) if SPLITS > 1 else (0,))  # fp32 m_x, s, best
    part_col = tokens.new_empty((B, SPLITS) if SPLITS > 1 else (0,))  # int64 columns
    outputs = (tokens, logprobs, part, part_col)
    _sample_kernel[(triton.cdiv(B, BLOCK_N), SPLITS)](
        logits,
        logits.stride(0) // unit,
        logits.stride(1),
        *outputs,
        inv_temperature,
        seed,
        B,
        V // unit,
        split_cols,
        first,
        body,
        GREEDY=greedy,
        SPLITS=SPLITS,
        UNIT=unit,
        VEC=vec,
        BLOCK_N=BLOCK_N,
        BLOCK_V=BLOCK_V,
        EDGE_V=min(BLOCK_V, EDGE_TILE),
        num_warps=num_warps,
    )
    if SPLITS > 1:
        _combine_kernel[(triton.cdiv(B, 32),)](
            logits, *logits.stride(), *outputs, inv_temperature, B, SPLITS=SPLITS, BLOCK_N=32, num_warps=1
        )
