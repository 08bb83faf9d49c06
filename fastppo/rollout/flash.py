"""Choosing the decode attention: flash-attn's ``flash_attn_with_kvcache`` where it can run, else
fastppo's own ``decode_attention`` (its Triton kernel on CUDA, its SDPA twin elsewhere).

``flash_attn_with_kvcache`` appends each row's new key and value at its own length and attends
over the row's valid prefix in one kernel, reading only the live part of the cache, where PyTorch
SDPA reads the whole ``[:span]`` window with a mask. It needs the flash-attn package, CUDA, a
float16 or bfloat16 model with a KV cache of the same dtype, and a head size up to 256 that is a
multiple of 8, and for a paged cache blocks of a multiple of 256 positions (flash-attn 2's page
size rule). ``attention="auto"`` takes it when all of that holds; ``"flash"`` insists and
says which condition failed. Otherwise ``decode_attention`` attends: ``"triton"`` runs its kernel
(which reads each row's live keys where they lie, paged or not, and a group's shared prompt once),
``"sdpa"`` its PyTorch twin, and ``"auto"`` the kernel on CUDA where triton is installed, else the
twin (the CPU's path). Prefill always runs SDPA, which on CUDA already dispatches causal attention
to a flash kernel of its own.
"""

import importlib.util
from typing import Callable, Optional

import torch

from ..ops.dispatch import TRITON_INSTALLED, resolve_backend

ATTENTIONS = ("auto", "flash", "triton", "sdpa")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_BLOCK = 256  # flash-attn 2 pages a KV cache in blocks of a multiple of this many positions


def _load_flash() -> Callable:
    from flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache


def _why_not_flash(
    device: torch.device,
    model_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    head_dim: int,
    block_size=None,
    sinks: bool = False,
) -> Optional[str]:
    """None when flash-attn's decode can serve this model and cache (paged in blocks of
    ``block_size`` positions, or static: None; ``sinks``: its attention has sinks), else the reason
    it cannot."""
    if sinks:
        return "flash-attn's decode has no attention sinks"
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed"
    if device.type != "cuda":
        return f"flash-attn runs on CUDA only, and the model is on {device}"
    if model_dtype not in FLASH_DTYPES or cache_dtype != model_dtype:
        return (
            f"flash-attn needs a float16 or bfloat16 model and a KV cache of the same dtype, got "
            f"a {model_dtype} model and a {cache_dtype} cache"
        )
    if head_dim > 256 or head_dim % 8:
        return f"flash-attn needs a head size up to 256 and a multiple of 8, got {head_dim}"
    if block_size is not None and block_size % FLASH_BLOCK:
        return f"flash-attn pages a KV cache in blocks of a multiple of {FLASH_BLOCK} positions, got {block_size}"
    return None


def flash_decode(
    attention: str,
    device: torch.device,
    model_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    head_dim: int,
    block_size: Optional[int] = None,
    sinks: bool = False,
) -> Optional[Callable]:
    """``flash_attn_with_kvcache`` if ``attention`` (one of ``ATTENTIONS``) picks it, else None
    (``decode_attention``, on the backend :func:`kernel_backend` names)."""
    if attention in ("triton", "sdpa"):
        return None
    reason = _why_not_flash(device, model_dtype, cache_dtype, head_dim, block_size, sinks)
    if reason is None:
        try:
            return _load_flash()
        except (ImportError, OSError) as error:  # installed, but built for another torch or CUDA
            reason = f"flash_attn failed to import ({error})"
    if attention == "flash":
        raise ValueError(f"attention='flash' cannot be used: {reason}")
    return None


def kernel_backend(attention: str, device: torch.device) -> str:
    """The backend ``decode_attention`` runs on where flash-attn does not decode: ``"triton"`` (the
    kernel) or ``"torch"`` (the twin), as ``attention`` (one of ``ATTENTIONS``) picks for ``device``."""
    if attention == "triton":
        try:
            return resolve_backend("triton", device)
        except ValueError as error:
            raise ValueError(f"attention='triton' cannot be used: {error}") from None
    if attention == "auto" and device.type == "cuda" and TRITON_INSTALLED:
        return "triton"
    return "torch"
