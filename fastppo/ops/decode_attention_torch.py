"""PyTorch twin of ``fastppo.kernels.decode_attention``: the CPU path of decode attention.

Each row's keys ``[0, max_length)`` are read as one tensor: a view of a static cache (no copy;
head-major storage gives SDPA one contiguous run per head) or the row's blocks gathered from a
paged pool (``index_select`` over the flattened table: on a 2-core Xeon about 1.4x faster than
indexing the pool with the table). SDPA then attends with an additive mask that keeps each row's
live positions, the query heads of a KV head as that head's query rows (GQA's group read once per
row, 1.5x faster than SDPA's own GQA on a 2-core Xeon). A cascade is a way for the kernel to read
a shared prompt once; the math is the same, so the twin reads every row whole.

The mask is built once per decode step (``_StepMasks``). SDPA's additive mask lets a NaN at a
masked position through (NaN + -inf, and 0 x NaN): where its result holds a NaN, the softmax is
taken again written out, masked keys and values selected away, so whatever a row does not own
changes nothing, as in the kernel, which never reads it. Attention sinks, which SDPA has no
argument for, take that path too: each head's sink joins its row's scores as one more column with
no value, and so does logit soft-capping (``softcap * tanh(scores / softcap)``, Gemma 2).
"""

import math

import torch
import torch.nn.functional as F


def read_rows(cache, table, rows, span: int):
    """Positions ``0 .. span-1`` of the cache rows ``rows`` (an int ``B``: rows ``0 .. B-1``, read from
    a static cache as a view; or an index tensor ``(B,)``): ``(B, span, KVH, D)``, from a static cache
    (``table`` None) or gathered from a paged pool's blocks."""
    if table is None:
        return cache[:rows, :span] if isinstance(rows, int) else cache[rows, :span]
    page = cache.shape[1]
    table = table[:rows] if isinstance(rows, int) else table[rows]
    blocks = table[:, : math.ceil(span / page)].flatten().long()  # (B * nb,)
    named = (blocks >= 0) & (blocks < cache.shape[0])  # an entry the pool has (-1, past its end: not)
    gathered = cache.index_select(0, blocks.clamp(0, cache.shape[0] - 1))
    if not named.all():  # NaN where such a block is read; a column past a row's length is never read
        gathered[~named] = float("nan")
    return gathered.view(table.shape[0], -1, *cache.shape[2:])[:, :span]


def live_keys(lengths, span: int, window):
    """``(B, span)`` bool: each row's live keys ``[max(0, length - window), length)``."""
    keys = torch.arange(span, device=lengths.device)
    live = keys[None, :] < lengths[:, None]
    if window is not None:
        live &= keys[None, :] >= lengths[:, None] - window
    return live


class _StepMasks:
    """The additive masks (0 on live keys, -inf elsewhere, a float mask SDPA's CPU kernel takes as it
    is where it would convert a bool one) of the last ``lengths`` tensor seen, by span, window and
    dtype: a decode step's layers pass the same tensor, so the mask is built once a step, not once
    a layer. A tensor written in place since (its version moved on) is a new one."""

    def __init__(self):
        self.lengths, self.version, self.masks = None, None, {}

    def get(self, lengths, span: int, window, dtype):
        if lengths is not self.lengths or lengths._version != self.version:
            self.lengths, self.version, self.masks = lengths, lengths._version, {}
        key = (span, window, dtype)
        if key not in self.masks:
            live = live_keys(lengths, span, window)
            blocked = torch.tensor(float("-inf"), dtype=dtype, device=lengths.device)
            zero = torch.tensor(0.0, dtype=dtype, device=lengths.device)
            self.masks[key] = torch.where(live, zero, blocked)[:, None, None, :]  # (B, 1, 1, span)
        return self.masks[key]


_step_masks = _StepMasks()


def softmax_written_out(q, k, v, allowed, scale: float, softcap, sinks):
    """Attention with its softmax written out in fp32, for what SDPA cannot do: keys and values no query
    sees selected away (so whatever they hold changes nothing), each score soft-capped
    (``softcap * tanh(s / softcap)``), each head's sink (``sinks`` ``(H,)``) one more logit with no
    value. q: (B, H, L, D); k, v: (B, KVH, S, D); ``allowed``: bool, broadcast to (B, 1, L, S), the keys
    each query sees -> (B, H, L, D) fp32. The query heads of a KV head attend as one block of rows."""
    B, H, L, D = q.shape
    KVH, S = k.shape[1], k.shape[2]
    G = H // KVH
    allowed = allowed.expand(B, 1, L, S)
    seen = allowed.any(dim=2)[..., None]  # (B, 1, S, 1)
    k, v = (torch.where(seen, x.float(), 0.0) for x in (k, v))  # (B, KVH, S, D)
    rows = q.float().reshape(B, KVH, G * L, D)  # head kv * G + g, query l -> row g * L + l
    scores = (rows @ k.transpose(2, 3)) * scale  # (B, KVH, G * L, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, :, None].expand(B, 1, G, L, S).reshape(B, 1, G * L, S), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, KVH, G, 1, 1).expand(B, KVH, G, L, 1).reshape(B, KVH, G * L, 1)
        scores = torch.cat((scores, sink), dim=3)
    return (torch.softmax(scores, dim=3)[..., :S] @ v).view(B, H, L, D)


def decode_attention(
    q, k_cache, v_cache, table, rows, lengths, max_length, scale, window, softcap, sinks, cascade, out
):
    """The launcher ``kernels/contract.py`` declares. On the CPU, SDPA first, and only where it gives
    NaN (a NaN in a masked position, or in a live one) the exact softmax (the check costs no sync
    there); on another device, the exact softmax."""
    (B, H, D), KVH = q.shape, k_cache.shape[2]
    # (B, KVH, span, D) each; a cache in another dtype than q's is cast, as the kernel casts its tiles
    rows = B if rows is None else rows.long()
    keys, values = (read_rows(c, table, rows, max_length).transpose(1, 2) for c in (k_cache, v_cache))
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    grouped = q.view(B, KVH, H // KVH, D)  # (B, KVH, G, D)
    o = None
    if sinks is None and softcap is None and q.device.type == "cpu":
        mask = _step_masks.get(lengths, max_length, window, q.dtype)
        o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    if o is None or math.isnan(o.sum()):  # a NaN anywhere (3 us, where isnan().any() takes 15)
        live = live_keys(lengths, max_length, window)[:, None, None, :]  # (B, 1, 1, span)
        o = softmax_written_out(q.view(B, H, 1, D), keys, values, live, scale, softcap, sinks)
    out.copy_(o.reshape(B, H, D))  # (B, KVH, G, D) -> (B, H, D)
