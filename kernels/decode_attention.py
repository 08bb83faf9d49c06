"""Triton decode attention over the sampler's KV cache: one query token per row, each row's own
keys, read through the block table where they lie.

A decode step's attention is a read of every row's live keys and values, so its cost is bytes.
Without a kernel of its own, each layer gathers every row's blocks into a new tensor and attends
with a mask over the longest row's span: each byte read, written and read again, plus padding. Here
a program reads exactly its row's live positions, ``[max(start, length - window), length)``, from
the pool's blocks (``table[row, p // page]``, offset ``p % page``) and nothing else: not the
positions past the row's length in its last block, not a block it does not hold (which may hold
anything, NaN included). Several queries may read one cache row (``rows``), each to its own length:
a multi-turn continuation's tokens, each attending over the row's keys up to itself.

How the work is laid out:

* **GQA**: a program serves one KV head of one row and all ``G`` query heads that share it, as the
  rows of one tile (padded to ``BLOCK_R`` >= 16, ``tl.dot``'s least), so a KV head is read once for
  its group, not once per query head.
* **Split-K** (flash-decoding): a row's positions are cut into ranges of ``split_len`` (whole tiles),
  one program each, so a few long rows still fill the GPU. Each writes its partial softmax state
  ``(m, den, acc)`` in base-2 units, and ``_combine_kernel`` merges a row's partials by their maxima.
  With one split and no cascade the program finishes the row itself (``DIRECT``): one launch.
* **Cascade**: the samples of a group share their prompt's full blocks (the paged cache builds them
  so). ``_prefix_kernel`` attends a shared prefix once for up to ``MEMBERS`` rows, their query rows
  stacked in one tile (``MEMBERS x G``), and writes each member's partial state for it; the plain
  kernel attends each row from its ``start`` (the end of its shared prefix) only, and the combine
  merges both exactly. A group's prompt is then read once per step, not once per sample. A row
  whose ``start`` is 0 takes nothing from the prefix partials.
* **Attention sinks** (GPT-OSS): one logit per query head that joins every row's softmax with no
  value, added once, where a row is finished.
* **Logit soft-capping** (Gemma 2): each score ``s`` becomes ``softcap * tanh(s / softcap)`` before
  the softmax; the kernel then takes ``scale / softcap`` and ``softcap * log2(e)`` as its two
  factors (``HAS_SOFTCAP``), one tanh per score.

The online softmax works in base 2 (``scale * log2(e)`` folded in once). A query row whose keys in a
tile are all masked (a cascade member whose window starts past the tile) keeps its state: its
reference point stays finite, so no ``-inf - -inf`` is taken. Every offset is int64, so pools past
2**31 elements are addressed right. fp32 caches multiply in full fp32 (``IEEE``), not TF32.
"""

import torch
import triton
import triton.language as tl

from .fastmath import _INTERPRETED, LOG2E, exp2, tanh

SMS_WITHOUT_GPU = 132  # the splits the interpreter and the sm_90 study size for: an H200's multiprocessors
PROGRAMS_PER_SM = 4  # split a row until the grid holds this many programs per multiprocessor
TILES_PER_SPLIT = 4  # but no split shorter than this many tiles of keys


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # a (R, K) @ b (K, N) -> fp32, the operands in the dtype the product takes.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    elif _INTERPRETED:  # the interpreter's bf16 dot is wrong (triton 3.9): the same exact products in fp32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile(q, k, v, ok, lost, scale2, cap2, m, den, acc, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    # q (R, BLOCK_D); k, v (BLOCK_N, BLOCK_D) in q's dtype, 0 where not loaded; ok (R or 1, BLOCK_N):
    # the keys each query row may see; lost (BLOCK_N,): keys that could not be read, NaN to a row that
    # sees one; m, den (R,) and acc (R, BLOCK_D) fp32: the running max (base 2), the sum of exp2 and
    # the weighted values -> the three, updated. The scores in base 2: ``q.k * scale2``, or soft-capped
    # ``cap2 * tanh(q.k * scale2)``.
    s = _dot(q, tl.trans(k), IEEE) * scale2
    if HAS_SOFTCAP:
        s = cap2 * tanh(s)
    s = tl.where(lost[None, :], float("nan"), s)
    s = tl.where(ok, s, float("-inf"))  # (R, BLOCK_N)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite while a row has seen no key
    decay = exp2(m - ref)  # 0 while m is -inf
    p = exp2(s - ref[:, None])  # (R, BLOCK_N), 0 where masked
    den = den * decay + tl.sum(p, axis=1)
    return m_new, den, acc * decay[:, None] + _dot(p.to(v.dtype), v, IEEE)


@triton.jit
def _merge(m, den, acc, m_s, den_s, acc_s):
    # Two partial states of the same query rows (R,), (R,), (R, BLOCK_D) -> their union.
    top = tl.maximum(m, m_s)
    ref = tl.where(top == float("-inf"), 0.0, top)
    a, b = exp2(m - ref), exp2(m_s - ref)
    return top, den * a + den_s * b, acc * a[:, None] + acc_s * b[:, None]


@triton.jit
def _finish(m, den, acc, heads, sinks_ptr, HAS_SINKS: tl.constexpr):
    # A row's whole state for its query heads (R,) -> the attention output (R, BLOCK_D) fp32. A sink
    # adds exp(sink) to the denominator and nothing to the numerator.
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads).to(tl.float32) * LOG2E  # (R,) base 2
        m, den, acc = _merge(m, den, acc, sink, tl.full(sink.shape, 1.0, tl.float32), acc * 0.0)
    return acc / den[:, None]


@triton.jit
def _where_in_pool(table_ptr, stride_t, row, pos, ok, page, num_blocks, PAGED: tl.constexpr):
    # Positions pos (BLOCK_N,) of ``row`` -> (block, position in it), int64 each, and whether the
    # pool has that block: through the block table (one load for keys and values alike; an entry out
    # of [0, num_blocks) is never read), or a static cache's own slot.
    if PAGED:
        block = tl.load(table_ptr + row * stride_t + pos // page, mask=ok, other=0).to(tl.int64)
        return block, (pos % page).to(tl.int64), (block >= 0) & (block < num_blocks)
    else:
        return row + tl.zeros_like(pos).to(tl.int64), pos.to(tl.int64), ok


@triton.jit
def _keys(
    k_ptr, v_ptr, table_ptr, stride_t, row, pos, ok, page, num_blocks, k_strides, v_strides, kv_head, d, d_ok,
    PAGED: tl.constexpr,
):  # fmt: skip
    # The keys and values of positions pos (BLOCK_N,) of ``row`` at one KV head -> (BLOCK_N, BLOCK_D)
    # each, 0 where not ok; nothing else is read; and the positions whose table entry names no block
    # of the pool (BLOCK_N,), read as 0 (a row that sees one gives NaN, as the twin does).
    kb, kp, kh = k_strides
    vb, vp, vh = v_strides
    block, offset, named = _where_in_pool(table_ptr, stride_t, row, pos, ok, page, num_blocks, PAGED)
    at = (ok & named)[:, None] & d_ok[None, :]
    k_at, v_at = block * kb + offset * kp, block * vb + offset * vp  # (BLOCK_N,) each
    k = tl.load(k_ptr + k_at[:, None] + kv_head.to(tl.int64) * kh + d[None, :], mask=at, other=0.0)
    v = tl.load(v_ptr + v_at[:, None] + kv_head.to(tl.int64) * vh + d[None, :], mask=at, other=0.0)
    return k, v, ok & ~named


@triton.jit
def _queries(q_ptr, rows, heads, stride_qb, stride_qh, d, r_ok, d_ok):
    # The query of each tile row: head ``heads`` (R,) of row ``rows`` (R,) or one row -> (R, BLOCK_D).
    at = rows * stride_qb + heads[:, None].to(tl.int64) * stride_qh + d[None, :]
    return tl.load(q_ptr + at, mask=r_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _attend_range(
    q, k_ptr, v_ptr, table_ptr, stride_t, table_row, begin, end, lo, length, page, num_blocks, k_strides,
    v_strides, kv_head, d, d_ok, scale2, cap2,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
    PER_ROW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # The keys [begin, end) of ``table_row``'s blocks at one KV head, a tile of BLOCK_N a trip, for the
    # query rows q (BLOCK_R, BLOCK_D) -> their state (m, den, acc). PER_ROW: each query row sees only
    # [lo, length) of it ((BLOCK_R,) each); else every row sees it all.
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    den = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for p0 in range(begin, end, BLOCK_N):
        pos = p0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        ok = pos < end
        k, v, lost = _keys(
            k_ptr,
            v_ptr,
            table_ptr,
            stride_t,
            table_row,
            pos,
            ok,
            page,
            num_blocks,
            k_strides,
            v_strides,
            kv_head,
            d,
            d_ok,
            PAGED,
        )
        sees = ok[None, :]  # (1, BLOCK_N)
        if PER_ROW:
            sees = sees & (pos[None, :] >= lo[:, None]) & (pos[None, :] < length[:, None])  # (BLOCK_R, BLOCK_N)
        m, den, acc = _attend_tile(
            q, k.to(q.dtype), v.to(q.dtype), sees, lost, scale2, cap2, m, den, acc, HAS_SOFTCAP, IEEE
        )
    return m, den, acc


@triton.jit
def _partial_at(rows, heads, H, slot, total_splits):
    # The index of (row, query head, split slot) in the partials (rows, H, total_splits), int64.
    return (rows * H + heads.to(tl.int64)) * total_splits + slot


@triton.jit
def _store_partial(
    part_m_ptr,
    part_den_ptr,
    part_o_ptr,
    rows,
    heads,
    H,
    slot,
    total_splits,
    m,
    den,
    acc,
    r_ok,
    d,
    d_ok,
    D: tl.constexpr,
):
    # One split's state of each tile row (head ``heads`` of row ``rows``) into the partials: m and den
    # (rows, H, total_splits), acc (rows, H, total_splits, D), contiguous fp32.
    at = _partial_at(rows, heads, H, slot, total_splits)  # (BLOCK_R,)
    tl.store(part_m_ptr + at, m, mask=r_ok)
    tl.store(part_den_ptr + at, den, mask=r_ok)
    tl.store(part_o_ptr + at[:, None] * D + d[None, :], acc, mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    rows_ptr,
    lengths_ptr,
    starts_ptr,
    sinks_ptr,
    out_ptr,
    part_m_ptr,
    part_den_ptr,
    part_o_ptr,
    scale2,
    cap2,
    window,
    page,
    num_blocks,
    split_len,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kp,
    stride_kh,
    stride_vb,
    stride_vp,
    stride_vh,
    stride_t,
    stride_ob,
    stride_oh,
    first_slot,
    total_splits,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DIRECT: tl.constexpr,
    IEEE: tl.constexpr,
):
    # grid (queries, KV heads, splits): one query's keys in [lo + split * split_len, ...) at one KV head,
    # read from its cache row (``rows[row]``, or its own index).
    row = tl.program_id(0).to(tl.int64)
    slot = row
    if HAS_ROWS:
        slot = tl.load(rows_ptr + row).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    H = tl.num_programs(1) * G
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * G + r  # (BLOCK_R,) the query heads of this KV head; rows past G are padding
    r_ok = r < G
    d_ok = d < D

    length = tl.load(lengths_ptr + row).to(tl.int32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(length - window, 0)
    if HAS_STARTS:
        lo = tl.maximum(lo, tl.load(starts_ptr + row).to(tl.int32))
    begin = lo + split * split_len
    end = tl.minimum(begin + split_len, length)

    q = _queries(q_ptr, row, heads, stride_qb, stride_qh, d, r_ok, d_ok)  # (BLOCK_R, BLOCK_D)
    m, den, acc = _attend_range(
        q, k_ptr, v_ptr, table_ptr, stride_t, slot, begin, end, lo, length, page, num_blocks,
        (stride_kb, stride_kp, stride_kh), (stride_vb, stride_vp, stride_vh), kv_head, d, d_ok, scale2, cap2,
        BLOCK_R, BLOCK_D, BLOCK_N, PAGED, False, HAS_SOFTCAP, IEEE,
    )  # fmt: skip
    if DIRECT:
        o = _finish(m, den, acc, heads, sinks_ptr, HAS_SINKS)
        tl.store(
            out_ptr + row * stride_ob + heads[:, None].to(tl.int64) * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=r_ok[:, None] & d_ok[None, :],
        )
    else:
        slot = first_slot + split
        _store_partial(
            part_m_ptr, part_den_ptr, part_o_ptr, row, heads, H, slot, total_splits, m, den, acc, r_ok, d, d_ok, D
        )


@triton.jit
def _prefix_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lengths_ptr,
    members_ptr,
    shared_ptr,
    part_m_ptr,
    part_den_ptr,
    part_o_ptr,
    scale2,
    cap2,
    window,
    page,
    num_blocks,
    split_len,
    rows,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kp,
    stride_kh,
    stride_vb,
    stride_vp,
    stride_vh,
    stride_t,
    stride_m,
    total_splits,
    G: tl.constexpr,
    D: tl.constexpr,
    MEMBERS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
):
    # grid (cascade entries, KV heads, prefix splits): an entry's shared positions [0, shared) read
    # once for all its members, whose query rows are the tile's: row t is head t % G of member t // G.
    entry = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    H = tl.num_programs(1) * G
    shared = tl.load(shared_ptr + entry)  # 0 in an unused entry, whose members are all NO_MEMBER
    begin = split * split_len
    end = tl.minimum(begin + split_len, shared)
    t = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    member = tl.load(members_ptr + entry * stride_m + t // G, mask=t < MEMBERS * G, other=-1).to(tl.int64)
    r_ok = (member >= 0) & (member < rows)
    member = tl.where(r_ok, member, 0)
    heads = kv_head * G + t % G  # (BLOCK_R,)
    length = tl.load(lengths_ptr + member, mask=r_ok, other=0).to(tl.int32)  # (BLOCK_R,)
    lo = tl.zeros((BLOCK_R,), tl.int32)
    if HAS_WINDOW:
        lo = tl.maximum(length - window, 0)
    q = _queries(q_ptr, member[:, None], heads, stride_qb, stride_qh, d, r_ok, d_ok)  # (BLOCK_R, BLOCK_D)
    # Any member's table row holds the shared blocks: the least one of the batch's, if it has any.
    first = tl.min(tl.where(r_ok, member, rows))
    end = tl.where(first < rows, end, begin)
    m, den, acc = _attend_range(
        q, k_ptr, v_ptr, table_ptr, stride_t, first, begin, end, lo, length, page, num_blocks,
        (stride_kb, stride_kp, stride_kh), (stride_vb, stride_vp, stride_vh), kv_head, d, d_ok, scale2, cap2,
        BLOCK_R, BLOCK_D, BLOCK_N, True, True, HAS_SOFTCAP, IEEE,
    )  # fmt: skip
    # Every split stores, an empty one its empty state (m -inf, den 0), so the combine reads no stale slot.
    _store_partial(
        part_m_ptr, part_den_ptr, part_o_ptr, member, heads, H, split, total_splits, m, den, acc, r_ok, d, d_ok, D
    )


@triton.jit
def _combine_kernel(
    part_m_ptr,
    part_den_ptr,
    part_o_ptr,
    starts_ptr,
    sinks_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    prefix_splits,
    total_splits,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # grid (rows, KV heads): a row's partials for the G query heads of one KV head, merged and finished.
    # The prefix slots (the first ``prefix_splits``) count only for a row with a shared prefix.
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    H = tl.num_programs(1) * G
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * G + r
    r_ok = r < G
    d_ok = d < D
    first = 0
    if HAS_STARTS:
        first = tl.where(tl.load(starts_ptr + row) > 0, 0, prefix_splits)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    den = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for slot in range(first, total_splits):
        at = _partial_at(row, heads, H, slot, total_splits)  # (BLOCK_R,)
        m_s = tl.load(part_m_ptr + at, mask=r_ok, other=float("-inf"))
        den_s = tl.load(part_den_ptr + at, mask=r_ok, other=0.0)
        acc_s = tl.load(part_o_ptr + at[:, None] * D + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        m, den, acc = _merge(m, den, acc, m_s, den_s, acc_s)
    o = _finish(m, den, acc, heads, sinks_ptr, HAS_SINKS)
    tl.store(
        out_ptr + row * stride_ob + heads[:, None].to(tl.int64) * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None] & d_ok[None, :],
    )


def _next_power_of_2(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _multiprocessors(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return SMS_WITHOUT_GPU


def _splits(programs: int, positions: int, block_n: int, sms: int) -> int:
    """How many ranges to cut each row's ``positions`` into, for ``programs`` programs per range."""
    wanted = -(-PROGRAMS_PER_SM * sms // programs)
    return max(1, min(wanted, positions // (TILES_PER_SPLIT * block_n)))


def _tiling(D: int, dtype) -> tuple:
    """``(BLOCK_D, BLOCK_N)``: the head padded to a power of two, and keys per tile (64 bytes of a
    head's 128 in bf16 keep a tile at 16 KiB)."""
    BLOCK_D = _next_power_of_2(D, 16)
    return BLOCK_D, (64 if BLOCK_D * dtype.itemsize <= 256 else 32)


def decode_attention(
    q,
    k_cache,
    v_cache,
    table,
    rows,
    lengths,
    max_length,
    scale,
    window,
    softcap,
    sinks,
    cascade,
    out,
    *,
    splits=None,
    prefix_splits=None,
    block_n=None,
    num_warps=4,
):
    """The launcher ``kernels/contract.py`` declares. ``k_cache``'s and ``v_cache``'s last dimension
    is contiguous; any other strides (a head-major static cache's view) are read as they are."""
    B, H, D = q.shape
    KVH = k_cache.shape[2]
    G = H // KVH
    BLOCK_D, BLOCK_N = _tiling(D, q.dtype)
    BLOCK_N = block_n or BLOCK_N
    positions = max_length if window is None else min(max_length, window)
    sms = _multiprocessors(q.device)
    S = splits or _splits(B * KVH, positions, BLOCK_N, sms)
    split_len = triton.cdiv(triton.cdiv(positions, S), BLOCK_N) * BLOCK_N
    SP = 0
    if cascade is not None:
        E, MEMBERS = cascade.members.shape
        SP = prefix_splits or _splits(E * KVH, cascade.longest, BLOCK_N, sms)
    direct = S == 1 and cascade is None
    total = SP + S
    part_m = part_den = part_o = out  # unread placeholders when the kernel finishes rows itself
    if not direct:
        part_m = torch.empty(B, H, total, device=q.device, dtype=torch.float32)
        part_den = torch.empty_like(part_m)
        part_o = torch.empty(B, H, total, D, device=q.device, dtype=torch.float32)
    paged = table is not None
    log2e = 1.4426950408889634
    scale2, cap2 = (scale * log2e, 0.0) if softcap is None else (scale / softcap, softcap * log2e)
    common = dict(
        G=G, D=D, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, HAS_SOFTCAP=softcap is not None, IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
    )  # fmt: skip
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    if cascade is not None:
        members = cascade.members
        _prefix_kernel[(E, KVH, SP)](
            q, k_cache, v_cache, table, lengths, members, cascade.shared, part_m, part_den, part_o,
            scale2, cap2, window or 0, k_cache.shape[1], k_cache.shape[0],
            triton.cdiv(triton.cdiv(cascade.longest, SP), BLOCK_N) * BLOCK_N,
            B, q.stride(0), q.stride(1), *cache_strides, table.stride(0), members.stride(0), total,
            MEMBERS=MEMBERS, BLOCK_R=_next_power_of_2(MEMBERS * G, 16), HAS_WINDOW=window is not None, **common,
        )  # fmt: skip
    starts = None if cascade is None else cascade.starts
    _decode_kernel[(B, KVH, S)](
        q, k_cache, v_cache, table if paged else lengths, rows if rows is not None else lengths, lengths,
        starts if starts is not None else lengths,
        sinks if sinks is not None else q, out, part_m, part_den, part_o,
        scale2, cap2, window or 0, k_cache.shape[1], k_cache.shape[0], split_len,
        q.stride(0), q.stride(1), *cache_strides, table.stride(0) if paged else 0, out.stride(0), out.stride(1),
        SP, total,
        BLOCK_R=_next_power_of_2(G, 16), PAGED=paged, HAS_ROWS=rows is not None, HAS_WINDOW=window is not None,
        HAS_STARTS=starts is not None,
        HAS_SINKS=sinks is not None, DIRECT=direct, **common,
    )  # fmt: skip
    if not direct:
        _combine_kernel[(B, KVH)](
            part_m, part_den, part_o, starts if starts is not None else lengths, sinks if sinks is not None else q,
            out, out.stride(0), out.stride(1), SP, total,
            G=G, D=D, BLOCK_R=_next_power_of_2(G, 16), BLOCK_D=BLOCK_D, HAS_STARTS=starts is not None,
            HAS_SINKS=sinks is not None, num_warps=num_warps,
        )  # fmt: skip
