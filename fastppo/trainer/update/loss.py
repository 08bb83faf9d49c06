"""One minibatch's loss: the fused PPO loss from the policy's hidden states (or GSPO's sequence
loss), plus the critic's value loss; and one optimizer step's statistics from its minibatches'.

Normalisers are the whole step's, over every minibatch accumulated into it and every rank: the
value loss and token-mean divide by the step's valid tokens, so each token weighs the same as it
would in one big batch on one rank; the sequence modes are rescaled from the minibatch's own
normaliser to the step's.
"""

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...ops import ppo_loss_from_hidden, rollout_is_weights, sequence_ppo_loss, token_logprobs_from_hidden, value_loss
from ...ops.aggregation import denominator
from .batch import Batch, head_params, response_hidden, response_labels, response_values

if TYPE_CHECKING:  # for the annotations only
    from ..configuration.config import TrainConfig
    from ..parallel.distributed import Ranks


def minibatch_loss(
    mb: Batch, models, config: "TrainConfig", kl_coef: float, tokens: Tensor, on_policy: bool, whole: Tensor = None
) -> tuple:
    """``(loss, stats)`` of minibatch ``mb``. ``tokens``: the step's valid tokens (over every
    minibatch and rank); ``whole``: the step's :func:`~fastppo.ops.aggregation.denominator` of
    the aggregation (default: ``tokens`` for token-mean, else the minibatch's own).
    ``on_policy``: the old log-probs are this forward's own, detached, and are written into ``mb``.
    With ``rollout_is_cap`` (the config's, which stale tokens turn on) each token's policy-gradient
    term is weighted by the truncated importance weight of old over sampler log-probs: with
    ``max_staleness`` this is decoupled PPO, the ratio clipped against the policy at the update's
    start and the weight correcting from the weights that drew the token to it."""
    c, agg, a = config, config.agg, config.algo
    kl_in_loss = not c.estimator.kl_in_reward and mb.ref_logprobs is not None
    kl = dict(
        ref_logprobs=mb.ref_logprobs if kl_in_loss else None,
        kl_coef=kl_coef if kl_in_loss else 0.0,
        kl_estimator=a.kl_estimator,
    )
    if whole is None:
        whole = tokens if agg == "token-mean" else denominator(mb.mask, agg, c.rollout.max_new_tokens)
    cap = c.rollout_is_cap
    layout = mb.layout(models.shared_prefix)
    if a.sequence_ratio and not on_policy:  # on-policy every sequence ratio is 1: GSPO is the token loss
        loss, stats = sequence_loss(mb, layout, models, config, kl)
    else:
        with models.precision.autocast():
            hidden = response_hidden(models.policy, layout)  # (B, R, H)
        weight, bias = head_params(models.policy, hidden)
        loss, stats, old = ppo_loss_from_hidden(
            hidden,
            weight,
            mb.response_ids,
            None if on_policy else mb.old_logprobs,
            mb.advantages,
            mb.mask,
            bias=bias,
            temperature=c.rollout.temperature,
            clip_eps=a.clip_eps,
            clip_eps_high=a.clip_eps_high,
            dual_clip=a.dual_clip,
            entropy_coef=a.entropy_coef,
            agg=agg,
            num_tokens=whole if agg == "token-mean" else None,
            return_logprobs=True,
            sampler_logprobs=None if cap is None else mb.sampler_logprobs,
            rollout_is_cap=cap,
            **kl,
        )
        if on_policy:
            mb.old_logprobs = old
    if cap is not None:  # the weights the loss applied, for the logs
        weights = rollout_is_weights(mb.old_logprobs, mb.sampler_logprobs, mb.mask, cap)
        count = mb.mask.sum().clamp(min=1)
        stats.update(
            rollout_is_weight=weights.sum() / count, rollout_is_capped=((weights >= cap) & mb.mask).sum() / count
        )
    if agg != "token-mean":  # from the minibatch's own normaliser to the step's
        loss = loss * (denominator(mb.mask, agg).clamp(min=1.0) / whole.clamp(min=1.0))
    if models.critic is not None:
        with models.precision.autocast():
            values = response_values(models.critic, layout)
        vf, vf_stats = value_loss(values, mb.values, mb.returns, mb.mask, clip_eps=a.vf_clip, num_tokens=tokens)
        loss = loss + a.vf_coef * vf
        stats.update(vf_stats)
    return loss, stats


def sequence_loss(mb: Batch, layout, models, config: "TrainConfig", kl: dict) -> tuple:
    """GSPO's loss off-policy: each response's token log-probs from the fused op from hidden
    states, then :func:`~fastppo.ops.sequence_ppo_loss` over them, a mean over the responses."""
    a = config.algo
    with models.precision.autocast():
        hidden = response_hidden(models.policy, layout)  # (B, R, H)
    weight, bias = head_params(models.policy, hidden)
    logp, entropy = token_logprobs_from_hidden(
        hidden, weight, response_labels(mb), bias=bias, temperature=config.rollout.temperature, return_entropy=True
    )
    per_row = mb.advantages.sum(1) / mb.mask.sum(1).clamp(min=1)  # (B,) the group advantage each token holds
    return sequence_ppo_loss(
        logp,
        mb.old_logprobs,
        per_row,
        mb.mask,
        clip_eps=a.clip_eps,
        clip_eps_high=a.clip_eps_high,
        entropy=entropy,
        entropy_coef=a.entropy_coef,
        **kl,
    )


def step_normalisers(group: list, config: "TrainConfig", ranks: "Ranks") -> tuple:
    """``(tokens, whole)`` of an optimizer step's minibatches ``group``, over every rank: its valid
    tokens, and the :func:`~fastppo.ops.aggregation.denominator` of the run's aggregation (the
    tokens for token-mean, else its rows' normaliser)."""
    tokens = ranks.sum(sum(mb.mask.sum() for mb in group))
    if config.agg == "token-mean":
        return tokens, tokens
    return tokens, ranks.sum(sum(denominator(mb.mask, config.agg, config.rollout.max_new_tokens) for mb in group))


def step_stats(parts: list, agg: str, ranks: "Ranks") -> dict:
    """One optimizer step's statistics from its minibatches' (``parts``, on every rank). A loss
    term normalised by the step's tokens (the value loss always; the policy's pg_loss, kl and
    entropy under token-mean) comes as each minibatch's share of the step's mean, so those are
    summed over minibatches and ranks; the others (fractions, ratios) are each minibatch's own
    means, averaged."""
    shares = ["vf_loss"] + (["pg_loss", "kl", "entropy"] if agg == "token-mean" else [])
    shares = [k for k in shares if k in parts[0]]
    summed = ranks.sum(torch.stack([sum(part[k] for part in parts).float() for k in shares])) if shares else []
    means = {k: float(sum(part[k] for part in parts)) / len(parts) for k in parts[0] if k not in shares}
    return {**means, **{k: float(v) for k, v in zip(shares, summed)}}
