"""``token_logprobs``: per-token log-probs (and entropy) of labels under ``softmax(logits / T)``.

This is the op every policy-gradient loss starts from. It is registered as a ``torch.library``
custom op with a fake implementation and an autograd formula, so ``torch.compile(fullgraph=True)``
traces through it, and it never synchronises with the device, so it can be captured in a CUDA
graph. The forward reads the logits once; the backward reads them once more and writes the
gradient in the logits' dtype; neither makes an fp32 copy of the logits.

With ``inplace_backward=True`` the backward writes the gradient over the logits themselves (each
element is read before it is written, by the same program), as Liger's and flash-attn's
cross-entropy losses can: the loss head then never holds a second ``(N, V)`` tensor, which halves
its peak memory. The logits' contents are gone after the backward, so nothing else may need them;
autograd's version check raises if another saved use does.
"""

from typing import Optional

import torch
from torch import Tensor

from . import checks
from .custom_ops import gradients, input_names
from .dispatch import implementation, resolve_backend


@torch.library.custom_op("fastppo::token_logprobs", mutates_args=())
def _forward(
    logits: Tensor,
    labels: Tensor,
    temperature: Optional[Tensor],
    inv_temperature: float,
    ignore_index: int,
    backend: str,
    with_entropy: bool,
    inplace_backward: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    # logits: (B, T, V) any strides; labels, temperature: (N,) -> logp, entropy, lse: (N,) fp32,
    # entropy (0,) when not asked for (the PyTorch twin then skips its passes)
    N = labels.shape[0]
    logp, lse = (torch.empty(N, dtype=torch.float32, device=logits.device) for _ in range(2))
    entropy = torch.empty(N if with_entropy else 0, dtype=torch.float32, device=logits.device)
    implementation(backend, "token_logprobs").logprobs_forward(
        logits, labels, temperature, inv_temperature, ignore_index, logp, entropy if with_entropy else None, lse
    )
    return logp, entropy, lse


@_forward.register_fake
def _(logits, labels, temperature, inv_temperature, ignore_index, backend, with_entropy, inplace_backward):
    N = labels.shape[0]
    return (
        labels.new_empty(N, dtype=torch.float32),
        labels.new_empty(N if with_entropy else 0, dtype=torch.float32),
        labels.new_empty(N, dtype=torch.float32),
    )


@torch.library.custom_op("fastppo::token_logprobs_backward", mutates_args=())
def _backward(
    logits: Tensor,
    labels: Tensor,
    temperature: Optional[Tensor],
    inv_temperature: float,
    ignore_index: int,
    backend: str,
    lse: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Optional[Tensor],
) -> Tensor:
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # (B, T, V)
    implementation(backend, "token_logprobs").logprobs_backward(
        logits, grad, labels, temperature, inv_temperature, ignore_index, lse, entropy, grad_logp, grad_entropy
    )
    return grad


@_backward.register_fake
def _(logits, labels, temperature, inv_temperature, ignore_index, backend, lse, entropy, grad_logp, grad_entropy):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("fastppo::token_logprobs_backward_", mutates_args=("logits",))
def _backward_in_place(
    logits: Tensor,
    labels: Tensor,
    temperature: Optional[Tensor],
    inv_temperature: float,
    ignore_index: int,
    backend: str,
    lse: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Optional[Tensor],
) -> None:
    implementation(backend, "token_logprobs").logprobs_backward(
        logits, logits, labels, temperature, inv_temperature, ignore_index, lse, entropy, grad_logp, grad_entropy
    )


def _setup_context(ctx, inputs, output):
    logits, labels, temperature, inv_temperature, ignore_index, backend, _with_entropy, inplace = inputs
    _, entropy, lse = output
    ctx.save_for_backward(logits, labels, temperature, lse, entropy)
    ctx.args = (inv_temperature, ignore_index, backend)
    ctx.inplace_backward = inplace
    ctx.set_materialize_grads(False)  # an unused entropy then costs nothing in the backward


def upstream_grads(grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], like: Tensor):
    """Dense fp32 upstream gradients for the kernels: ``grad_logp`` always, ``grad_entropy`` or None.

    Autograd hands over None for an unused output and expanded stride-0 tensors after a sum.
    """
    grad_logp = torch.zeros_like(like) if grad_logp is None else grad_logp.float().contiguous()
    return grad_logp, None if grad_entropy is None else grad_entropy.float().contiguous()


def _autograd_backward(ctx, grad_logp, grad_entropy, _grad_lse):
    logits, labels, temperature, lse, entropy = ctx.saved_tensors
    inv_temperature, ignore_index, backend = ctx.args
    args = (
        labels,
        temperature,
        inv_temperature,
        ignore_index,
        backend,
        lse,
        entropy,
        *upstream_grads(grad_logp, grad_entropy, lse),
    )
    if ctx.inplace_backward:
        _backward_in_place(logits, *args)
        grad = logits  # now holds its own gradient
    else:
        grad = _backward(logits, *args)
    return gradients(_INPUTS, logits=grad)


_INPUTS = input_names(torch.ops.fastppo.token_logprobs.default)
torch.library.register_autograd(_forward, _autograd_backward, setup_context=_setup_context)


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature=1.0,
    ignore_index: int = checks.IGNORE_INDEX,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    backend: str = "auto",
):
    """Log-prob of each label under ``softmax(logits / temperature)``, optionally with the entropy.

    Args:
        logits: ``(..., V)`` float32, bfloat16 or float16, any strides (slices are read in place).
        labels: integer tensor of shape ``(...)``, the leading shape of ``logits``.
        temperature: a positive number, or a tensor broadcastable to ``(...)`` (e.g. ``(B, 1)``
            per sequence). A runtime value: changing it never recompiles a kernel.
        ignore_index: label value whose log-prob and entropy are 0, with zero gradient.
        return_entropy: also return ``-sum p log p`` of the same distribution.
        inplace_backward: the backward overwrites ``logits`` with their gradient instead of
            allocating one (half the loss head's peak memory); ``logits`` must not be needed
            after the backward.
        backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU), ``"triton"`` or ``"torch"``.

    Returns:
        ``logp`` of shape ``(...)`` in float32, or ``(logp, entropy)``. Both are differentiable
        with respect to ``logits``. A label outside ``[0, V)`` (other than ``ignore_index``) or a
        temperature that is not positive and finite gives NaN in that row, and with
        ``FASTPPO_CHECK=1`` a ``ValueError``. Rows labelled ``ignore_index`` may hold anything
        (NaN, inf): their outputs are 0 and their gradient exactly 0.
    """
    checks.check_float(logits, "logits")
    checks.check_vocabulary(logits.shape[-1], "logits")
    lead = logits.shape[:-1]
    checks.check_labels(labels, lead, "logits")
    checks.check_ignore_index(ignore_index)
    checks.check_same_device(logits.device, "logits", labels=labels)
    per_row_temperature, inv_temperature = checks.normalize_temperature(temperature, lead, logits.device)
    backend = resolve_backend(backend, logits.device)
    checks.check_label_values(labels, logits.shape[-1], ignore_index)

    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {type(inplace_backward).__name__}")
    logp, entropy, _ = _forward(
        checks.as_rows(logits),
        checks.as_tokens(labels),
        per_row_temperature,
        inv_temperature,
        ignore_index,
        backend,
        return_entropy,
        inplace_backward,
    )
    if return_entropy:
        return logp.view(lead), entropy.view(lead)
    return logp.view(lead)
