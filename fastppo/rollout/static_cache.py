"""The sampler's static KV cache: storage only, allocated once, every slot ``max_len`` positions.

``k[layer]`` and ``v[layer]`` are ``(slots, max_len, kv_heads, head_dim)``. Stored token-major, the
layout ``flash_attn_with_kvcache`` reads, a decode step's write of a row's new key is a single
contiguous ``kv_heads * head_dim`` run. Where SDPA attends instead (``head_major``), the same
indexing is a view of storage ``(slots, kv_heads, max_len, head_dim)``: each head's keys of a row
are then one contiguous run, which SDPA reads about 1.5x faster at a decode step (on a 2-core Xeon,
16 rows of 378 positions: 477 us a layer against 740 token-major). A row's prompt is written at positions ``0 .. L-1``
by the prefill of its group, and each decode step writes every row at its own position, so rows
of ragged lengths share one cache. Reading and writing it for attention is ``attention.py``'s.

The paged cache (``paged.py``) keeps the same storage interface (``write``, ``read``,
``flash_args``, ``kernel_args``, ``share``, ``move``) and adds blocks a row claims as it grows; here every slot has
all of its positions from the start.
"""

import torch
from torch import Tensor


class StaticKVCache:
    paged = False

    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        head_major: bool = False,
    ):
        def storage():
            if head_major:
                return torch.zeros(slots, kv_heads, max_len, head_dim, dtype=dtype, device=device).transpose(1, 2)
            return torch.zeros(slots, max_len, kv_heads, head_dim, dtype=dtype, device=device)

        self.k = [storage() for _ in range(num_layers)]
        self.v = [storage() for _ in range(num_layers)]

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def write(self, layer: int, rows: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Store ``k``, ``v`` ``(n, KVH, D)`` at ``positions`` ``(n,)`` of slots ``rows`` ``(n,)``."""
        self.store(layer, self.locate(rows, positions), k, v)

    def locate(self, rows: Tensor, positions: Tensor) -> tuple:
        """Where ``positions`` of slots ``rows`` lie, as the index :meth:`store` takes: the same for
        every layer, so a decode step finds it once."""
        return rows, positions

    def store(self, layer: int, at: tuple, k: Tensor, v: Tensor) -> None:
        """Store ``k``, ``v`` ``(n, KVH, D)`` at ``at`` (from :meth:`locate`)."""
        for cache, x in ((self.k[layer], k), (self.v[layer], v)):
            cache[at] = x if x.dtype == cache.dtype else x.to(cache.dtype)

    def read(self, layer: int, rows, span: int) -> tuple:
        """Positions ``0 .. span-1`` of slots ``rows`` (a tensor, or ``B`` for ``0 .. B-1``, a view
        with no copy): keys and values ``(n, span, KVH, D)`` each."""
        if isinstance(rows, int):
            return self.k[layer][:rows, :span], self.v[layer][:rows, :span]
        return self.k[layer][rows, :span], self.v[layer][rows, :span]

    def flash_args(self, layer: int, rows: int, span: int) -> dict:
        """What ``flash_attn_with_kvcache`` reads for slots ``0 .. rows-1``."""
        return dict(k_cache=self.k[layer][:rows, :span], v_cache=self.v[layer][:rows, :span])

    def kernel_args(self, layer: int) -> tuple:
        """What ``decode_attention`` reads: keys, values (row ``b`` in slot ``b``) and no block table."""
        return self.k[layer], self.v[layer], None

    def share(self, src: list, dst: list, lengths: list) -> None:
        """Give slot ``dst[i]`` the first ``lengths[i]`` positions of slot ``src[i]`` (a prompt's
        prefill shared by its samples): one copy per layer, of the longest."""
        device = self.k[0].device
        self.move_positions(torch.tensor(src, device=device), torch.tensor(dst, device=device), max(lengths))

    def move(self, order: list, length: int) -> bool:
        """Slot ``i`` takes what slot ``order[i]`` holds (its first ``length`` positions)."""
        moves = [(src, dst) for dst, src in enumerate(order) if src != dst]
        if moves:
            src, dst = torch.tensor(moves, device=self.k[0].device).unbind(1)
            self.move_positions(src, dst, length)
        return True

    def move_positions(self, src: Tensor, dst: Tensor, length: int) -> None:
        for k, v in zip(self.k, self.v):
            k[dst, :length] = k[src, :length]
            v[dst, :length] = v[src, :length]

    def state_dict(self, length: int) -> dict:
        """Every slot's first ``length`` positions (a stream's rows in flight, saved)."""
        return {"k": [k[:, :length].clone() for k in self.k], "v": [v[:, :length].clone() for v in self.v]}

    def load_state_dict(self, state: dict) -> None:
        for cache, saved in ((self.k, state["k"]), (self.v, state["v"])):
            for layer, x in zip(cache, saved):
                layer[:, : x.shape[1]] = x
