"""``linear_token_logprobs``: token log-probs (and entropy) straight from hidden states.

``logits = hidden @ weight.T (+ bias)`` for a vocabulary of 150k tokens is the largest tensor in
an RL step for a language model (16k tokens x 152k x 4 bytes = 10 GB in fp32). This op never
builds it: it walks the rows in chunks, and per chunk runs one matmul (fp32 accumulate) into an
fp32 ``(chunk, V)`` buffer and the log-prob kernel over that buffer. Peak extra memory is
O(chunk x V), in the forward and in the backward.

Why the backward recomputes the chunk's logits instead of keeping gradients from the forward:
the upstream gradients of the log-probs and the entropy are per token and unknown until the
backward (a PPO loss is not a sum of log-probs), so a gradient computed in the forward would be
right only for one loss. Per chunk the backward does one matmul to rebuild the logits, one
kernel pass that overwrites them in place with their gradient, and two matmuls for the hidden
and weight gradients. Weight and bias gradients accumulate in fp32 across chunks.
"""

from typing import Optional

import torch
from torch import Tensor

from . import checks
from .dispatch import implementation, resolve_backend
from .token_logprobs import upstream_grads

# Default fp32 elements in a chunk of logits: 256 MiB on a GPU, 16 MiB on a CPU.
_CHUNK_ELEMENTS = {"cuda": 1 << 26}
_CHUNK_ELEMENTS_OTHER = 1 << 22


def default_chunk_size(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """Rows per chunk: the largest power of two whose fp32 logits fit the device's budget."""
    budget = _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS_OTHER)
    rows = max(1, budget // max(vocab_size, 1))
    return max(1, min(num_rows, 1 << (rows.bit_length() - 1)))


def _matmul_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` accumulated and returned in fp32, without upcasting half operands on CUDA."""
    if a.dtype == b.dtype == torch.float32:
        return a @ b
    if a.is_cuda and a.dtype == b.dtype:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _matmul_weight(weight: Tensor) -> Tensor:
    # A CPU half matmul rounds its result to half, so there the weight is upcast once per call:
    # an O(V x H) copy, independent of the number of tokens.
    return weight if weight.is_cuda or weight.dtype == torch.float32 else weight.float()


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    logits = _matmul_fp32(hidden, weight.t())  # (n, H) @ (H, V) -> (n, V) fp32
    if bias is not None:
        logits += bias
    return logits


def _rows(x: Optional[Tensor], r0: int, r1: int) -> Optional[Tensor]:
    return None if x is None else x[r0:r1]


@torch.library.custom_op("fastppo::linear_token_logprobs", mutates_args=())
def _forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
             temperature: Optional[Tensor], inv_temperature: float, ignore_index: int,
             chunk_size: int, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    # hidden: (N, H); weight: (V, H); bias: (V,); labels, temperature: (N,) -> 3 x (N,) fp32
    N = hidden.shape[0]
    logp, entropy, lse = (torch.empty(N, dtype=torch.float32, device=hidden.device) for _ in range(3))
    kernels = implementation(backend, "logprobs")
    matmul_weight = _matmul_weight(weight)
    for r0 in range(0, N, chunk_size):
        r1 = min(N, r0 + chunk_size)
        logits = _chunk_logits(hidden[r0:r1], matmul_weight, bias)  # (n, V) fp32
        kernels.logprobs_forward(logits.unsqueeze(0), labels[r0:r1], _rows(temperature, r0, r1),
                                 inv_temperature, ignore_index,
                                 logp[r0:r1], entropy[r0:r1], lse[r0:r1])
    return logp, entropy, lse


@_forward.register_fake
def _(hidden, weight, bias, labels, temperature, inv_temperature, ignore_index, chunk_size, backend):
    return tuple(hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("fastppo::linear_token_logprobs_backward", mutates_args=())
def _backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
              temperature: Optional[Tensor], inv_temperature: float, ignore_index: int,
              chunk_size: int, backend: str, lse: Tensor, entropy: Tensor, grad_logp: Tensor,
              grad_entropy: Optional[Tensor], need_hidden: bool, need_weight: bool,
              need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    # -> grad_hidden (N, H), grad_weight (V, H), grad_bias (V,); each (0,) when not needed
    N = hidden.shape[0]
    V = weight.shape[0]
    kernels = implementation(backend, "logprobs")
    matmul_weight = _matmul_weight(weight)
    grad_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
    grad_bias = torch.zeros(V, dtype=torch.float32, device=weight.device) if need_bias else None
    for r0 in range(0, N, chunk_size):
        r1 = min(N, r0 + chunk_size)
        h = hidden[r0:r1]  # (n, H)
        logits = _chunk_logits(h, matmul_weight, bias).unsqueeze(0)  # (1, n, V) fp32
        kernels.logprobs_backward(logits, logits, labels[r0:r1], _rows(temperature, r0, r1),
                                  inv_temperature, ignore_index, lse[r0:r1], entropy[r0:r1],
                                  grad_logp[r0:r1], _rows(grad_entropy, r0, r1))
        grad_logits = logits[0]  # (n, V) fp32, overwritten in place by the kernel
        if need_bias:
            grad_bias += grad_logits.sum(0)
        # Half weights on CUDA: the matmuls take the gradient in half, as cuBLAS wants.
        grad_logits = grad_logits.to(matmul_weight.dtype)
        if need_hidden:
            grad_hidden[r0:r1] = _matmul_fp32(grad_logits, matmul_weight)  # (n, V) @ (V, H)
        if need_weight:
            grad_weight += _matmul_fp32(grad_logits.t(), h)  # (V, n) @ (n, H)
    return (grad_hidden,
            grad_weight.to(weight.dtype) if need_weight else weight.new_empty(0),
            grad_bias.to(weight.dtype) if need_bias else weight.new_empty(0))


@_backward.register_fake
def _(hidden, weight, bias, labels, temperature, inv_temperature, ignore_index, chunk_size, backend,
      lse, entropy, grad_logp, grad_entropy, need_hidden, need_weight, need_bias):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0]) if need_bias else weight.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, temperature, *args = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, bias, labels, temperature, lse, entropy)
    ctx.args = args  # inv_temperature, ignore_index, chunk_size, backend
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx, grad_logp, grad_entropy, _grad_lse):
    hidden, weight, bias, labels, temperature, lse, entropy = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_hidden, grad_weight, grad_bias = _backward(
        hidden, weight, bias, labels, temperature, *ctx.args, lse, entropy,
        *upstream_grads(grad_logp, grad_entropy, lse), need_hidden, need_weight, need_bias)
    return (grad_hidden if need_hidden else None, grad_weight if need_weight else None,
            grad_bias if need_bias else None, None, None, None, None, None, None)


torch.library.register_autograd(_forward, _autograd_backward, setup_context=_setup_context)


def linear_token_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Optional[Tensor] = None,
                          temperature=1.0, ignore_index: int = -100, return_entropy: bool = False,
                          chunk_size: Optional[int] = None, backend: str = "auto"):
    """``token_logprobs(hidden @ weight.T + bias, labels, ...)`` without materialising the logits.

    Args:
        hidden: ``(..., H)`` float32, bfloat16 or float16 (e.g. the last hidden states of an LM).
        weight: ``(V, H)``, the LM head, same dtype and device as ``hidden``.
        labels: integer tensor of shape ``(...)``.
        bias: optional ``(V,)``.
        chunk_size: rows per chunk; peak extra memory is about ``chunk_size x V`` fp32 values.
            Default: the largest power of two that keeps a chunk under 256 MiB on CUDA, 16 MiB
            elsewhere.
        temperature, ignore_index, return_entropy, backend: as in :func:`token_logprobs`.

    Returns:
        ``logp`` ``(...)`` fp32, or ``(logp, entropy)``; differentiable with respect to
        ``hidden``, ``weight`` and ``bias`` (gradients in their own dtypes, accumulated in fp32).
    """
    checks.check_float(hidden, "hidden")
    checks.check_float(weight, "weight", min_dim=2)
    H = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"weight must have shape (V, {H}) to match hidden of shape "
                         f"{tuple(hidden.shape)}, got {tuple(weight.shape)}")
    V = weight.shape[0]
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}")
    if bias is not None:
        checks.check_float(bias, "bias")
        if bias.shape != (V,):
            raise ValueError(f"bias must have shape ({V},), got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias has dtype {bias.dtype} but weight has {weight.dtype}")
    lead = hidden.shape[:-1]
    checks.check_labels(labels, lead, "hidden")
    checks.check_ignore_index(ignore_index)
    checks.check_same_device(hidden.device, "hidden", weight=weight, bias=bias, labels=labels)
    per_row_temperature, inv_temperature = checks.normalize_temperature(temperature, lead, hidden.device)
    N = labels.numel()
    if chunk_size is None:
        chunk_size = default_chunk_size(N, V, hidden.device)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    backend = resolve_backend(backend, hidden.device)
    checks.check_label_values(labels, V, ignore_index)

    logp, entropy, _ = _forward(hidden.reshape(N, H), weight, bias, labels.reshape(-1),
                                per_row_temperature, inv_temperature, ignore_index, chunk_size, backend)
    if return_entropy:
        return logp.view(lead), entropy.view(lead)
    return logp.view(lead)
