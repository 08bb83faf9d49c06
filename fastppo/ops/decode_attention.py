"""``decode_attention``: one decode step's attention over a KV cache, each row over its own keys.

The sampler's decode step, per layer: every row has one new query token and attends over the keys
its cache holds, ``[max(0, length - window), length)``, and (with a sink) one logit per head that
takes probability but carries no value. The cache is either static (row ``b`` owns slot ``b`` of
``k_cache``, ``(slots, max_len, KVH, D)``, any strides past the last dimension) or paged (a pool of
blocks ``(num_blocks, block_size, KVH, D)`` reached through ``block_table``). On CUDA the Triton
kernel reads exactly each row's live keys where they lie (split-K, GQA's group read once, a
group's shared prompt read once with ``cascade``); on CPU the PyTorch twin attends with SDPA.
Neither changes the cache; storing the step's new key is the cache's own job, done before.

Not differentiable: decoding needs no gradient.
"""

from typing import Optional

import torch
from torch import Tensor

from ..kernels.contract import Cascade
from . import checks
from .dispatch import implementation, resolve_backend


def _check_cache(q, k_cache, v_cache, block_table, lengths, max_length, own_rows: bool) -> None:
    """``own_rows``: query b reads cache row b, so the cache has at least B rows."""
    checks.check_float(q, "q")
    if q.dim() != 3:
        raise ValueError(f"q must have shape (B, H, D), got {tuple(q.shape)}")
    B, H, D = q.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.check_float(cache, name)
        if cache.dim() != 4 or cache.shape[3] != D:
            raise ValueError(
                f"{name} must have shape (blocks or slots, positions, KVH, D={D}), got {tuple(cache.shape)}"
            )
        if cache.stride(3) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous, got strides {cache.stride()}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache ({tuple(v_cache.shape)}, {v_cache.dtype}) differs from k_cache "
            f"({tuple(k_cache.shape)}, {k_cache.dtype})"
        )
    KVH = k_cache.shape[2]
    if KVH == 0 or H % KVH:
        raise ValueError(f"q's {H} heads are not a multiple of the cache's {KVH} KV heads")
    checks.check_integer(lengths, "lengths")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must have shape (B,) = ({B},), got {tuple(lengths.shape)}")
    checks.check_same_device(q.device, "q", k_cache=k_cache, v_cache=v_cache, lengths=lengths, block_table=block_table)
    page, least = k_cache.shape[1], B if own_rows else 1
    if block_table is None:
        if k_cache.shape[0] < least or max_length > page:
            raise ValueError(
                f"a static k_cache of {k_cache.shape[0]} slots of {page} positions cannot hold {least} rows of "
                f"max_length {max_length}"
            )
        return
    checks.check_tensor(block_table, "block_table")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] < least:
        raise ValueError(
            f"block_table must be int32 (rows >= {least}, blocks per row), got {block_table.dtype} "
            f"{tuple(block_table.shape)}"
        )
    if block_table.shape[1] * page < max_length:
        raise ValueError(
            f"block_table's {block_table.shape[1]} blocks of {page} positions cannot hold max_length {max_length}"
        )


def _check_blocks_read(block_table, rows, lengths, window, pool: tuple) -> None:
    """With ``FASTPPO_CHECK=1``: every block a row reads (those holding its positions
    ``[max(0, length - window), length)``) is one of the pool's ``num_blocks``; an entry no row reads
    may hold anything (-1)."""
    num_blocks, page = pool
    table = block_table[: lengths.shape[0]] if rows is None else block_table[rows.long()]  # (B, blocks)
    first = torch.arange(table.shape[1], device=table.device)[None, :] * page  # (1, blocks): each one's first position
    read = first < lengths[:, None]
    if window is not None:
        read &= first + page > lengths[:, None] - window
    named = (table >= 0) & (table < num_blocks)
    if not bool((named | ~read).all()):
        raise ValueError(
            f"block_table must name blocks of the pool in [0, {num_blocks}) where a row reads them, "
            f"got {table[read & ~named].tolist()}"
        )


def _check_cascade(cascade, block_table, B: int, device) -> None:
    if not isinstance(cascade, Cascade):
        raise TypeError(f"cascade must be a fastppo.kernels.contract.Cascade or None, got {type(cascade).__name__}")
    if block_table is None:
        raise ValueError("cascade reads shared blocks: it needs a paged cache (block_table)")
    members, shared, starts = cascade.members, cascade.shared, cascade.starts
    for name, x in (("cascade.members", members), ("cascade.shared", shared), ("cascade.starts", starts)):
        checks.check_tensor(x, name)
        if x.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {x.dtype}")
        checks.check_same_device(device, "q", **{name: x})
    if members.dim() != 2 or shared.shape != (members.shape[0],) or starts.shape != (B,):
        raise ValueError(
            f"cascade needs members (E, M), shared (E,) and starts (B={B},), got {tuple(members.shape)}, "
            f"{tuple(shared.shape)} and {tuple(starts.shape)}"
        )
    if not isinstance(cascade.longest, int) or cascade.longest < 0:
        raise ValueError(f"cascade.longest must be an int >= 0, got {cascade.longest!r}")


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    lengths: Tensor,
    *,
    scale: float,
    block_table: Optional[Tensor] = None,
    rows: Optional[Tensor] = None,
    max_length: Optional[int] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    cascade: Optional[Cascade] = None,
    backend: str = "auto",
) -> Tensor:
    """Attend each row's query ``q`` ``(B, H, D)`` over its cached keys -> ``(B, H, D)`` in q's dtype.

    Args:
        k_cache, v_cache: static ``(slots >= B, max_len, KVH, D)`` (row b in slot b) or, with
            ``block_table``, a pool ``(num_blocks, block_size, KVH, D)``. H is a multiple of KVH
            (query head h reads KV head ``h // (H // KVH)``). A cache of another dtype is cast.
        lengths: ``(B,)`` each row's cached positions (>= 1), its new key included.
        block_table: ``(slots, blocks)`` int32: cache row s's i-th block of positions. An entry no
            row reads may hold anything (-1); one a row reads that names no block of the pool is never
            read: the row's output is NaN (with ``FASTPPO_CHECK=1``, a ``ValueError``).
        rows: ``(B,)`` integer, the cache row (slot) each query reads, several queries may read one
            (a continuation's tokens, each with its own length); None: query b reads row b.
        max_length: an int at least every length (the decoder knows it); None reads it from
            ``lengths``, a host sync.
        window: a sliding window: a row sees its last ``window`` positions only.
        softcap: logit soft-capping (Gemma 2): each score ``s = scale * q.k`` becomes
            ``softcap * tanh(s / softcap)`` before the softmax.
        sinks: ``(H,)`` one logit per query head in every row's softmax, with no value (GPT-OSS).
        cascade: a group's shared prompt read once for its rows (``Cascade``; paged caches).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``fastppo.ops.dispatch``).
    """
    if isinstance(max_length, bool) or not (max_length is None or isinstance(max_length, int)):
        raise ValueError(f"max_length must be an int or None, got {max_length!r}")
    checks.check_tensor(lengths, "lengths")
    if max_length is None:
        max_length = int(lengths.max()) if lengths.numel() else 1
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    _check_cache(q, k_cache, v_cache, block_table, lengths, max_length, own_rows=rows is None)
    if not checks.is_real(scale):
        raise ValueError(f"scale must be a real number, got {scale!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
    if softcap is not None and (not checks.is_real(softcap) or not 0 < softcap < float("inf")):
        raise ValueError(f"softcap must be a finite number > 0 or None, got {softcap!r}")
    B, H, _ = q.shape
    if sinks is not None:
        checks.check_floating(sinks, "sinks")
        checks.check_same_device(q.device, "q", sinks=sinks)
        if sinks.shape != (H,):
            raise ValueError(f"sinks must have shape (H,) = ({H},), got {tuple(sinks.shape)}")
    slots = k_cache.shape[0] if block_table is None else block_table.shape[0]
    if rows is not None:
        checks.check_integer(rows, "rows")
        checks.check_same_device(q.device, "q", rows=rows)
        if rows.shape != (B,):
            raise ValueError(f"rows must have shape (B,) = ({B},), got {tuple(rows.shape)}")
        if cascade is not None:
            raise ValueError("cascade reads rows 0 .. B-1 of the cache: it cannot be given with rows")
    if cascade is not None:
        _check_cascade(cascade, block_table, B, q.device)
    if checks.value_checks_enabled() and rows is not None and B and not bool(((rows >= 0) & (rows < slots)).all()):
        raise ValueError(f"rows must be cache rows in [0, {slots}), got {rows.tolist()}")
    if checks.value_checks_enabled() and B and not bool(((lengths >= 1) & (lengths <= max_length)).all()):
        raise ValueError(f"lengths must be in [1, max_length={max_length}], got {lengths.tolist()}")
    if checks.value_checks_enabled() and B and block_table is not None:
        _check_blocks_read(block_table, rows, lengths, window, k_cache.shape[:2])
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if B == 0:
        return out
    resolved = resolve_backend(backend, q.device)
    with torch.no_grad():
        implementation(resolved, "decode_attention").decode_attention(
            q.detach(), k_cache, v_cache, block_table, rows, lengths, max_length, float(scale), window,
            None if softcap is None else float(softcap), None if sinks is None else sinks.float().contiguous(),
            cascade, out,
        )  # fmt: skip
    return out
