"""Drop-in replacements for TRL's log-prob and entropy helpers, and ``patch()`` to install them.

Follows every TRL release in ``TRL`` (1.9.0 to 1.16.0), the installed one (see
``fastppo.integrations.peers``; without TRL, the newest): ``selective_log_softmax``,
``entropy_from_logits``, ``selective_log_softmax_and_entropy`` and the chunked LM head its trainers
score completions with (:class:`FusedLinearLogProb`). Importing this module does not import TRL;
``patch()`` does, and raises ImportError without it. What each release changed, what is left to
TRL's own code and where these deviate from TRL on purpose: ``docs/integrations.md`` ("TRL, release
by release").
"""

import torch
from torch import Tensor

from ..ops.checks import FLOAT_DTYPES, IGNORE_INDEX
from ..ops.token_logprobs import token_logprobs
from ..ops.token_logprobs_from_hidden import token_logprobs_from_hidden
from .patching import Patch
from .peers import Peer, parameters

TRL = Peer(
    "trl",
    {
        "1.9.0": (),
        "1.9.1": (),
        "1.9.2": (),
        "1.10.0": (),
        "1.11.0": (),
        "1.12.0": (),
        "1.13.0": ("head-bias",),
        "1.14.0": ("temperature-and-row-mask", "fp32-on-accelerators"),
        "1.14.1": (),
        "1.14.2": (),
        "1.15.0": ("head-outputs",),
        "1.16.0": (),
    },
)
_UTILS = "trl.trainer.utils"
_HEAD_STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")  # TRL >= 1.15's extra outputs, in its order
_HEAD = ("hidden", "weight", "targets", "temperature", "chunk_size")
_HEAD_OPTIONS = dict(final_logit_softcapping=None, logit_scale=1.0)


def _trl(name: str):
    """TRL's own implementation of ``name`` (for the cases fastppo leaves to it)."""
    if name == "ChunkedLogProbFunction" and TRL.has("head-outputs"):
        return _PATCH.original("trl.kernels", name)
    return _PATCH.original(_UTILS, "_ChunkedLogProbFunction" if name == "ChunkedLogProbFunction" else name)


def _out_dtype(logits: Tensor) -> torch.dtype:
    trl_kernel = TRL.has("fp32-on-accelerators") and logits.device.type in ("cuda", "xpu") and logits.ndim <= 3
    return torch.float32 if trl_kernel else logits.dtype


def _covered(logits: Tensor, index: Tensor = None) -> bool:
    return logits.dtype in FLOAT_DTYPES and (index is None or index.ndim == logits.ndim - 1)


def _labels(index: Tensor, row_mask) -> Tensor:
    return index if row_mask is None else index.masked_fill(row_mask == 0, IGNORE_INDEX)


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError("temperature must be positive")


def selective_log_softmax(logits: Tensor, index: Tensor, temperature: float = 1.0, row_mask=None) -> Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``index``; rows where ``row_mask`` is 0 give 0."""
    _check_temperature(temperature)
    if not _covered(logits, index):
        if TRL.has("temperature-and-row-mask"):
            return _trl("selective_log_softmax")(logits, index, temperature=temperature, row_mask=row_mask)
        logp = _trl("selective_log_softmax")(logits / temperature if temperature != 1.0 else logits, index)
        return logp if row_mask is None else logp.masked_fill(row_mask == 0, 0.0)  # as TRL 1.14 does
    logp = token_logprobs(logits, _labels(index, row_mask), temperature=temperature, ignore_index=IGNORE_INDEX)
    return logp.to(_out_dtype(logits))


def entropy_from_logits(logits: Tensor, chunk_size: int = 128) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim (``chunk_size`` is TRL's; fastppo chunks itself)."""
    if not _covered(logits):
        return _trl("entropy_from_logits")(logits, chunk_size=chunk_size)
    zeros = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    _, entropy = token_logprobs(logits, zeros, return_entropy=True)
    return entropy.to(_out_dtype(logits))


def selective_log_softmax_and_entropy(
    logits: Tensor, index: Tensor, entropy_requires_grad: bool = True, temperature: float = 1.0, row_mask=None
) -> tuple:
    """Both of the above in one pass over the logits; rows where ``row_mask`` is 0 give zeros (TRL >= 1.14)."""
    _check_temperature(temperature)
    if not _covered(logits, index):
        return _trl("selective_log_softmax_and_entropy")(
            logits, index, entropy_requires_grad=entropy_requires_grad, temperature=temperature, row_mask=row_mask
        )
    logp, entropy = token_logprobs(
        logits, _labels(index, row_mask), temperature=temperature, ignore_index=IGNORE_INDEX, return_entropy=True
    )
    dtype = _out_dtype(logits)
    entropy = entropy.to(dtype)
    return logp.to(dtype), entropy if entropy_requires_grad else entropy.detach()


class _NoGradient(torch.autograd.Function):
    """The input's values, differentiable with a zero gradient (TRL before 1.13 returns its LM head's
    entropy so: it requires grad, and its backward ignores what flows back into it)."""

    @staticmethod
    def forward(ctx, x):
        return x.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


class FusedLinearLogProb:
    """Stands in for TRL's chunked LM-head function: ``.apply`` with the arguments the followed
    TRL release passes (see the module docstring), returning what that release returns, fp32."""

    @staticmethod
    @TRL.follows(
        {
            "1.9.0": parameters(*_HEAD, **_HEAD_OPTIONS),
            "1.13.0": parameters("hidden", "weight", "bias", *_HEAD[2:], **_HEAD_OPTIONS),
            "1.15.0": parameters(
                "hidden", "weight", "bias", *_HEAD[2:], **_HEAD_OPTIONS, outputs=("entropy", *_HEAD_STATS)
            ),
        }
    )
    def apply(**given):
        a = {"bias": None, "outputs": (), **given}
        hidden, weight, bias, outputs = a["hidden"], a["weight"], a["bias"], a["outputs"]
        if (
            a["final_logit_softcapping"] is not None
            or a["logit_scale"] != 1.0
            or not set(outputs) <= {"log_probs", "entropy", *_HEAD_STATS}
            or hidden.dtype != weight.dtype
            or hidden.dtype not in FLOAT_DTYPES
        ):
            return _trl("ChunkedLogProbFunction").apply(*given.values())  # autograd's apply is positional
        if torch.is_autocast_enabled(hidden.device.type):  # TRL projects in the autocast dtype
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        with_stats = not set(outputs).isdisjoint(_HEAD_STATS)
        with torch.autocast(hidden.device.type, enabled=False):
            logp, entropy, *stats = token_logprobs_from_hidden(
                hidden,
                weight,
                a["targets"],
                bias=bias,
                temperature=a["temperature"],
                return_entropy=True,
                return_stats=with_stats,
            )
        if not TRL.has("head-bias"):  # that TRL's backward ignores the entropy's gradient
            return logp, _NoGradient.apply(entropy)
        if not TRL.has("head-outputs"):
            return logp, entropy
        stats = stats[0] if stats else {}
        return (
            logp,
            entropy if "entropy" in outputs else None,
            *(stats[name] if name in outputs else None for name in _HEAD_STATS),
        )


_PATCH = Patch(
    "trl",
    {
        (_UTILS, "selective_log_softmax"): selective_log_softmax,
        (_UTILS, "entropy_from_logits"): entropy_from_logits,
        (_UTILS, "selective_log_softmax_and_entropy"): selective_log_softmax_and_entropy,  # TRL >= 1.14
        (_UTILS, "_ChunkedLogProbFunction"): FusedLinearLogProb,  # trl.kernels.ChunkedLogProbFunction from 1.15
    },
    caller="fastppo.integrations.trl.patch()",
    install_hint="pip install trl",
)


def patch() -> Patch:
    """Make the installed TRL call fastppo: every ``trl`` module holding one of TRL's helpers
    (``trl.trainer.utils``, ``trl.kernels`` and the trainers that imported from them) gets the
    replacement. Returns a context manager that unpatches on exit."""
    _PATCH.install(TRL)
    return _PATCH


def unpatch() -> None:
    """Restore TRL's functions in every ``trl`` module, including those imported while patched."""
    _PATCH.remove()
