"""The PPO policy loss straight from logits or from hidden states.

``ppo_loss_from_logits`` = ``token_logprobs`` then ``ppo_policy_loss``. Their autograd chain is
already the fused pass structure: the forward reads the logits once (log-prob, entropy, log-sum-
exp) and the loss kernel turns them into per-token gradients; the backward reads the logits once
more and writes their gradient once, with the upstream scalar folded into the per-token
gradients, not applied to an ``(N, V)`` tensor. Two reads and one write, and no fp32 ``(N, V)``
temporary (peers read three times).

``ppo_loss_from_hidden`` = ``linear_token_logprobs`` then ``ppo_policy_loss``: chunked, so the
full logits never exist, forward or backward.

Masked positions (``mask`` false) get ``ignore_index`` labels, so whatever they hold (a padding
id, -1) costs nothing and passes no gradient. The entropy is always computed (it is free in the
log-prob pass) and reported; it carries a gradient only when ``entropy_coef`` is nonzero.
"""

from typing import Optional

import torch
from torch import Tensor

from . import checks
from .linear_token_logprobs import linear_token_logprobs
from .ppo_loss import ppo_policy_loss
from .token_logprobs import token_logprobs

_IGNORE = -100


def _masked_labels(labels: Tensor, mask: Tensor) -> Tensor:
    checks.check_tensor(mask, "mask")
    if mask.shape != labels.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but labels has {tuple(labels.shape)}")
    return torch.where(mask != 0, labels, _IGNORE)


def _check_no_entropy(loss_options: dict, name: str) -> None:
    if "entropy" in loss_options:
        raise TypeError(f"{name} computes the entropy itself; do not pass entropy=")


def ppo_loss_from_logits(logits: Tensor, labels: Tensor, old_logprobs: Tensor, advantages: Tensor,
                         mask: Tensor, *, temperature=1.0, backend: str = "auto",
                         **loss_options) -> tuple[Tensor, dict]:
    """:func:`fastppo.ppo_policy_loss` of the labels' log-probs under ``softmax(logits / temperature)``.

    ``logits`` ``(..., V)`` and ``labels`` ``(...)`` as in :func:`fastppo.token_logprobs`; the
    token tensors have the labels' shape. ``loss_options`` are the keyword arguments of
    :func:`fastppo.ppo_policy_loss` (``clip_eps``, ``kl_coef``, ``ref_logprobs``, ``agg``, ...),
    except ``entropy``, which is computed here.
    """
    _check_no_entropy(loss_options, "ppo_loss_from_logits")
    checks.check_tensor(labels, "labels")
    logp, entropy = token_logprobs(logits, _masked_labels(labels, mask), temperature=temperature,
                                   ignore_index=_IGNORE, return_entropy=True, backend=backend)
    return ppo_policy_loss(logp, old_logprobs, advantages, mask, entropy=entropy, backend=backend, **loss_options)


def ppo_loss_from_hidden(hidden: Tensor, weight: Tensor, labels: Tensor, old_logprobs: Tensor, advantages: Tensor,
                         mask: Tensor, *, bias: Optional[Tensor] = None, temperature=1.0,
                         chunk_size: Optional[int] = None, backend: str = "auto",
                         **loss_options) -> tuple[Tensor, dict]:
    """:func:`ppo_loss_from_logits` of ``hidden @ weight.T + bias``, never building the logits.

    ``hidden`` ``(..., H)``, ``weight`` ``(V, H)``, ``bias`` and ``chunk_size`` as in
    :func:`fastppo.linear_token_logprobs`. Gradients reach ``hidden``, ``weight`` and ``bias``.
    """
    _check_no_entropy(loss_options, "ppo_loss_from_hidden")
    checks.check_tensor(labels, "labels")
    logp, entropy = linear_token_logprobs(hidden, weight, _masked_labels(labels, mask), bias=bias,
                                          temperature=temperature, ignore_index=_IGNORE, return_entropy=True,
                                          chunk_size=chunk_size, backend=backend)
    return ppo_policy_loss(logp, old_logprobs, advantages, mask, entropy=entropy, backend=backend, **loss_options)
