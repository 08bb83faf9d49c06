"""fastppo's device code: Triton kernels and the thin launchers that run them.

One module per kernel family (``logprobs``, ``ppo_loss``, ``gae``, ``sampling``); each launcher
takes tensors already shaped the way its kernel expects and writes into output tensors it is
given. Nothing here validates arguments, chooses dtypes or knows about autograd: that is the job
of ``fastppo.ops``. ``layout`` holds what the kernels share with their PyTorch twins and imports
no triton, so the families are imported on first use, not with the package; ``vectors`` is what
the vocabulary kernels share to read rows that start between 16-byte vectors.
"""

import importlib

FAMILIES = ("logprobs", "ppo_loss", "gae", "sampling")
__all__ = [*FAMILIES, "layout"]


def __getattr__(name):
    if name in FAMILIES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
