"""Drop-in replacements for TRL's log-prob and entropy helpers, and ``patch()`` to install them.

The functions have the signatures of ``trl.trainer.utils`` in TRL 1.x and return what TRL's
returns on the same device: on CPU in the logits' dtype, on CUDA in fp32 (as TRL's own Triton
kernel does). They compute in fp32 with fastppo's kernels, so in bf16 they are more accurate than
TRL's CPU path, which runs the log-softmax in bf16. ``FusedLinearLogProb`` stands in for TRL's
chunked LM-head function (``trl.kernels.ChunkedLogProbFunction``, what GRPO and RLOO score
completions with) whenever only log-probs and entropies are asked for.

Cases fastppo does not cover (float64 logits, several indices per row, logit soft-capping or
scaling, TRL's extra per-token outputs) go to TRL's own code. Importing this module does not
import TRL; ``patch()`` does, and raises ImportError without it.
"""

import importlib
import sys

import torch
from torch import Tensor

from ..ops.checks import FLOAT_DTYPES
from ..ops.linear_token_logprobs import linear_token_logprobs
from ..ops.token_logprobs import token_logprobs

_IGNORE = -100
_UTILS = "trl.trainer.utils"
_originals = {}  # name -> TRL's object, while patched
_patched = []  # (module, name, original) to restore


def _trl(name: str):
    """TRL's own implementation of ``name`` (for the cases fastppo leaves to it)."""
    if name in _originals:
        return _originals[name]
    if name == "ChunkedLogProbFunction":
        return importlib.import_module("trl.kernels").ChunkedLogProbFunction
    return getattr(importlib.import_module(_UTILS), name)


def _out_dtype(logits: Tensor) -> torch.dtype:
    return torch.float32 if logits.device.type in ("cuda", "xpu") else logits.dtype


def _covered(logits: Tensor, index: Tensor = None) -> bool:
    return logits.dtype in FLOAT_DTYPES and (index is None or index.ndim == logits.ndim - 1)


def _labels(index: Tensor, row_mask) -> Tensor:
    return index if row_mask is None else index.masked_fill(row_mask == 0, _IGNORE)


def selective_log_softmax(logits: Tensor, index: Tensor, temperature: float = 1.0, row_mask=None) -> Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``index``; rows where ``row_mask`` is 0 give 0."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    if not _covered(logits, index):
        return _trl("selective_log_softmax")(logits, index, temperature=temperature, row_mask=row_mask)
    logp = token_logprobs(logits, _labels(index, row_mask), temperature=temperature, ignore_index=_IGNORE)
    return logp.to(_out_dtype(logits))


def entropy_from_logits(logits: Tensor, chunk_size: int = 128) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim (``chunk_size`` is TRL's; fastppo chunks itself)."""
    if not _covered(logits):
        return _trl("entropy_from_logits")(logits, chunk_size=chunk_size)
    zeros = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    _, entropy = token_logprobs(logits, zeros, return_entropy=True)
    return entropy.to(_out_dtype(logits))


def selective_log_softmax_and_entropy(logits: Tensor, index: Tensor, entropy_requires_grad: bool = True,
                                      temperature: float = 1.0, row_mask=None) -> tuple:
    """Both of the above in one pass over the logits; rows where ``row_mask`` is 0 give zeros."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    if not _covered(logits, index):
        return _trl("selective_log_softmax_and_entropy")(logits, index, entropy_requires_grad=entropy_requires_grad,
                                                         temperature=temperature, row_mask=row_mask)
    logp, entropy = token_logprobs(logits, _labels(index, row_mask), temperature=temperature,
                                   ignore_index=_IGNORE, return_entropy=True)
    dtype = _out_dtype(logits)
    entropy = entropy.to(dtype)
    return logp.to(dtype), entropy if entropy_requires_grad else entropy.detach()


class FusedLinearLogProb:
    """Stands in for ``trl.kernels.ChunkedLogProbFunction`` (``.apply`` with the same arguments).

    Returns TRL's five per-token outputs ``(log_probs, entropy, log_sum_sq_probs, mean_logits,
    is_top1)``, fp32, None where not requested, from :func:`fastppo.linear_token_logprobs`.
    """

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        if final_logit_softcapping is not None or logit_scale != 1.0 or not set(outputs) <= {"log_probs", "entropy"} \
                or hidden.dtype != weight.dtype or hidden.dtype not in FLOAT_DTYPES:
            return _trl("ChunkedLogProbFunction").apply(hidden, weight, bias, targets, temperature, chunk_size,
                                                        final_logit_softcapping, logit_scale, outputs)
        if torch.is_autocast_enabled(hidden.device.type):  # TRL projects in the autocast dtype
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            logp, entropy = linear_token_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                                                  return_entropy=True)
        return logp, entropy if "entropy" in outputs else None, None, None, None


_REPLACEMENTS = {
    "selective_log_softmax": selective_log_softmax,
    "entropy_from_logits": entropy_from_logits,
    "selective_log_softmax_and_entropy": selective_log_softmax_and_entropy,
    "_ChunkedLogProbFunction": FusedLinearLogProb,  # trl.trainer.utils' name for ChunkedLogProbFunction
}


class _Patch:
    """What ``patch()`` returns: also a context manager that unpatches on exit."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        unpatch()


def patch() -> _Patch:
    """Make the installed TRL call fastppo: every ``trl`` module holding one of TRL's helpers by
    name (``trl.trainer.utils`` and the trainers that imported from it) gets the replacement."""
    try:
        utils = importlib.import_module(_UTILS)
    except ImportError as error:
        raise ImportError("fastppo.integrations.trl.patch() needs TRL: pip install trl") from error
    if _patched:
        return _Patch()
    for name, replacement in _REPLACEMENTS.items():
        original = getattr(utils, name, None)
        if original is None:
            continue  # an older TRL without this helper
        _originals[name.lstrip("_")] = original
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("trl") and getattr(module, name, None) is original:
                setattr(module, name, replacement)
                _patched.append((module, name, original))
    return _Patch()


def unpatch() -> None:
    """Restore every TRL function ``patch()`` replaced."""
    while _patched:
        module, name, original = _patched.pop()
        setattr(module, name, original)
    _originals.clear()
