"""The sampler's KV cache: allocated once, one slot per row, filled to a per-row length.

``k[layer]`` and ``v[layer]`` are ``(max_batch, max_len, kv_heads, head_dim)``, token-major: the
layout ``flash_attn_with_kvcache`` reads, and one in which a decode step's write of a row's new
key is a single contiguous ``kv_heads * head_dim`` run. A row's prompt is written at positions
``0 .. L-1`` by a prefill of its group, and each decode step writes every row at its own
position, so rows of ragged lengths share one cache.

Decode attention over a row's valid prefix (and its sliding window, if the layer has one) is
either flash-attn's kernel, which appends and attends in one launch, or PyTorch SDPA over
``[:span]`` with a mask, reading the cache through a transposed view (no copy).
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


class KVCache:
    def __init__(self, num_layers: int, max_batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, flash_decode: Optional[Callable] = None):
        shape = (max_batch, max_len, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.flash_decode = flash_decode  # flash_attn_with_kvcache, or None for SDPA

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def copy_rows(self, src: Tensor, dst: Tensor, length: int) -> None:
        """Give rows ``dst`` the first ``length`` positions of rows ``src`` (samples of one prompt
        share its prefill); one copy per layer."""
        for k, v in zip(self.k, self.v):
            k[dst, :length] = k[src, :length]
            v[dst, :length] = v[src, :length]

    def prefill_attention(self, layer: int, rows: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float,
                          window: Optional[int]) -> Tensor:
        """Store a group of right-padded prompts' keys and values in cache rows ``rows`` and attend
        causally. q: (G, H, L, D); k, v: (G, KVH, L, D)."""
        L = q.shape[2]
        self.k[layer][rows, :L] = k.transpose(1, 2)
        self.v[layer][rows, :L] = v.transpose(1, 2)
        mask = None
        if window is not None and L > window:
            pos = torch.arange(L, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # (L, L)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def decode_masks(self, positions: Tensor, span: int, windows: set) -> dict:
        """For one decode step, each window's (None: full attention) key mask ``(B, span)`` bool.

        Built once per step and shared by the layers; empty for flash-attn, which needs none.
        """
        if self.flash_decode is not None:
            return {}
        keys = torch.arange(span, device=positions.device)
        causal = keys[None, :] <= positions[:, None]  # (B, span)
        return {w: causal if w is None else causal & (keys[None, :] > positions[:, None] - w) for w in windows}

    def decode_attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, span: int,
                         scale: float, window: Optional[int], masks: dict) -> Tensor:
        """Store each row's new key and value at its position and attend over its keys so far.

        q: (B, H, 1, D); k, v: (B, KVH, 1, D); positions: (B,) int64, each < span; ``masks`` from
        :meth:`decode_masks` -> (B, H, 1, D).
        """
        if self.flash_decode is not None:
            return self._flash_attention(layer, q, k, v, positions, span, scale, window)
        B = q.shape[0]
        rows = torch.arange(B, device=q.device)
        self.k[layer][rows, positions] = k[:, :, 0]
        self.v[layer][rows, positions] = v[:, :, 0]
        # The cache may be stored in another dtype than the model computes in; .to is then a cast.
        cached_k, cached_v = (c[layer][:B, :span].transpose(1, 2).to(q.dtype) for c in (self.k, self.v))
        return F.scaled_dot_product_attention(q, cached_k, cached_v, attn_mask=masks[window][:, None, None, :],
                                              scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    def _flash_attention(self, layer, q, k, v, positions, span, scale, window) -> Tensor:
        B = q.shape[0]
        # A row's position is its number of cached tokens: the new key goes there, and the query
        # (the last of the row) sees keys [position - (window - 1), position], as HF's window does.
        out = self.flash_decode(
            q.transpose(1, 2), self.k[layer][:B, :span], self.v[layer][:B, :span],
            k=k.transpose(1, 2), v=v.transpose(1, 2), cache_seqlens=positions.to(torch.int32),
            softmax_scale=scale, causal=True, window_size=(-1, -1) if window is None else (window - 1, 0),
        )  # (B, 1, H, D)
        return out.transpose(1, 2)
