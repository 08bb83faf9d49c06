"""A float64 PyTorch model of flash-attn's ``flash_attn_with_kvcache``, written from its documented
contract (flash-attn 2.x, ``flash_attn/flash_attn_interface.py``), for machines without flash-attn.

The sampler's flash path is tested on the CPU by handing it this function; on a GPU with
flash-attn installed, ``test_flash.py`` checks that the real kernel agrees with it. The contract,
for the arguments the sampler passes:

* ``q`` ``(B, Lq, H, D)``; ``k_cache``, ``v_cache`` ``(B, S, KVH, D)`` with a unit last stride;
  ``k``, ``v`` ``(B, Lnew, KVH, D)`` or None; ``cache_seqlens`` ``(B,)`` int32.
* With ``k`` and ``v``, row b's new keys and values are written into the caches in place at
  positions ``cache_seqlens[b] ...``; the row then has ``seqlen_k = cache_seqlens[b] + Lnew`` keys.
* Query i sits at ``i + seqlen_k - Lq`` (causal masks align to the bottom right) and sees keys
  ``j < seqlen_k`` with ``j <= its position`` when causal, and, for a window ``(left, right)``
  other than ``(-1, -1)``, ``position - left <= j <= position + right``.
* Query head h reads key/value head ``h // (H // KVH)``; scores are scaled by ``softmax_scale``.
* With ``block_table`` ``(B, max_blocks)`` int32 the caches are paged: ``(num_blocks,
  page_block_size, KVH, D)`` with ``page_block_size`` a multiple of 256, and row b's position j
  lives in block ``block_table[b, j // page_block_size]`` at offset ``j % page_block_size``.
"""

import torch


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, softmax_scale, causal, window_size=(-1, -1), block_table=None
):
    if block_table is not None:
        return _paged(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size, block_table)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need a unit last stride"
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
    B, Lq, H, D = q.shape
    S, KVH = k_cache.shape[1], k_cache.shape[2]
    assert H % KVH == 0 and k_cache.shape == v_cache.shape == (B, S, KVH, D)
    seqlen_k = cache_seqlens.long()
    if k is not None:
        Lnew = k.shape[1]
        assert bool((seqlen_k + Lnew <= S).all()), "the new keys must fit in the cache"
        for b in range(B):
            start = int(seqlen_k[b])
            k_cache[b, start : start + Lnew] = k[b]
            v_cache[b, start : start + Lnew] = v[b]
        seqlen_k = seqlen_k + Lnew

    keys = torch.arange(S, device=q.device)
    query_pos = torch.arange(Lq, device=q.device)[None, :] + (seqlen_k - Lq)[:, None]  # (B, Lq)
    allowed = keys[None, None, :] < seqlen_k[:, None, None]  # (B, Lq, S)
    left, right = window_size
    if causal:
        right = 0
    if left >= 0:
        allowed &= keys[None, None, :] >= query_pos[..., None] - left
    if right >= 0:
        allowed &= keys[None, None, :] <= query_pos[..., None] + right

    group = H // KVH
    kk = k_cache.double().repeat_interleave(group, dim=2)  # (B, S, H, D)
    vv = v_cache.double().repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.double(), kk) * softmax_scale  # (B, H, Lq, S)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bhqs,bshd->bqhd", torch.softmax(scores, dim=-1), vv)  # (B, Lq, H, D)
    return out.to(q.dtype)


def _paged(q, k_pool, v_pool, k, v, cache_seqlens, softmax_scale, causal, window_size, block_table):
    """The paged contract through the dense one: each row's blocks gathered into a dense cache, the
    new keys written there, and the blocks they landed in written back to the pool."""
    page = k_pool.shape[1]
    assert page % 256 == 0, "flash-attn pages in blocks of a multiple of 256 positions"
    assert block_table.dtype == torch.int32 and block_table.shape[0] == q.shape[0]
    blocks = block_table.long()  # (B, nb)
    dense_k, dense_v = (pool[blocks].flatten(1, 2).clone() for pool in (k_pool, v_pool))  # (B, nb*page, KVH, D)
    out = flash_attn_with_kvcache(
        q,
        dense_k,
        dense_v,
        k,
        v,
        cache_seqlens=cache_seqlens,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
    )
    if k is not None:
        for b in range(q.shape[0]):
            for j in range(int(cache_seqlens[b]), int(cache_seqlens[b]) + k.shape[1]):
                k_pool[blocks[b, j // page], j % page] = dense_k[b, j]
                v_pool[blocks[b, j // page], j % page] = dense_v[b, j]
    return out
