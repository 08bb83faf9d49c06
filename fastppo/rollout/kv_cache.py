"""The sampler's KV cache: storage only, allocated once, one slot per row of the decode batch.

``k[layer]`` and ``v[layer]`` are ``(slots, max_len, kv_heads, head_dim)``, token-major: the layout
``flash_attn_with_kvcache`` reads, and one in which a decode step's write of a row's new key is a
single contiguous ``kv_heads * head_dim`` run. A row's prompt is written at positions ``0 .. L-1``
by the prefill of its group, and each decode step writes every row at its own position, so rows
of ragged lengths share one cache. Reading and writing it for attention is ``attention.py``'s.
"""

import torch
from torch import Tensor


class KVCache:
    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (slots, max_len, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def copy_slots(self, src: Tensor, dst: Tensor, length: int) -> None:
        """Give slots ``dst`` the first ``length`` positions of slots ``src`` (the two disjoint): a
        prompt's prefill shared by its samples, or rows moved when the batch is packed. One copy
        per layer."""
        for k, v in zip(self.k, self.v):
            k[dst, :length] = k[src, :length]
            v[dst, :length] = v[src, :length]
