"""The PPO policy loss straight from logits or from hidden states.

``ppo_loss_from_logits`` = ``token_logprobs`` then ``ppo_policy_loss``. Their autograd chain is
already the fused pass structure: the forward reads the logits once (log-prob, entropy, log-sum-
exp) and the loss kernel turns them into per-token gradients; the backward reads the logits once
more and writes their gradient once, with the upstream scalar folded into the per-token
gradients, not applied to an ``(N, V)`` tensor. Two reads and one write, and no fp32 ``(N, V)``
temporary (peers read three times).

``ppo_loss_from_hidden`` runs chunk by chunk, so the full logits never exist, and computes the
gradients in its forward, where each token's gradient is already known (``linear_ppo_loss.py``).

Masked positions (``mask`` false) get ``ignore_index`` labels, so whatever they hold (a padding
id, -1) costs nothing and passes no gradient. The entropy is always computed (it is free in the
log-prob pass) and reported; it carries a gradient only when ``entropy_coef`` is nonzero.
"""

from typing import Optional

import torch
from torch import Tensor

from . import checks
from .linear_ppo_loss import linear_ppo_loss
from .linear_token_logprobs import LinearArgs
from .ppo_loss import loss_spec, ppo_policy_loss
from .token_logprobs import token_logprobs

_IGNORE = -100


def _masked_labels(labels: Tensor, mask: Tensor) -> Tensor:
    checks.check_integer(labels, "labels")  # before torch.where would promote bool labels to ids 0/1
    valid, _ = checks.check_mask(mask, labels, "labels")
    return torch.where(valid, labels, _IGNORE)


def _check_no_entropy(loss_options: dict, name: str) -> None:
    if "entropy" in loss_options:
        raise TypeError(f"{name} computes the entropy itself; do not pass entropy=")


def ppo_loss_from_logits(logits: Tensor, labels: Tensor, old_logprobs: Tensor, advantages: Tensor,
                         mask: Tensor, *, temperature=1.0, inplace_backward: bool = False, backend: str = "auto",
                         **loss_options) -> tuple[Tensor, dict]:
    """:func:`fastppo.ppo_policy_loss` of the labels' log-probs under ``softmax(logits / temperature)``.

    ``logits`` ``(..., V)`` and ``labels`` ``(...)`` as in :func:`fastppo.token_logprobs`; the
    token tensors have the labels' shape. ``inplace_backward`` as in :func:`fastppo.token_logprobs`:
    the backward writes the logits' gradient over them. ``loss_options`` are the keyword arguments of
    :func:`fastppo.ppo_policy_loss` (``clip_eps``, ``kl_coef``, ``ref_logprobs``, ``agg``, ...),
    except ``entropy``, which is computed here.
    """
    _check_no_entropy(loss_options, "ppo_loss_from_logits")
    logp, entropy = token_logprobs(logits, _masked_labels(labels, mask), temperature=temperature,
                                   ignore_index=_IGNORE, return_entropy=True, inplace_backward=inplace_backward,
                                   backend=backend)
    return ppo_policy_loss(logp, old_logprobs, advantages, mask, entropy=entropy, backend=backend, **loss_options)


def ppo_loss_from_hidden(hidden: Tensor, weight: Tensor, labels: Tensor, old_logprobs: Optional[Tensor],
                         advantages: Tensor, mask: Tensor, *, bias: Optional[Tensor] = None, temperature=1.0,
                         chunk_size: Optional[int] = None, backend: str = "auto", ref_logprobs=None,
                         clip_eps: float = 0.2, clip_eps_high=None, dual_clip=None, kl_coef: float = 0.0,
                         kl_estimator: str = "k3", entropy_coef: float = 0.0, agg: str = "token-mean",
                         num_tokens=None, sampler_logprobs: Optional[Tensor] = None,
                         rollout_is_cap: Optional[float] = None, return_logprobs: bool = False) -> tuple:
    """:func:`ppo_loss_from_logits` of ``hidden @ weight.T + bias``, never building the logits.

    ``hidden`` ``(..., H)``, ``weight`` ``(V, H)``, ``bias`` and ``chunk_size`` as in
    :func:`fastppo.linear_token_logprobs`; the loss options as in :func:`fastppo.ppo_policy_loss`.
    Gradients reach ``hidden``, ``weight`` and ``bias``. One chunked pass computes the loss and
    the gradients together (three matmuls per chunk; see ``linear_ppo_loss.py``).

    ``old_logprobs=None``: the update is exactly on-policy (the first step after a rollout), so
    the old log-probs are this pass's own, detached, and every ratio is 1; no separate pass
    computes them. With ``sampler_logprobs`` and ``rollout_is_cap`` each advantage is weighted by
    :func:`fastppo.rollout_is_weights` of the old log-probs over the sampler's. With
    ``return_logprobs`` the result is ``(loss, stats, logprobs)``, the labels' log-probs
    (detached fp32, 0 where masked): the old ones, when on-policy.
    """
    labels = _masked_labels(labels, mask)
    args = LinearArgs.check(hidden, weight, labels, bias, temperature, _IGNORE, chunk_size, backend)
    spec = loss_spec(labels, "labels", old_logprobs, advantages, mask, ref_logprobs=ref_logprobs, has_entropy=True,
                     clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip, kl_coef=kl_coef,
                     kl_estimator=kl_estimator, entropy_coef=entropy_coef, agg=agg, num_tokens=num_tokens)
    if (sampler_logprobs is None) != (rollout_is_cap is None):
        raise ValueError("sampler_logprobs and rollout_is_cap go together: give both or neither")
    if sampler_logprobs is not None:
        checks.check_token_tensor(sampler_logprobs, "sampler_logprobs", labels, "labels")
        sampler_logprobs = checks.as_tokens(sampler_logprobs.detach())
        rollout_is_cap = checks.check_number(rollout_is_cap, "rollout_is_cap", above=1)
    loss, stats, logprobs = linear_ppo_loss(args.hidden, weight, bias, args.labels, args.temperature,
                                            args.inv_temperature, _IGNORE, spec, sampler_logprobs,
                                            rollout_is_cap or 0.0, args.chunk_size, args.backend)
    if return_logprobs:
        return loss, spec.named(stats), logprobs.view(labels.shape)
    return loss, spec.named(stats)
