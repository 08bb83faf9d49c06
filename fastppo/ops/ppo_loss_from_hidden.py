"""``ppo_loss_from_hidden``: the PPO policy loss from hidden states in one chunked pass: logits
never exist, 3 matmuls.

The loss is a fixed weight per token times a function of that token's log-prob and entropy (see
``aggregation.py``), so each token's gradient is known as soon as its log-prob is. Per chunk of
rows the forward therefore does everything: one matmul into an fp32 ``(chunk, V)`` buffer, the
log-prob kernel over it, the loss kernel over the chunk's tokens (partial sums and per-token
gradients), the log-prob backward kernel (into the logits, or a half buffer on CUDA), and the
two matmuls for the hidden and weight gradients. The backward only scales those gradients by
the upstream scalar.

Against chaining ``token_logprobs_from_hidden`` and ``ppo_policy_loss`` (whose backward must rebuild
each chunk's logits, since it cannot know the loss in its forward), that is three matmuls per
chunk instead of four. The price: the weight gradient (``V x H``) is held from the forward to
the backward. Without autograd (``torch.no_grad()``) the gradient work is skipped.
"""

from typing import Optional

import torch
from torch import Tensor

from ..kernels.contract import PARTIALS, LossTerms
from . import checks
from .custom_ops import gradients, input_names
from .dispatch import implementation
from .ppo_loss_from_logits import check_no_entropy, masked_labels
from .ppo_policy_loss import STATS, loss_spec, summarize
from .rollout_is_weights import rollout_is_weights_unchecked
from .token_logprobs_from_hidden import ChunkBuffers, HiddenArgs, InputGrads, matmul_weight, row_slice


@torch.library.custom_op("fastppo::ppo_loss_from_hidden", mutates_args=())
def _op(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Tensor,
    temperature: Optional[Tensor],
    inv_temperature: float,
    ignore_index: int,
    old_logprobs: Optional[Tensor],
    advantages: Tensor,
    weights: Tensor,
    valid: Tensor,
    ref_logprobs: Optional[Tensor],
    terms: list[float],
    sampler_logprobs: Optional[Tensor],
    rollout_is_cap: float,
    chunk_size: int,
    backend: str,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # hidden (N, H), weight (V, H), token tensors (N,), terms a LossTerms, needs (hidden, weight, bias)
    # -> loss (), stats, logprobs (N,), grad_hidden, grad_weight, grad_bias. old_logprobs None:
    # on-policy, the old log-probs are each chunk's own; sampler_logprobs: the advantages are weighted
    # by min(exp(old - sampler), rollout_is_cap).
    N, terms = hidden.shape[0], LossTerms.from_floats(terms)
    logprob_kernels = implementation(backend, "token_logprobs")
    loss_kernels = implementation(backend, "ppo_policy_loss")
    w = matmul_weight(weight)
    buffers = ChunkBuffers(N, w, chunk_size)
    grads = InputGrads(hidden, weight, needs)
    backward = any(needs)
    partials = []
    all_logp = torch.empty(N, dtype=torch.float32, device=hidden.device)
    for r0 in range(0, N, chunk_size):
        r1 = min(N, r0 + chunk_size)
        n = r1 - r0
        logits = buffers.chunk_logits(hidden[r0:r1], bias).unsqueeze(0)  # (1, n, V) fp32
        logp, entropy, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
        logprob_kernels.logprobs_forward(
            logits, labels[r0:r1], row_slice(temperature, r0, r1), inv_temperature, ignore_index, logp, entropy, lse
        )
        all_logp[r0:r1] = logp
        old = logp if old_logprobs is None else old_logprobs[r0:r1]  # on-policy: every ratio is exactly 1
        advantage = advantages[r0:r1]
        if sampler_logprobs is not None:
            advantage = advantage * rollout_is_weights_unchecked(
                old, sampler_logprobs[r0:r1], valid[r0:r1], rollout_is_cap
            )
        grad_logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        chunk_partials = torch.zeros(
            loss_kernels.num_programs(n), len(PARTIALS), dtype=torch.float32, device=hidden.device
        )
        loss_kernels.ppo_loss_forward(
            logp,
            old,
            advantage,
            weights[r0:r1],
            valid[r0:r1],
            row_slice(ref_logprobs, r0, r1),
            entropy,
            terms,
            grad_logp,
            chunk_partials,
        )
        partials.append(chunk_partials)
        if backward:
            grad_entropy = -terms.entropy_coef * weights[r0:r1] if terms.entropy_coef != 0 else None
            grad_logits = buffers.logit_grad(logits)
            logprob_kernels.logprobs_backward(
                logits,
                grad_logits,
                labels[r0:r1],
                row_slice(temperature, r0, r1),
                inv_temperature,
                ignore_index,
                lse,
                entropy,
                grad_logp,
                grad_entropy,
            )
            grads.add(r0, r1, grad_logits[0], hidden[r0:r1], w, valid[r0:r1])
    if not partials:
        partials.append(torch.zeros(1, len(PARTIALS), dtype=torch.float32, device=hidden.device))
    return (*summarize(torch.cat(partials), terms), all_logp, *grads.results())


@_op.register_fake
def _(*inputs):
    named = dict(zip(_INPUTS, inputs))
    hidden, f32 = named["hidden"], dict(dtype=torch.float32)
    return (
        hidden.new_empty((), **f32),
        hidden.new_empty(len(STATS), **f32),
        hidden.new_empty(hidden.shape[0], **f32),
        *InputGrads.fake(hidden, named["weight"], named["needs"]),
    )


def _setup_context(ctx, inputs, output):
    _, stats, logprobs, grad_hidden, grad_weight, grad_bias = output
    ctx.mark_non_differentiable(stats, logprobs, grad_hidden, grad_weight, grad_bias)
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)


def _backward(ctx, grad_loss, *_unused):
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    scaled = {
        name: (grad_loss * g).to(g.dtype) if needed else None
        for name, g, needed in zip(
            ("hidden", "weight", "bias"), (grad_hidden, grad_weight, grad_bias), ctx.needs_input_grad
        )
    }
    return gradients(_INPUTS, **scaled)


_INPUTS = input_names(torch.ops.fastppo.ppo_loss_from_hidden.default)
torch.library.register_autograd(_op, _backward, setup_context=_setup_context)


def ppo_loss_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    old_logprobs: Optional[Tensor],
    advantages: Tensor,
    mask: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature=1.0,
    chunk_size: Optional[int] = None,
    backend: str = "auto",
    sampler_logprobs: Optional[Tensor] = None,
    rollout_is_cap: Optional[float] = None,
    return_logprobs: bool = False,
    **loss_options,
) -> tuple:
    """:func:`fastppo.ppo_loss_from_logits` of ``hidden @ weight.T + bias``, never building the logits.

    ``hidden`` ``(..., H)``, ``weight`` ``(V, H)``, ``bias`` and ``chunk_size`` as in
    :func:`fastppo.token_logprobs_from_hidden`; ``loss_options`` are the keyword arguments of
    :func:`fastppo.ppo_policy_loss` (``clip_eps``, ``kl_coef``, ``ref_logprobs``, ``agg``, ...), except
    ``entropy``, which is computed here.
    Gradients reach ``hidden``, ``weight`` and ``bias``. One chunked pass computes the loss and
    the gradients together (three matmuls per chunk).

    ``old_logprobs=None``: the update is exactly on-policy (the first step after a rollout), so
    the old log-probs are this pass's own, detached, and every ratio is 1; no separate pass
    computes them. With ``sampler_logprobs`` and ``rollout_is_cap`` each advantage is weighted by
    :func:`fastppo.rollout_is_weights` of the old log-probs over the sampler's. With
    ``return_logprobs`` the result is ``(loss, stats, logprobs)``, the labels' log-probs
    (detached fp32, 0 where masked): the old ones, when on-policy.
    """
    check_no_entropy(loss_options, "ppo_loss_from_hidden")
    labels = masked_labels(labels, mask)
    args = HiddenArgs.check(hidden, weight, labels, bias, temperature, checks.IGNORE_INDEX, chunk_size, backend)
    spec = loss_spec(labels, "labels", old_logprobs, advantages, mask, has_entropy=True, **loss_options)
    if (sampler_logprobs is None) != (rollout_is_cap is None):
        raise ValueError("sampler_logprobs and rollout_is_cap go together: give both or neither")
    if sampler_logprobs is not None:
        checks.check_token_tensor(sampler_logprobs, "sampler_logprobs", labels, "labels")
        sampler_logprobs = checks.as_tokens(sampler_logprobs.detach())
        rollout_is_cap = checks.check_number(rollout_is_cap, "rollout_is_cap", above=1)
    grad = torch.is_grad_enabled()
    loss, stats, logprobs = _op(
        args.hidden,
        weight,
        bias,
        args.labels,
        args.temperature,
        args.inv_temperature,
        checks.IGNORE_INDEX,
        spec.old_logprobs,
        spec.advantages,
        spec.weights,
        spec.valid,
        spec.ref_logprobs,
        spec.terms,
        sampler_logprobs,
        rollout_is_cap or 0.0,
        args.chunk_size,
        args.backend,
        [grad and x is not None and x.requires_grad for x in (hidden, weight, bias)],
    )[:3]
    if return_logprobs:
        return loss, spec.named(stats), logprobs.view(labels.shape)
    return loss, spec.named(stats)
