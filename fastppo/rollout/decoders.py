"""Which decoder a model gets, over which cache: the sampler's one choice of path.

Three decoders (``DECODERS``): ``"lean"``, a hand-written forward (``lean.FAMILIES``) on packed,
fused weights; ``"modules"``, the model's own modules with their attention over fastppo's cache
(``interface.py``), for any family whose layers all attend through transformers' attention
interface; ``"generic"``, the model's own forward and cache (``generic.py``). ``"auto"`` takes the
first that serves the model, in that order, except that where both cached kinds serve it, the one
whose decode step is faster on this machine decodes (timed once and kept, ``calibration.py``): the
hand-written forward stays only where it measures faster. :func:`cached_decoder` says which and
why. The cache is built here for both cached kinds: paged or static, and the decode attention
(``flash.py``) that reads it.
"""

from typing import Optional

import torch

from .attention import CacheAttention
from .calibration import TIMED_SPAN, choose_decoder
from .flash import FLASH_BLOCK, flash_decode, kernel_backend
from .interface import InterfaceDecoder, Unserved
from .lean import FAMILIES
from .packed import DecoderWeights
from .paged import DEFAULT_BLOCK, PagedKVCache, block_within, paged_blocks
from .static_cache import StaticKVCache

DECODERS = ("auto", "lean", "modules", "generic")


def cached_decoder(
    model,
    slots: int,
    max_len: int,
    dtype: Optional[torch.dtype],
    attention: str,
    kv_cache: str = "auto",
    block_size: Optional[int] = None,
    memory: Optional[int] = None,
    weights: str = "packed",
    layout: Optional[str] = None,
    decoder: str = "auto",
) -> tuple:
    """``(decoder, path)``: a decoder over a KV cache of ``slots`` rows for ``model`` (None where
    neither kind of forward serves it) and a line saying which path and why. ``attention`` picks the
    decode attention (see ``flash.py``); ``kv_cache`` the layout, ``"paged"`` (blocks of
    ``block_size`` positions in ``memory`` bytes, see ``paged.py``), ``"static"`` (``static_cache.py``)
    or ``"auto"``: paged when ``block_size`` is given or ``memory`` is short of every slot at
    ``max_len``, else static: there is then nothing to page, and the paged decode's gather of each
    row's blocks would be a cost with no saving. ``weights`` and ``layout``: what a hand-written
    forward's projections multiply by (``packed.py``); the model's own modules multiply by themselves.
    ``decoder``: one of ``DECODERS``; one named that cannot serve the model raises a ``ValueError``."""
    family_name = model.config.model_type
    if decoder == "generic":
        return None, "generic: the model's own forward and cache, as asked (decoder='generic')"
    family = FAMILIES.get(family_name) if decoder in ("auto", "lean") else None
    shapes = family and family.shapes(model)
    if shapes is not None:
        path = f"fast: a hand-written {family_name} forward over fastppo's KV cache"
        faster, projections = "lean", None
        if decoder == "auto":
            faster, projections = _faster(model, family, shapes, slots, max_len, dtype, attention, weights, layout)
        if faster == "modules":
            family, projections = InterfaceDecoder, DecoderWeights({}, "live", slots)
            path = f"fast: {family_name}'s own modules, attending over fastppo's KV cache (timed faster here)"
        elif projections is None:  # else the copy the timing packed
            projections = DecoderWeights(family.projections(model), weights, slots, layout)
    elif decoder == "lean":
        raise ValueError(
            f"decoder='lean' cannot be used: no hand-written forward serves this {family_name} model "
            f"(they serve {', '.join(FAMILIES)})"
        )
    else:
        try:
            shapes = InterfaceDecoder.shapes(model)
        except Unserved as why:
            if decoder == "modules":
                raise ValueError(f"decoder='modules' cannot be used: {why}") from None
            return None, f"generic: the model's own forward and cache, as {why}"
        family = InterfaceDecoder
        path = f"fast: {family_name}'s own modules, attending over fastppo's KV cache"
        projections = DecoderWeights({}, "live", slots)
    layers, kv_heads, head_dim, windows, sinks = shapes
    param = next(model.parameters())
    dtype = dtype or param.dtype
    token_bytes = layers * kv_heads * head_dim * dtype.itemsize  # a position's keys (or values)
    if kv_cache == "auto":
        short = memory is not None and memory < 2 * slots * max_len * token_bytes
        kv_cache = "paged" if short or block_size is not None else "static"
    backend = kernel_backend(attention, param.device)

    def decode_attention(block):
        return flash_decode(attention, param.device, param.dtype, dtype, head_dim, block, sinks)

    if kv_cache == "static":
        flash = decode_attention(None)
        # head-major unless flash-attn reads it: a head's keys of a row in one run, for SDPA and the kernel alike
        cache = StaticKVCache(layers, slots, kv_heads, max_len, head_dim, dtype, param.device, head_major=flash is None)
        return family(model, CacheAttention(cache, flash, backend), windows, projections), path
    if block_size is None:  # flash-attn's page when it would take one, else vLLM's default
        flash = flash_decode("auto", param.device, param.dtype, dtype, head_dim, FLASH_BLOCK, sinks)
        block_size = FLASH_BLOCK if flash else DEFAULT_BLOCK
    flash = decode_attention(block_size)
    block_size = block_within(block_size, max_len, FLASH_BLOCK if flash else 1)
    num_blocks = paged_blocks(memory, slots, max_len, block_size, token_bytes)
    cache = PagedKVCache(
        layers, slots, kv_heads, max_len, head_dim, dtype, param.device, block_size=block_size, num_blocks=num_blocks
    )
    return family(model, CacheAttention(cache, flash, backend), windows, projections), path


def _faster(model, lean, shapes, slots: int, max_len: int, dtype, attention: str, weights: str, layout) -> tuple:
    """``(name, projections)``: ``"lean"`` or ``"modules"``, whichever decodes a rollout of ``max_len``
    steps faster on this machine, ``model``'s hand-written forward ``lean`` (on ``weights``, its packed
    copy made again once a rollout) or its own modules, a step of each timed over a short static
    cache of ``slots`` rows; kept per machine and model, so a later sampler builds nothing to know.
    ``projections``: the hand-written forward's weights, where the timing made them (else None)."""
    param = next(model.parameters())
    params = sum(p.numel() for p in model.parameters())
    key = f"{model.config.model_type} {tuple(shapes)[:3]} {params} params {param.dtype}"
    key += f" | {weights} weights, layout {layout or 'calibrated'}"

    made = []

    def timed():
        try:
            if InterfaceDecoder.shapes(model)[:4] != tuple(shapes)[:4]:
                return None
        except Unserved:
            return None
        layers, kv_heads, head_dim, windows, _ = shapes
        cache = StaticKVCache(layers, slots, kv_heads, TIMED_SPAN, head_dim, dtype or param.dtype, param.device)
        attend = CacheAttention(cache, None, kernel_backend(attention, param.device))
        projections = DecoderWeights(lean.projections(model), weights, slots, layout)
        made.append(projections)
        return {
            "lean": (lean(model, attend, windows, projections), projections.refresh if projections.layout else None),
            "modules": (InterfaceDecoder(model, attend, windows, DecoderWeights({}, "live", slots)), None),
        }

    was_training = model.training
    model.eval()
    try:
        return choose_decoder(timed, "lean", param.device, slots, max_len, key), (made or [None])[0]
    finally:
        model.train(was_training)
