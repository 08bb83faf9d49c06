"""``ppo_loss_from_logits``: the PPO policy loss straight from logits.

It is ``token_logprobs`` then ``ppo_policy_loss``. Their autograd chain is
already the fused pass structure: the forward reads the logits once (log-prob, entropy, log-sum-
exp) and the loss kernel turns them into per-token gradients; the backward reads the logits once
more and writes their gradient once, with the upstream scalar folded into the per-token
gradients, not applied to an ``(N, V)`` tensor. Two reads and one write, and no fp32 ``(N, V)``
temporary (peers read three times).

``ppo_loss_from_hidden`` (``ppo_loss_from_hidden.py``) is the same loss from hidden states and
the LM head, never building the logits.

Masked positions (``mask`` false) get ``ignore_index`` labels, so whatever they hold (a padding
id, -1) costs nothing and passes no gradient. The mask alone decides which tokens count: at a
valid position the label must be a token id, and -100 there is as out of range as any other
negative id (NaN out; with ``FASTPPO_CHECK=1`` a ``ValueError``), never a silently ignored token
that still counts in the normaliser. The entropy is always computed (it is free in the
log-prob pass) and reported; it carries a gradient only when ``entropy_coef`` is nonzero.
"""

import torch
from torch import Tensor

from . import checks
from .ppo_policy_loss import ppo_policy_loss
from .token_logprobs import token_logprobs


def masked_labels(labels: Tensor, mask: Tensor) -> Tensor:
    """``labels`` with ``IGNORE_INDEX`` where ``mask`` is off, and where it is on a label of
    ``IGNORE_INDEX`` made an out-of-range id like any other (the mask decides; see above)."""
    checks.check_integer(labels, "labels")  # before torch.where would promote bool labels to ids 0/1
    valid, _ = checks.check_mask(mask, labels, "labels")
    claimed = labels == checks.IGNORE_INDEX
    if checks.value_checks_enabled() and bool((claimed & valid).any()):
        raise ValueError(
            f"labels holds {checks.IGNORE_INDEX} (ignore_index) at {int((claimed & valid).sum())} position(s) "
            "the mask says are valid; the mask decides which tokens count: mask them out or give "
            "their token ids"
        )
    return torch.where(valid, labels.masked_fill(claimed, -1), checks.IGNORE_INDEX)


def check_no_entropy(loss_options: dict, name: str) -> None:
    """The losses that compute the entropy themselves refuse one passed in."""
    if "entropy" in loss_options:
        raise TypeError(f"{name} computes the entropy itself; do not pass entropy=")


def ppo_loss_from_logits(
    logits: Tensor,
    labels: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    temperature=1.0,
    inplace_backward: bool = False,
    backend: str = "auto",
    **loss_options,
) -> tuple[Tensor, dict]:
    """:func:`fastppo.ppo_policy_loss` of the labels' log-probs under ``softmax(logits / temperature)``.

    ``logits`` ``(..., V)`` and ``labels`` ``(...)`` as in :func:`fastppo.token_logprobs`; the
    token tensors have the labels' shape. ``inplace_backward`` as in :func:`fastppo.token_logprobs`:
    the backward writes the logits' gradient over them. ``loss_options`` are the keyword arguments of
    :func:`fastppo.ppo_policy_loss` (``clip_eps``, ``kl_coef``, ``ref_logprobs``, ``agg``, ...),
    except ``entropy``, which is computed here.
    """
    check_no_entropy(loss_options, "ppo_loss_from_logits")
    logp, entropy = token_logprobs(
        logits,
        masked_labels(labels, mask),
        temperature=temperature,
        ignore_index=checks.IGNORE_INDEX,
        return_entropy=True,
        inplace_backward=inplace_backward,
        backend=backend,
    )
    return ppo_policy_loss(logp, old_logprobs, advantages, mask, entropy=entropy, backend=backend, **loss_options)
