"""The paged KV cache: keys and values in blocks of ``block_size`` positions, reached through a block
table, so a row holds the blocks of its current length, not of the cap, and the samples of a
prompt hold its full blocks once.

Storage per layer is ``(num_blocks, block_size, kv_heads, head_dim)``: token-major within a block,
the layout ``flash_attn_with_kvcache`` pages through (flash-attn 2 wants ``block_size`` a multiple
of 256). ``table`` ``(slots, max_blocks)`` int32, on the device, maps a slot's ``i``-th block of
positions to a block of the pool; entries a slot does not hold point at block 0, the *trash*
block, which no row owns: whatever a free, ended, paused or stalled slot writes at its position
lands there or in a block it holds, and nothing reads the trash for a live row. The table is one
fixed tensor updated in place, so a CUDA graph replays over it.

**Sharing.** A group's prompt is prefilled once into its first sample's blocks; every other sample
references its full blocks (a reference count per block) and gets its own copy of the partial
last one, which each sample writes into at its first step (copy on write, done up front since the
write is certain).

**Admission, never eviction.** Rows grow one position per decode step, and the host looks at them
only every few steps (``lookahead``), so before each stretch a row must hold the blocks it will
write. Blocks are granted only while the state stays *safe* in the banker's sense: some order
exists in which every row can reach its cap, each row finishing and returning its blocks before
the next needs them. A grant that would leave no such order is refused: the row *stalls* (keeps
its blocks, decodes nothing) until blocks come back, and a group is admitted only into a safe
state. In a safe state the row of least need can always be served, so some row always makes
progress: the cache never deadlocks and no running row is ever evicted. One rule decides it, for
admission and growth alike (``_least_free``): a row returns its own blocks when it ends, and a
group's shared prompt blocks come back with the last of its holders to end. The cost is one cap's
worth of blocks held back, not one per row.

**The cascade.** The decode kernel can read a group's shared prompt blocks once for all its rows
(``Cascade``). The cache keeps what it needs beside the table, as fixed tensors rewritten in place
(so a CUDA graph replays over them): the groups' rows in entries of up to ``CASCADE_MEMBERS``, each
entry's shared positions, each row's first position of its own. They change when rows are
admitted, released or moved, never as rows grow.
"""

import math
from collections import Counter

import torch
from torch import Tensor

from ..limits import GiB
from ..ops.decode_attention import Cascade

TRASH = 0  # the block every unheld table entry points at
DEFAULT_BLOCK = 16  # positions per block where flash-attn does not decode (vLLM's default too)
NEW_GROUP = -1  # the group a claim is admitting, in the safety check (block ids are >= 1)
CASCADE_MEMBERS = 8  # rows of a group the decode kernel attends its shared prompt for at once


class KVMemoryError(ValueError):
    """A KV budget of ``memory`` bytes too small: ``reason`` says for what, ``smallest`` is the least
    that works, in bytes. The message names the Sampler's argument; the trainer names its option."""

    def __init__(self, memory: int, reason: str, smallest: int):
        self.memory, self.reason, self.smallest = memory, reason, smallest
        super().__init__(f"kv_memory={memory:,} bytes {reason}")


def block_within(block_size: int, max_len: int, page: int) -> int:
    """``block_size`` at most the context: a row holds whole blocks, so positions past ``max_len``
    are memory no row can use. A multiple of ``page`` (flash-attn's, where it decodes; else 1)
    stays one."""
    step = page if block_size % page == 0 else 1
    return min(block_size, math.ceil(max_len / step) * step)


def paged_blocks(memory, slots: int, max_len: int, block_size: int, token_bytes: int) -> int:
    """The blocks (the trash block included) that ``memory`` bytes hold, a position's key (or value)
    taking ``token_bytes`` over all layers, and never more than every slot at ``max_len`` takes;
    ``memory`` None: that many (the static layout's memory, and a block)."""
    block_bytes = 2 * block_size * token_bytes
    per_row = math.ceil(max_len / block_size)
    if memory is None:
        return 1 + slots * per_row
    blocks = min(memory // block_bytes, 1 + slots * per_row)  # more would never be used
    if blocks < 1 + per_row:
        smallest = (1 + per_row) * block_bytes
        raise KVMemoryError(
            memory,
            f"hold {blocks} blocks of {block_size} positions ({block_bytes:,} bytes each), fewer than one "
            f"row at the cap needs ({per_row} and the trash block): the smallest that works is "
            f"{smallest / GiB:.3g} GiB ({smallest:,} bytes)",
            smallest,
        )
    return blocks


class PagedKVCache:
    """Blocks, a block table and the free list; the attention reads and writes through ``table``.

    Args:
        num_blocks: the pool's blocks, the trash block included.
        slots: the table's rows (the decode batch's slots); ``max_len``: positions a row may reach.
    """

    paged = True

    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        block_size: int,
        num_blocks: int,
    ):
        self.block_size, self.max_len, self.num_blocks = block_size, max_len, num_blocks
        self.max_blocks = math.ceil(max_len / block_size)
        self.block_bytes = 2 * num_layers * block_size * kv_heads * head_dim * dtype.itemsize  # K and V
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.table = torch.full((slots, self.max_blocks), TRASH, dtype=torch.int32, device=device)
        self.free = list(range(num_blocks - 1, TRASH, -1))  # popped from the end: low blocks first
        self.refs = [0] * num_blocks
        self.held = [[] for _ in range(slots)]  # each slot's blocks, in position order
        self.prompt = [0] * slots  # how many of them, at the front, are its group's shared prompt
        self.caps = [0] * slots  # the positions each slot's row may reach (0: no row)
        self.peak_blocks = 0  # the most blocks held at once since the last reset_peak
        self._members = torch.full((slots, CASCADE_MEMBERS), -1, dtype=torch.int32, device=device)
        self._shared = torch.zeros(slots, dtype=torch.int32, device=device)
        self._starts = torch.zeros(slots, dtype=torch.int32, device=device)
        self._sharing = False  # some prompt's blocks are held by two rows or more

    # ---- the storage, for the attention ----------------------------------------------------

    @property
    def slots(self) -> int:
        return self.table.shape[0]

    def write(self, layer: int, rows: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Store ``k``, ``v`` ``(n, KVH, D)`` at ``positions`` ``(n,)`` of slots ``rows`` ``(n,)``."""
        self.store(layer, self.locate(rows, positions), k, v)

    def locate(self, rows: Tensor, positions: Tensor) -> tuple:
        """Where ``positions`` of slots ``rows`` lie: their blocks and offsets, the same for every
        layer (a decode step finds them once)."""
        return self.table[rows, positions // self.block_size].long(), positions % self.block_size

    def store(self, layer: int, at: tuple, k: Tensor, v: Tensor) -> None:
        """Store ``k``, ``v`` ``(n, KVH, D)`` at ``at`` (from :meth:`locate`)."""
        for cache, x in ((self.k[layer], k), (self.v[layer], v)):
            cache[at] = x if x.dtype == cache.dtype else x.to(cache.dtype)

    def read(self, layer: int, rows, span: int) -> tuple:
        """Positions ``0 .. span-1`` of slots ``rows`` (a tensor, or ``B`` for ``0 .. B-1``), gathered
        from their blocks: keys and values ``(n, span, KVH, D)`` each. (``index_select`` over the
        flattened table: on the CPU about 1.4x faster than indexing the pool with the table.)"""
        table = self.table[:rows] if isinstance(rows, int) else self.table[rows]
        blocks = table[:, : math.ceil(span / self.block_size)]  # (n, nb)
        index = blocks.flatten().long()
        shape = (blocks.shape[0], blocks.shape[1] * self.block_size, *self.k[layer].shape[2:])
        return tuple(c[layer].index_select(0, index).view(shape)[:, :span] for c in (self.k, self.v))

    def flash_args(self, layer: int, rows: int, span: int) -> dict:
        """What ``flash_attn_with_kvcache`` reads for slots ``0 .. rows-1``: the pool and their table."""
        return dict(k_cache=self.k[layer], v_cache=self.v[layer], block_table=self.table[:rows])

    def kernel_args(self, layer: int) -> tuple:
        """What ``decode_attention`` reads: the pool's keys and values, and the block table."""
        return self.k[layer], self.v[layer], self.table

    def cascade(self, rows: int):
        """The ``Cascade`` of slots ``0 .. rows-1`` (their shared prompts, each read once per entry),
        or None while no two rows share one. Its bound on the shared positions is the cap, fixed, so
        a graph captured with it covers every prompt after."""
        if not self._sharing:
            return None
        return Cascade(self._members, self._shared, self._starts[:rows], self.max_len)

    # ---- rows' blocks, for the decoder and the loop --------------------------------------------

    def _blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    def _need(self, slot: int) -> int:
        return self._blocks_for(self.caps[slot]) - len(self.held[slot])

    def _rows(self, extra: dict) -> list:
        """Every row as ``(need, own, group, shared)``, with ``extra`` slot -> blocks granted on top:
        the blocks it still needs to reach its cap, the blocks only it holds, and its group's shared
        prompt blocks (``group`` names them by their first block; None for a row sharing none)."""
        rows = []
        for s in range(self.slots):
            if self.caps[s]:
                more, shared = extra.get(s, 0), self.prompt[s]
                group = self.held[s][0] if shared else None
                rows.append((self._need(s) - more, len(self.held[s]) - shared + more, group, shared))
        return rows

    @staticmethod
    def _least_free(rows: list) -> int:
        """The safety rule: the fewest free blocks with which every row of ``rows`` (``_rows``) reaches
        its cap in some order. Rows go least need first: ending a row only gives blocks back, so when
        the row of least need cannot go, none can. A row gives back its own blocks as it ends, and a
        group's shared prompt blocks come back with the last of its holders."""
        holders = Counter(group for _, _, group, _ in rows if group is not None)
        least = returned = 0
        for need, own, group, shared in sorted(rows, key=lambda row: row[0]):
            least = max(least, need - returned)
            returned += own
            if group is not None:
                holders[group] -= 1
                returned += shared if holders[group] == 0 else 0
        return least

    def hold(self, slots: list, positions: list) -> list:
        """Give each slot the blocks for its first ``positions[i]`` positions, least need first,
        while the state stays safe. Returns which slots hold theirs (the others stall)."""
        want = {}
        for s, p in zip(slots, positions):
            more = self._blocks_for(min(p, self.caps[s])) - len(self.held[s])
            if more > 0:
                want[s] = more
        order = sorted(want, key=self._need)

        def grantable(k: int) -> bool:  # the first k of ``order`` served together
            extra = {s: want[s] for s in order[:k]}
            free = len(self.free) - sum(extra.values())
            return free >= 0 and free >= self._least_free(self._rows(extra))

        # Serving a row never makes an unsafe state safe, so the grantable prefixes are those up to
        # some length: found by bisection (one safety check, in the common case of plenty).
        lo, hi = 0, len(order)
        if not grantable(hi):
            while lo < hi - 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if grantable(mid) else (lo, mid)
            hi = lo
        for s in order[:hi]:
            self._take(s, want[s])
        self._sync_rows(order[:hi])
        granted = set(order[:hi])
        return [s not in want or s in granted for s in slots]

    def claim(self, slots: list, prompt_len: int, cap: int, positions: int) -> bool:
        """Blocks for a new group, one row per slot: the prompt's full blocks shared, a partial last
        block and the first ``positions`` positions each. False (nothing taken) if that would leave
        the state unsafe."""
        full, each, rows = self._group(len(slots), prompt_len, cap, positions)
        free = len(self.free) - full - len(slots) * each
        if free < 0 or free < self._least_free(self._rows({}) + rows):
            return False
        shared = [self._pop() for _ in range(full)]
        for b in shared:
            self.refs[b] = len(slots)
        for s in slots:
            self.caps[s] = cap
            self.held[s], self.prompt[s] = list(shared), full
            self._take(s, each)
        self._sync_rows(slots)
        self._sync_cascade()
        return True

    def smallest(self, prompt_len: int, n: int, cap: int, positions: int) -> int:
        """The fewest blocks (trash included) in which a group of ``n`` rows with this prompt and
        cap is admitted into an empty cache, by the rule ``claim`` applies."""
        full, each, rows = self._group(n, prompt_len, cap, positions)
        return 1 + full + n * each + self._least_free(rows)

    def _group(self, n: int, prompt_len: int, cap: int, positions: int) -> tuple:
        """``(full, each, rows)`` of a group a claim admits: its shared prompt blocks, each row's own
        blocks at admission, and its ``n`` rows as ``_rows`` gives them."""
        full = prompt_len // self.block_size
        each = self._blocks_for(min(positions, cap)) - full
        return full, each, [(self._blocks_for(cap) - full - each, each, NEW_GROUP, full)] * n

    def share(self, src: list, dst: list, lengths: list) -> None:
        """Give slot ``dst[i]`` the prompt of ``lengths[i]`` tokens slot ``src[i]`` prefilled: the
        full blocks are its already (``claim``); the partial last block, if any, is copied."""
        pairs = [
            (self.held[s][n // self.block_size], self.held[d][n // self.block_size])
            for s, d, n in zip(src, dst, lengths)
            if n % self.block_size
        ]
        if not pairs:
            return
        frm, to = torch.tensor(pairs, device=self.table.device).unbind(1)
        for k, v in zip(self.k, self.v):
            k[to] = k[frm]
            v[to] = v[frm]

    def release(self, slots: list) -> None:
        """The rows of ``slots`` are done: their blocks go back as their last holder lets go."""
        for s in slots:
            for b in self.held[s]:
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    self.free.append(b)
            self.held[s], self.prompt[s], self.caps[s] = [], 0, 0
        self._sync_rows(slots)
        self._sync_cascade()

    def move(self, order: list, length: int) -> bool:
        """Slot ``i`` takes slot ``order[i]``'s blocks (its table row, no data moved); the slots past
        ``len(order)`` hold nothing."""
        k = len(order)
        for state in (self.held, self.prompt, self.caps):
            state[:k] = [state[s] for s in order]
        for s in range(k, self.slots):
            self.held[s], self.prompt[s], self.caps[s] = [], 0, 0
        self._sync_rows(range(self.slots))
        self._sync_cascade()
        return True

    def state_dict(self, length: int = 0) -> dict:
        """The blocks held and who holds them (a stream's rows in flight, saved); ``length`` is the
        static cache's argument: a row holds no block past its positions anyway."""
        held = [b for b in range(1, self.num_blocks) if self.refs[b]]
        index = torch.tensor(held, dtype=torch.long, device=self.table.device)
        return {
            "blocks": held,
            "k": [k[index].clone() for k in self.k],
            "v": [v[index].clone() for v in self.v],
            **{name: list(getattr(self, name)) for name in ("free", "refs", "prompt", "caps")},
            "held": [list(blocks) for blocks in self.held],
        }

    def load_state_dict(self, state: dict) -> None:
        index = torch.tensor(state["blocks"], dtype=torch.long, device=self.table.device)
        for cache, saved in ((self.k, state["k"]), (self.v, state["v"])):
            for layer, x in zip(cache, saved):
                layer[index] = x
        for name in ("free", "refs", "prompt", "caps", "held"):
            setattr(self, name, [list(x) if isinstance(x, list) else x for x in state[name]])
        self._sync_rows(range(self.slots))
        self._sync_cascade()

    @property
    def used_blocks(self) -> int:
        return len(self.refs) - 1 - len(self.free)

    def reset_peak(self) -> None:
        self.peak_blocks = self.used_blocks

    def _pop(self) -> int:
        b = self.free.pop()
        self.refs[b] = 1
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)
        return b

    def _take(self, slot: int, n: int) -> None:
        self.held[slot] += [self._pop() for _ in range(n)]

    def _sync_rows(self, slots) -> None:
        """Write the table rows of ``slots`` from ``held`` (unheld entries: the trash block)."""
        slots = list(slots)
        if not slots:
            return
        rows = torch.full((len(slots), self.max_blocks), TRASH, dtype=torch.int32)
        for i, s in enumerate(slots):
            rows[i, : len(self.held[s])] = torch.tensor(self.held[s], dtype=torch.int32)
        self.table[torch.tensor(slots, device=self.table.device)] = rows.to(self.table.device)

    def _sync_cascade(self) -> None:
        """Rewrite the cascade's tensors from ``held`` and ``prompt``: the rows holding a group's
        shared blocks (named by the first), in entries of up to ``CASCADE_MEMBERS``."""
        groups = {}
        for s in range(self.slots):
            if self.caps[s] and self.prompt[s]:
                groups.setdefault(self.held[s][0], []).append(s)
        members = torch.full(self._members.shape, -1, dtype=torch.int32)
        shared, starts = torch.zeros(self.slots, dtype=torch.int32), torch.zeros(self.slots, dtype=torch.int32)
        entry = 0
        for rows in groups.values():
            positions = self.prompt[rows[0]] * self.block_size
            starts[rows] = positions
            for i in range(0, len(rows), CASCADE_MEMBERS):
                chunk = rows[i : i + CASCADE_MEMBERS]
                members[entry, : len(chunk)] = torch.tensor(chunk, dtype=torch.int32)
                shared[entry] = positions
                entry += 1
        for tensor, value in ((self._members, members), (self._shared, shared), (self._starts, starts)):
            tensor.copy_(value)
        self._sharing = any(len(rows) > 1 for rows in groups.values())
