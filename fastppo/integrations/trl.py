"""Drop-in replacements for TRL's log-prob and entropy helpers, and ``patch()`` to install them.

Supported: TRL 1.9 to 1.16 (each tested with that TRL installed). The functions follow the
installed TRL (see ``fastppo.integrations.peers``; without TRL, the newest), whose helpers changed:

* ``selective_log_softmax(logits, index)`` took no ``temperature`` or ``row_mask`` before 1.14,
  and ``selective_log_softmax_and_entropy`` appeared in 1.14. fastppo's accept both keywords on
  every version (calls TRL makes fit either way).
* The result's dtype is the logits' everywhere before 1.14; from 1.14 it is fp32 on CUDA and
  XPU (TRL's own Triton kernel), the logits' elsewhere.
* The chunked LM head that GRPO, RLOO, DPO and KTO score completions with
  (``trl.trainer.utils._ChunkedLogProbFunction``, ``trl.kernels.ChunkedLogProbFunction`` from
  1.15) was called ``(hidden, weight, targets, temperature, chunk_size, softcap, logit_scale)``
  returning ``(log_probs, entropy)`` up to 1.12; 1.13 and 1.14 added ``bias`` after ``weight``;
  1.15 added ``outputs`` and returns five per-token tensors, those not asked for None: the
  log-probs, the entropy and three detached statistics (``log_sum_sq_probs``, ``mean_logits``,
  ``is_top1``, asked for by SFT, DPO and KTO), all from fastppo's one pass over each chunk.
  Before 1.13 its backward ignored the entropy's gradient, so there the entropy comes back
  detached.
  :class:`FusedLinearLogProb` reads the arguments as the followed version passes them.

They compute in fp32 with fastppo's kernels, so in bf16 they are more accurate than TRL's CPU
path, which runs the log-softmax in bf16. What fastppo does not cover goes to TRL's own code with
the arguments as given: float64 logits, several indices per row, logit soft-capping or scaling,
and, on TRL before 1.14, a temperature other than 1 or a ``row_mask`` (that TRL has no such
arguments, so fastppo computes those itself). TRL's distillation head
(``ChunkedDivergenceFunction``) is not replaced. Importing this module does not import TRL;
``patch()`` does, and raises ImportError without it.
"""

import inspect

import torch
from torch import Tensor

from ..ops.checks import FLOAT_DTYPES
from ..ops.token_logprobs_from_hidden import token_logprobs_from_hidden
from ..ops.token_logprobs import token_logprobs
from .patching import Patch
from .peers import Peer

TRL = Peer("trl", oldest="1.9.0", newest="1.16.0")
_IGNORE = -100
_UTILS = "trl.trainer.utils"
_HEAD_STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")  # TRL >= 1.15's extra outputs, in its order
_HEAD_DEFAULTS = dict(final_logit_softcapping=None, logit_scale=1.0, outputs=("entropy", *_HEAD_STATS))


def _signature(*names: str) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=_HEAD_DEFAULTS.get(name, inspect.Parameter.empty))
                              for name in names])


# The chunked LM head's parameters, as each TRL version passes them (by the first version of each).
_HEAD_SIGNATURES = {
    "1.9": _signature("hidden", "weight", "targets", "temperature", "chunk_size", "final_logit_softcapping",
                      "logit_scale"),
    "1.13": _signature("hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                       "final_logit_softcapping", "logit_scale"),
    "1.15": _signature("hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                       "final_logit_softcapping", "logit_scale", "outputs"),
}


def _head_generation() -> str:
    return "1.15" if TRL.at_least("1.15") else "1.13" if TRL.at_least("1.13") else "1.9"


def _trl(name: str):
    """TRL's own implementation of ``name`` (for the cases fastppo leaves to it)."""
    if name == "ChunkedLogProbFunction" and TRL.at_least("1.15"):
        return _PATCH.original("trl.kernels", name)
    return _PATCH.original(_UTILS, "_ChunkedLogProbFunction" if name == "ChunkedLogProbFunction" else name)


def _out_dtype(logits: Tensor) -> torch.dtype:
    trl_kernel = TRL.at_least("1.14") and logits.device.type in ("cuda", "xpu") and logits.ndim <= 3
    return torch.float32 if trl_kernel else logits.dtype


def _covered(logits: Tensor, index: Tensor = None) -> bool:
    return logits.dtype in FLOAT_DTYPES and (index is None or index.ndim == logits.ndim - 1)


def _labels(index: Tensor, row_mask) -> Tensor:
    return index if row_mask is None else index.masked_fill(row_mask == 0, _IGNORE)


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError("temperature must be positive")


def selective_log_softmax(logits: Tensor, index: Tensor, temperature: float = 1.0, row_mask=None) -> Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``index``; rows where ``row_mask`` is 0 give 0."""
    _check_temperature(temperature)
    if not _covered(logits, index):
        if TRL.at_least("1.14"):
            return _trl("selective_log_softmax")(logits, index, temperature=temperature, row_mask=row_mask)
        logp = _trl("selective_log_softmax")(logits / temperature if temperature != 1.0 else logits, index)
        return logp if row_mask is None else logp.masked_fill(row_mask == 0, 0.0)  # as TRL 1.14 does
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
    """Both of the above in one pass over the logits; rows where ``row_mask`` is 0 give zeros (TRL >= 1.14)."""
    _check_temperature(temperature)
    if not _covered(logits, index):
        return _trl("selective_log_softmax_and_entropy")(logits, index, entropy_requires_grad=entropy_requires_grad,
                                                         temperature=temperature, row_mask=row_mask)
    logp, entropy = token_logprobs(logits, _labels(index, row_mask), temperature=temperature,
                                   ignore_index=_IGNORE, return_entropy=True)
    dtype = _out_dtype(logits)
    entropy = entropy.to(dtype)
    return logp.to(dtype), entropy if entropy_requires_grad else entropy.detach()


class FusedLinearLogProb:
    """Stands in for TRL's chunked LM-head function: ``.apply`` with the arguments the followed
    TRL version passes (see the module docstring), returning what that version returns, fp32."""

    @staticmethod
    def apply(*args, **kwargs):
        generation = _head_generation()
        a = {"bias": None, **_HEAD_DEFAULTS, **_HEAD_SIGNATURES[generation].bind(*args, **kwargs).arguments}
        hidden, weight, bias, outputs = a["hidden"], a["weight"], a["bias"], a["outputs"]
        if a["final_logit_softcapping"] is not None or a["logit_scale"] != 1.0 \
                or not set(outputs) <= {"log_probs", "entropy", *_HEAD_STATS} \
                or hidden.dtype != weight.dtype or hidden.dtype not in FLOAT_DTYPES:
            return _trl("ChunkedLogProbFunction").apply(*args, **kwargs)
        if torch.is_autocast_enabled(hidden.device.type):  # TRL projects in the autocast dtype
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        with_stats = generation == "1.15" and not set(outputs).isdisjoint(_HEAD_STATS)
        with torch.autocast(hidden.device.type, enabled=False):
            logp, entropy, *stats = token_logprobs_from_hidden(hidden, weight, a["targets"], bias=bias,
                                                          temperature=a["temperature"], return_entropy=True,
                                                          return_stats=with_stats)
        if generation == "1.9":
            return logp, entropy.detach()
        if generation == "1.13":
            return logp, entropy
        stats = stats[0] if stats else {}
        return (logp, entropy if "entropy" in outputs else None,
                *(stats[name] if name in outputs else None for name in _HEAD_STATS))


_PATCH = Patch("trl", {
    (_UTILS, "selective_log_softmax"): selective_log_softmax,
    (_UTILS, "entropy_from_logits"): entropy_from_logits,
    (_UTILS, "selective_log_softmax_and_entropy"): selective_log_softmax_and_entropy,  # TRL >= 1.14
    (_UTILS, "_ChunkedLogProbFunction"): FusedLinearLogProb,  # trl.kernels.ChunkedLogProbFunction from 1.15
}, missing="fastppo.integrations.trl.patch() needs TRL: pip install trl")


def patch() -> Patch:
    """Make the installed TRL call fastppo: every ``trl`` module holding one of TRL's helpers
    (``trl.trainer.utils``, ``trl.kernels`` and the trainers that imported from them) gets the
    replacement. Returns a context manager that unpatches on exit."""
    _PATCH.install(TRL)
    return _PATCH


def unpatch() -> None:
    """Restore TRL's functions in every ``trl`` module, including those imported while patched."""
    _PATCH.remove()
