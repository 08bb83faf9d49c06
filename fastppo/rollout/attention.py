"""Attention over the sampler's KV cache, static (``static_cache.py``) or paged (``paged.py``), with
per-row positions. The cache stores (``write``, ``read``, ``flash_args``); this attends.

Prefill stores a group of right-padded prompts' keys and values in their slots and attends
causally with SDPA (which on CUDA dispatches to a flash kernel of its own). Decode stores each
row's new key and value at its own position and attends over the row's valid prefix (and its
sliding window, if the layer has one): either flash-attn's ``flash_attn_with_kvcache``, which
appends and attends in one launch reading only each row's live keys (through the block table
when paged), or fastppo's ``decode_attention`` (its launcher) after the cache has stored the key: on CUDA its
Triton kernel, which reads each row's live keys where they lie (a group's shared prompt once, by
the paged cache's cascade), on the CPU its twin, SDPA over ``[:span]`` with a mask, reading the
static cache through a transposed view (no copy) or gathering a paged row's blocks. ``flash.py``
chooses.
Extend (a multi-turn row's continuation) stores a few rows' new keys after the ones they hold and
attends over each row's prefix so far: on CUDA by the same kernel, each of a continuation's tokens
a query of its row up to its own position (no gather), elsewhere with SDPA.

What SDPA has no argument for, a layer's logit soft-capping (Gemma 2) and attention sinks (GPT-OSS),
the decode kernel and its twin take as arguments; prefill and the CPU's extend then write the
softmax out (the twin's ``softmax_written_out``).
"""

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.decode_attention_torch import live_keys, softmax_written_out
from ..ops.dispatch import implementation


class LayerAttention(NamedTuple):
    """How one layer attends, beside its queries, keys and values: the scores' ``scale``, its sliding
    ``window`` (None: every earlier key), a logit ``softcap`` (Gemma 2's; None: off) and ``sinks``
    (GPT-OSS's, fp32 ``(H,)``; None: off)."""

    scale: float
    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional[Tensor] = None


class CacheAttention:
    def __init__(self, cache, flash_decode: Optional[Callable] = None, backend: str = "torch"):
        self.cache = cache
        self.flash_decode = flash_decode  # flash_attn_with_kvcache, or None for decode_attention
        self.backend = backend  # decode_attention's: "triton" (the kernel) or "torch" (its SDPA twin)

    def prefill(self, layer: int, slots: Tensor, q: Tensor, k: Tensor, v: Tensor, how: LayerAttention) -> Tensor:
        """Store a group of right-padded prompts' keys and values in ``slots`` and attend causally.
        q: (G, H, L, D); k, v: (G, KVH, L, D) -> (G, H, L, D)."""
        scale, window, softcap, sinks = how
        G, L = q.shape[0], q.shape[2]
        rows = slots[:, None].expand(G, L).flatten()
        positions = torch.arange(L, device=q.device).repeat(G)
        self.cache.write(layer, rows, positions, k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1))
        mask = None
        if (window is not None and L > window) or softcap is not None or sinks is not None:
            pos = torch.arange(L, device=q.device)
            mask = pos[None, :] <= pos[:, None]  # (L, L)
            if window is not None:
                mask &= pos[None, :] > pos[:, None] - window
        if softcap is not None or sinks is not None:
            return softmax_written_out(q, k, v, mask, scale, softcap, sinks).to(q.dtype)
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
        how: LayerAttention,
    ) -> Tensor:
        """Store rows' continuation keys and values at ``positions`` of ``slots`` and attend over
        each row's keys up to each query's position (and within its window).

        q: (n, H, C, D); k, v: (n, KVH, C, D); positions: (n, C) int64, right-padded (row i's
        first ``lengths[i]`` are real; its pads store nothing) -> (n, H, C, D).
        """
        scale, window, softcap, sinks = how
        n, C = positions.shape
        real = torch.arange(C, device=q.device)[None, :] < lengths[:, None]  # (n, C)
        row = slots[:, None].expand(n, C)[real]
        self.cache.write(layer, row, positions[real], k.transpose(1, 2)[real], v.transpose(1, 2)[real])
        span = int(positions.max()) + 1
        if self.backend == "triton":  # each real token a query of its row, to its own position
            out = torch.zeros_like(q.transpose(1, 2))  # (n, C, H, D); the pads' stay 0, never read
            attended = torch.empty_like(out[real])  # (N, H, D)
            implementation("triton", "decode_attention").decode_attention(
                q.transpose(1, 2)[real], *self.cache.kernel_args(layer), row, positions[real] + 1, span, scale,
                window, softcap, sinks, None, attended,
            )  # fmt: skip
            out[real] = attended
            return out.transpose(1, 2)
        # Not the twin (which would gather a row's keys once per token): its mask of live keys, per token.
        mask = live_keys(positions.flatten() + 1, span, window).view(n, C, span)
        cached_k, cached_v = (c.transpose(1, 2).to(q.dtype) for c in self.cache.read(layer, slots, span))
        if softcap is not None or sinks is not None:
            return softmax_written_out(q, cached_k, cached_v, mask[:, None], scale, softcap, sinks).to(q.dtype)
        return F.scaled_dot_product_attention(
            q, cached_k, cached_v, attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )

    def decode_context(self, positions: Tensor) -> tuple:
        """What every layer of one decode step shares: where each row's new key goes, each row's
        length once it is stored ``(B,)``, and the paged cache's cascade when the kernel attends
        and some prompt is shared."""
        if self.flash_decode is not None:
            return None  # flash-attn stores and attends by itself
        B = positions.shape[0]
        cascade = self.cache.cascade(B) if self.backend == "triton" and self.cache.paged else None
        return self.cache.locate(torch.arange(B, device=positions.device), positions), positions + 1, cascade

    def decode(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        span: int,
        context: tuple,
        how: LayerAttention,
    ) -> Tensor:
        """Store the new key and value of slots ``0 .. B-1`` at their positions and attend over each
        row's keys so far.

        q: (B, H, 1, D); k, v: (B, KVH, 1, D); positions: (B,) int64, each < span; ``context`` from
        :meth:`decode_context` -> (B, H, 1, D).
        """
        if self.flash_decode is not None:  # no sinks: the decoder does not choose flash-attn for them
            return self._flash(layer, q, k, v, positions, span, how)
        scale, window, softcap, sinks = how
        at, lengths, cascade = context
        self.cache.store(layer, at, k[:, :, 0], v[:, :, 0])
        out = torch.empty_like(q)  # (B, H, 1, D)
        # The op's launcher, not the op: these arguments are right by construction, and the op's
        # checks would cost ~2% of a CPU decode step, called for every layer.
        implementation(self.backend, "decode_attention").decode_attention(
            q[:, :, 0], *self.cache.kernel_args(layer), None, lengths, span, scale, window, softcap, sinks, cascade,
            out[:, :, 0],
        )  # fmt: skip
        return out

    def _flash(self, layer, q, k, v, positions, span, how: LayerAttention) -> Tensor:
        B, window = q.shape[0], how.window
        # A row's position is its number of cached tokens: the new key goes there, and the query
        # (the last of the row) sees keys [position - (window - 1), position], as HF's window does.
        out = self.flash_decode(
            q.transpose(1, 2),
            **self.cache.flash_args(layer, B, span),
            k=k.transpose(1, 2),
            v=v.transpose(1, 2),
            cache_seqlens=positions.to(torch.int32),
            softmax_scale=how.scale,
            causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0),
            **({} if how.softcap is None else {"softcap": how.softcap}),  # flash-attn >= 2.6 takes it
        )  # (B, 1, H, D)
        return out.transpose(1, 2)
