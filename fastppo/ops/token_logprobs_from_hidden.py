"""``token_logprobs_from_hidden``: token log-probs (and entropy) straight from hidden states.

``logits = hidden @ weight.T (+ bias)`` for a vocabulary of 150k tokens is the largest tensor in
an RL step for a language model (16k tokens x 152k x 4 bytes = 10 GB in fp32). This op never
builds it: it walks the rows in chunks, and per chunk runs one matmul (fp32 accumulate) into an
fp32 ``(chunk, V)`` buffer and the log-prob kernel over that buffer. Peak extra memory is
O(chunk x V), in the forward and in the backward.

Why the backward recomputes the chunk's logits instead of keeping gradients from the forward:
the upstream gradients of the log-probs and the entropy are per token and unknown until the
backward (a PPO loss is not a sum of log-probs), so a gradient computed in the forward would be
right only for one loss. Per chunk the backward does one matmul to rebuild the logits, one
kernel pass that writes their gradient (over the fp32 logits on a CPU; into a half buffer on
CUDA, which the matmuls read as is), and two matmuls for the hidden and weight gradients. The
weight gradient accumulates in fp32 as the output of its own matmul (no per-chunk product and
add), the bias gradient in fp32 too.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import checks
from .custom_ops import gradients, input_names
from .dispatch import implementation, resolve_backend
from .token_logprobs import upstream_grads

# Default fp32 elements in a chunk of logits, per device type. Each chunk reads the whole (V, H)
# weight three times and reads and writes the (V, H) fp32 weight gradient once, so small chunks
# are bound by those bytes: on a 2-core CPU, 512 tokens of a 49k x 576 head took 1.29 s in chunks
# of 64 rows and 0.79 s in one chunk of 512. On a GPU a chunk of n rows against a 4096-wide head
# is compute-bound from about n = 1024 (the matmul's n*H*V*2 FLOPs against the 4*V*H*2 bytes of
# the accumulator, at ~200 FLOP/byte on an H200): 1 GiB of fp32 logits gives 1024 rows at V = 152k.
CHUNK_ELEMENTS = {"cpu": 1 << 26, "cuda": 1 << 28}
# The chunk plan's two choices (the bench's FLOP/byte model reads them): the weight gradient is
# each chunk's matmul output, accumulated in place in fp32, and on CUDA the log-prob kernel writes
# the logits' gradient in half precision for the matmuls (no fp32 gradient, no cast pass).
WEIGHT_GRAD_IN_PLACE = True
HALF_LOGIT_GRAD = True


def default_chunk_size(num_rows: int, vocab_size: int, device_type: str = "cpu") -> int:
    """Rows per chunk: the largest power of two whose fp32 logits fit ``CHUNK_ELEMENTS``."""
    rows = max(1, CHUNK_ELEMENTS.get(device_type, CHUNK_ELEMENTS["cpu"]) // max(vocab_size, 1))
    return max(1, min(num_rows, 1 << (rows.bit_length() - 1)))


def matmul_fp32(a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``a @ b`` accumulated and returned in fp32 (into ``out`` when given), without upcasting half
    operands on CUDA."""
    if a.is_cuda and a.dtype == b.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)  # .float() is free for fp32


def add_matmul_fp32(acc: Tensor, a: Tensor, b: Tensor, first: bool = False) -> None:
    """``acc += a @ b`` with ``acc`` fp32 as the matmul's own output (beta = 1): no product tensor,
    no separate add; half operands stay half on CUDA. ``first``: ``acc = a @ b``, so the
    accumulator needs no zero-fill (a whole ``(V, H)`` fp32 pass) before the first chunk."""
    if a.is_cuda and a.dtype == b.dtype != torch.float32:
        if first:
            torch.mm(a, b, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif first:
        torch.mm(a.float(), b.float(), out=acc)  # .float() is free for fp32
    else:
        acc.addmm_(a.float(), b.float())


def matmul_weight(weight: Tensor) -> Tensor:
    # A CPU half matmul rounds its result to half, so there the weight is upcast once per call:
    # an O(V x H) copy, independent of the number of tokens.
    return weight if weight.is_cuda or weight.dtype == torch.float32 else weight.float()


class ChunkBuffers:
    """What every chunk of one pass writes into, made once: its fp32 logits ``(chunk, V)`` and, where
    the matmul weight is half (CUDA), the logits' gradient in half for the matmuls to read as it is
    (on the CPU, and for an fp32 weight, the gradient overwrites the logits). One chunk's buffers are
    alive at a time, as the memory plan counts them: a chunk making its own anew would hold two at
    the moment the next is made, the previous still bound (0.9 GB more at the peak for 1,024 rows of
    a 152k vocabulary on CUDA)."""

    def __init__(self, rows: int, weight: Tensor, chunk_size: int):
        self.weight = weight  # the matmul weight (``matmul_weight``) (V, H)
        self.logits = torch.empty(min(rows, chunk_size), weight.shape[0], dtype=torch.float32, device=weight.device)
        self.logit_grads = None  # made by the first chunk whose gradient is wanted

    def chunk_logits(self, hidden: Tensor, bias: Optional[Tensor]) -> Tensor:
        """``hidden`` (n, H) times the weight, plus ``bias``: (n, V) fp32, in the logits buffer."""
        logits = matmul_fp32(hidden, self.weight.t(), out=self.logits[: hidden.shape[0]])
        if bias is not None:
            logits += bias
        return logits

    def logit_grad(self, logits: Tensor) -> Tensor:
        """Where the log-prob backward writes the gradient of ``logits`` (1, n, V)."""
        if self.weight.dtype == torch.float32:
            return logits
        if self.logit_grads is None:
            self.logit_grads = torch.empty_like(self.logits, dtype=self.weight.dtype)
        return self.logit_grads[: logits.shape[1]].unsqueeze(0)


class InputGrads:
    """Gradients of hidden, weight and bias, accumulated chunk by chunk from the logits' gradient.

    Weight and bias gradients accumulate in fp32 across chunks and come out in their own dtypes;
    a gradient that is not needed comes out as an empty tensor (custom ops return tensors).
    ``needs``: whether hidden, weight and bias each want theirs.
    """

    def __init__(self, hidden: Tensor, weight: Tensor, needs: list):
        self.hidden, self.weight = hidden, weight
        need_hidden, need_weight, need_bias = needs
        f32 = dict(dtype=torch.float32, device=weight.device)
        self.hidden_grad = torch.empty_like(hidden) if need_hidden else None  # (N, H)
        self.weight_grad = torch.empty(weight.shape, **f32) if need_weight else None  # (V, H), first chunk writes
        self.bias_grad = torch.zeros(weight.shape[0], **f32) if need_bias else None  # (V,)

    def add(self, r0: int, r1: int, grad_logits: Tensor, hidden: Tensor, weight: Tensor, used: Tensor) -> None:
        """Fold in rows ``r0:r1``: grad_logits (n, V) in the matmul weight's dtype (see
        ``ChunkBuffers.logit_grad``), their hidden (n, H), the matmul weight, and ``used`` (n,) bool,
        false for ignored rows. Chunks come in row order, the first at row 0, which writes the
        weight gradient's accumulator instead of adding to it.

        An ignored row's logit gradient is exactly 0, but its hidden state may be NaN or inf
        (padding), and 0 * NaN would spread NaN over the whole weight gradient: such rows are
        zeroed first.
        """
        if self.bias_grad is not None:
            self.bias_grad += grad_logits.sum(0, dtype=torch.float32)
        if self.hidden_grad is not None:
            self.hidden_grad[r0:r1] = matmul_fp32(grad_logits, weight)  # (n, V) @ (V, H)
        if self.weight_grad is not None:
            hidden = torch.where(used.unsqueeze(1), hidden, 0.0)  # (n, H)
            add_matmul_fp32(self.weight_grad, grad_logits.t(), hidden, first=r0 == 0)  # (V, n) @ (n, H)

    def results(self) -> tuple:
        if self.weight_grad is not None and self.hidden.shape[0] == 0:
            self.weight_grad.zero_()  # no rows: no chunk wrote it
        # Three distinct empty tensors: custom-op outputs may not alias each other.
        return (
            self.hidden_grad if self.hidden_grad is not None else self.hidden.new_empty(0),
            self.weight_grad.to(self.weight.dtype) if self.weight_grad is not None else self.weight.new_empty(0),
            self.bias_grad.to(self.weight.dtype) if self.bias_grad is not None else self.weight.new_empty(0),
        )

    @staticmethod
    def fake(hidden, weight, needs: list) -> tuple:
        need_hidden, need_weight, need_bias = needs
        return (
            torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0]) if need_bias else weight.new_empty(0),
        )


def row_slice(x: Optional[Tensor], r0: int, r1: int) -> Optional[Tensor]:
    """Rows ``r0:r1`` of an optional per-row tensor."""
    return None if x is None else x[r0:r1]


@torch.library.custom_op("fastppo::token_logprobs_from_hidden", mutates_args=())
def _forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Tensor,
    temperature: Optional[Tensor],
    inv_temperature: float,
    ignore_index: int,
    chunk_size: int,
    backend: str,
    with_stats: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # hidden: (N, H); weight: (V, H); bias: (V,); labels, temperature: (N,)
    # -> logp, entropy, lse (N,) fp32, and the head statistics (N, 3) fp32, (0, 3) without them
    N = hidden.shape[0]
    logp, entropy, lse = (torch.empty(N, dtype=torch.float32, device=hidden.device) for _ in range(3))
    stats = torch.empty(N if with_stats else 0, 3, dtype=torch.float32, device=hidden.device)
    kernels = implementation(backend, "token_logprobs")
    buffers = ChunkBuffers(N, matmul_weight(weight), chunk_size)
    for r0 in range(0, N, chunk_size):
        r1 = min(N, r0 + chunk_size)
        logits = buffers.chunk_logits(hidden[r0:r1], bias)  # (n, V) fp32
        kernels.logprobs_forward(
            logits.unsqueeze(0),
            labels[r0:r1],
            row_slice(temperature, r0, r1),
            inv_temperature,
            ignore_index,
            logp[r0:r1],
            entropy[r0:r1],
            lse[r0:r1],
            stats[r0:r1] if with_stats else None,
        )
    return logp, entropy, lse, stats


@_forward.register_fake
def _(*inputs):
    named = dict(zip(_INPUTS, inputs))
    hidden, N = named["hidden"], named["hidden"].shape[0]
    return (
        *(hidden.new_empty(N, dtype=torch.float32) for _ in range(3)),
        hidden.new_empty(N if named["with_stats"] else 0, 3, dtype=torch.float32),
    )


@torch.library.custom_op("fastppo::token_logprobs_from_hidden_backward", mutates_args=())
def _backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Tensor,
    temperature: Optional[Tensor],
    inv_temperature: float,
    ignore_index: int,
    chunk_size: int,
    backend: str,
    lse: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Optional[Tensor],
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    # needs: (hidden, weight, bias) -> grad_hidden (N, H), grad_weight (V, H), grad_bias (V,); each (0,)
    # when not needed
    kernels = implementation(backend, "token_logprobs")
    w = matmul_weight(weight)
    buffers = ChunkBuffers(hidden.shape[0], w, chunk_size)
    grads = InputGrads(hidden, weight, needs)
    for r0 in range(0, hidden.shape[0], chunk_size):
        r1 = min(hidden.shape[0], r0 + chunk_size)
        logits = buffers.chunk_logits(hidden[r0:r1], bias).unsqueeze(0)  # (1, n, V) fp32
        grad_logits = buffers.logit_grad(logits)
        kernels.logprobs_backward(
            logits,
            grad_logits,
            labels[r0:r1],
            row_slice(temperature, r0, r1),
            inv_temperature,
            ignore_index,
            lse[r0:r1],
            entropy[r0:r1],
            grad_logp[r0:r1],
            row_slice(grad_entropy, r0, r1),
        )
        grads.add(r0, r1, grad_logits[0], hidden[r0:r1], w, labels[r0:r1] != ignore_index)
    return grads.results()


@_backward.register_fake
def _(*inputs):
    named = dict(zip(_BACKWARD_INPUTS, inputs))
    return InputGrads.fake(named["hidden"], named["weight"], named["needs"])


def _setup_context(ctx, inputs, output):
    named = dict(zip(_INPUTS, inputs))
    _, entropy, lse, stats = output
    ctx.save_for_backward(*(named[k] for k in ("hidden", "weight", "bias", "labels", "temperature")), lse, entropy)
    ctx.args = tuple(named[k] for k in ("inv_temperature", "ignore_index", "chunk_size", "backend"))
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx, grad_logp, grad_entropy, _grad_lse, _grad_stats):
    hidden, weight, bias, labels, temperature, lse, entropy = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]  # hidden, weight, bias
    grads = _backward(
        hidden,
        weight,
        bias,
        labels,
        temperature,
        *ctx.args,
        lse,
        entropy,
        *upstream_grads(grad_logp, grad_entropy, lse),
        list(needs),
    )
    wanted = (grad if need else None for grad, need in zip(grads, needs))
    return gradients(_INPUTS, **dict(zip(("hidden", "weight", "bias"), wanted)))


_INPUTS = input_names(torch.ops.fastppo.token_logprobs_from_hidden.default)
_BACKWARD_INPUTS = input_names(torch.ops.fastppo.token_logprobs_from_hidden_backward.default)
torch.library.register_autograd(_forward, _autograd_backward, setup_context=_setup_context)


def token_logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature=1.0,
    ignore_index: int = checks.IGNORE_INDEX,
    return_entropy: bool = False,
    return_stats: bool = False,
    chunk_size: Optional[int] = None,
    backend: str = "auto",
):
    """``token_logprobs(hidden @ weight.T + bias, labels, ...)`` without materialising the logits.

    Args:
        hidden: ``(..., H)`` float32, bfloat16 or float16 (e.g. the last hidden states of an LM).
        weight: ``(V, H)``, the LM head, same dtype and device as ``hidden``.
        labels: integer tensor of shape ``(...)``.
        bias: optional ``(V,)``.
        chunk_size: rows per chunk; peak extra memory is about ``chunk_size x V`` fp32 values
            (and as many half values on CUDA, the logits' gradient). Default: the largest power
            of two that keeps a chunk's fp32 logits under 256 MiB on a CPU, 1 GiB on CUDA.
        temperature, ignore_index, return_entropy, backend: as in :func:`token_logprobs`.
        return_stats: also return, from the same pass, a dict of detached statistics of the
            tempered logits ``z``: ``log_sum_sq_probs`` (log of sum p^2, fp32), ``mean_logits``
            (the mean of z over the vocabulary, fp32) and ``is_top1`` (bool: the label is the
            first argmax). Ignored rows give 0 and False.

    Returns:
        ``logp`` ``(...)`` fp32, then ``entropy`` if asked, then the statistics if asked (a
        tuple when more than ``logp``); ``logp`` and ``entropy`` are differentiable with
        respect to ``hidden``, ``weight`` and ``bias`` (gradients in their own dtypes,
        accumulated in fp32).
    """
    args = HiddenArgs.check(hidden, weight, labels, bias, temperature, ignore_index, chunk_size, backend)
    logp, entropy, _, stats = _forward(
        args.hidden,
        weight,
        bias,
        args.labels,
        args.temperature,
        args.inv_temperature,
        ignore_index,
        args.chunk_size,
        args.backend,
        return_stats,
    )
    results = (logp.view(args.lead),) + (entropy.view(args.lead),) * return_entropy
    if return_stats:
        log_sum_sq, mean, top1 = stats.unbind(dim=1)  # (N,) each
        results += (
            {
                "log_sum_sq_probs": log_sum_sq.view(args.lead),
                "mean_logits": mean.view(args.lead),
                "is_top1": (top1 != 0).view(args.lead),
            },
        )
    return results if len(results) > 1 else results[0]


@dataclass
class HiddenArgs:
    """Checked, flattened inputs of an op on hidden states and an LM head (shared by the losses)."""

    hidden: Tensor  # (N, H)
    labels: Tensor  # (N,)
    temperature: Optional[Tensor]  # (N,) fp32, or None for the scalar below
    inv_temperature: float
    chunk_size: int
    backend: str
    lead: torch.Size  # the token shape the caller gave

    @staticmethod
    def check(hidden, weight, labels, bias, temperature, ignore_index, chunk_size, backend) -> "HiddenArgs":
        checks.check_float(hidden, "hidden")
        checks.check_float(weight, "weight", min_dim=2)
        H = hidden.shape[-1]
        if weight.dim() != 2 or weight.shape[1] != H:
            raise ValueError(
                f"weight must have shape (V, {H}) to match hidden of shape "
                f"{tuple(hidden.shape)}, got {tuple(weight.shape)}"
            )
        V = weight.shape[0]
        checks.check_vocabulary(V, "weight")
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
            chunk_size = default_chunk_size(N, V, hidden.device.type)
        elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        backend = resolve_backend(backend, hidden.device)
        checks.check_label_values(labels, V, ignore_index)
        return HiddenArgs(
            hidden.reshape(N, H),
            checks.as_tokens(labels),
            per_row_temperature,
            inv_temperature,
            chunk_size,
            backend,
            lead,
        )
