"""Attention over the sampler's KV cache, static (``kv_cache.py``) or paged (``paged.py``), with
per-row positions. The cache stores (``write``, ``read``, ``flash_args``); this attends.

Prefill stores a group of right-padded prompts' keys and values in their slots and attends
causally with SDPA (which on CUDA dispatches to a flash kernel of its own). Decode stores each
row's new key and value at its own position and attends over the row's valid prefix (and its
sliding window, if the layer has one): either flash-attn's ``flash_attn_with_kvcache``, which
appends and attends in one launch reading only each row's live keys (through the block table
when paged), or SDPA over ``[:span]`` with a mask, reading the static cache through a transposed
view (no copy) or gathering a paged row's blocks. ``flash.py`` chooses.
Extend (a multi-turn row's continuation) stores a few rows' new keys after the ones they hold and
attends over each row's prefix so far with SDPA.
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


class CacheAttention:
    def __init__(self, cache, flash_decode: Optional[Callable] = None):
        self.cache = cache
        self.flash_decode = flash_decode  # flash_attn_with_kvcache, or None for SDPA

    def prefill(
        self, layer: int, slots: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, window: Optional[int]
    ) -> Tensor:
        """Store a group of right-padded prompts' keys and values in ``slots`` and attend causally.
        q: (G, H, L, D); k, v: (G, KVH, L, D) -> (G, H, L, D)."""
        G, L = q.shape[0], q.shape[2]
        rows = slots[:, None].expand(G, L).flatten()
        positions = torch.arange(L, device=q.device).repeat(G)
        self.cache.write(layer, rows, positions, k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1))
        mask = None
        if window is not None and L > window:
            pos = torch.arange(L, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # (L, L)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )

    def extend(
        self,
        layer: int,
        slots: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        lengths: Tensor,
        scale: float,
        window: Optional[int],
    ) -> Tensor:
        """Store rows' continuation keys and values at ``positions`` of ``slots`` and attend over
        each row's keys up to each query's position (and within its window).

        q: (n, H, C, D); k, v: (n, KVH, C, D); positions: (n, C) int64, right-padded (row i's
        first ``lengths[i]`` are real; its pads store nothing) -> (n, H, C, D).
        """
        n, C = positions.shape
        real = torch.arange(C, device=q.device)[None, :] < lengths[:, None]  # (n, C)
        row = slots[:, None].expand(n, C)[real]
        self.cache.write(layer, row, positions[real], k.transpose(1, 2)[real], v.transpose(1, 2)[real])
        span = int(positions.max()) + 1
        keys = torch.arange(span, device=q.device)
        mask = keys[None, None, :] <= positions[:, :, None]  # (n, C, span)
        if window is not None:
            mask &= keys[None, None, :] > positions[:, :, None] - window
        cached_k, cached_v = (c.transpose(1, 2).to(q.dtype) for c in self.cache.read(layer, slots, span))
        return F.scaled_dot_product_attention(
            q, cached_k, cached_v, attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )

    def decode_masks(self, positions: Tensor, span: int, windows: set, dtype: torch.dtype) -> dict:
        """For one decode step, each window's (None: full attention) key mask ``(B, 1, 1, span)``,
        additive in ``dtype`` (0 on a row's keys, -inf elsewhere): SDPA's CPU kernel takes a float
        mask as it is, where it would convert a bool one at every layer.

        Built once per step and shared by the layers; empty for flash-attn, which needs none.
        """
        if self.flash_decode is not None:
            return {}
        keys = torch.arange(span, device=positions.device)
        causal = keys[None, :] <= positions[:, None]  # (B, span)
        masks = {w: causal if w is None else causal & (keys[None, :] > positions[:, None] - w) for w in windows}
        blocked = torch.tensor(float("-inf"), dtype=dtype, device=positions.device)
        zero = torch.tensor(0.0, dtype=dtype, device=positions.device)
        return {w: torch.where(m, zero, blocked)[:, None, None, :] for w, m in masks.items()}

    def decode(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        span: int,
        scale: float,
        window: Optional[int],
        masks: dict,
    ) -> Tensor:
        """Store the new key and value of slots ``0 .. B-1`` at their positions and attend over each
        row's keys so far.

        q: (B, H, 1, D); k, v: (B, KVH, 1, D); positions: (B,) int64, each < span; ``masks`` from
        :meth:`decode_masks` -> (B, H, 1, D).

        The query heads that share a key head (GQA's group of G) attend as G query rows of that
        head, one attention per key head: ``(B, KVH, G, D)`` against ``(B, KVH, span, D)``. A row's
        keys are then read once for its group, not once per query head (1.5x faster than SDPA's
        own GQA on a 2-core Xeon).
        """
        if self.flash_decode is not None:
            return self._flash(layer, q, k, v, positions, span, scale, window)
        (B, H, _, D), KVH = q.shape, k.shape[1]
        self.cache.write(layer, torch.arange(B, device=q.device), positions, k[:, :, 0], v[:, :, 0])
        # The cache may be stored in another dtype than the model computes in; .to is then a cast.
        cached_k, cached_v = (c.transpose(1, 2).to(q.dtype) for c in self.cache.read(layer, B, span))
        out = F.scaled_dot_product_attention(
            q.reshape(B, KVH, H // KVH, D), cached_k, cached_v, attn_mask=masks[window], scale=scale
        )  # (B, KVH, G, D)
        return out.view(B, H, 1, D)

    def _flash(self, layer, q, k, v, positions, span, scale, window) -> Tensor:
        B = q.shape[0]
        # A row's position is its number of cached tokens: the new key goes there, and the query
        # (the last of the row) sees keys [position - (window - 1), position], as HF's window does.
        out = self.flash_decode(
            q.transpose(1, 2),
            **self.cache.flash_args(layer, B, span),
            k=k.transpose(1, 2),
            v=v.transpose(1, 2),
            cache_seqlens=positions.to(torch.int32),
            softmax_scale=scale,
            causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0),
        )  # (B, 1, H, D)
        return out.transpose(1, 2)
