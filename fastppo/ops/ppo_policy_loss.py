"""``ppo_policy_loss``: the clipped PPO objective with KL and entropy terms, in one kernel.

A custom op (fake implementation and autograd registered, no host sync): the forward kernel
reads each token tensor once and writes both the partial sums of the loss and its statistics
and the per-token gradient, which it can because the aggregation is a fixed weight per token
(see ``aggregation.py``). The backward is then one multiply by the upstream scalar.

Gradients flow to ``logprobs`` and ``entropy``; ``old_logprobs``, ``advantages`` and
``ref_logprobs`` are constants of the update, as in PPO.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..kernels.contract import PARTIALS, LossTerms
from . import checks
from .aggregation import aggregation_weights
from .custom_ops import gradients, input_names
from .dispatch import implementation, resolve_backend
from .kl import KL_ESTIMATORS

# The statistics vector the op returns, in order.
STATS = ("pg_loss", "kl", "entropy", "clipfrac", "approx_kl", "ratio_mean", "ratio_max", "dual_clipfrac")


@torch.library.custom_op("fastppo::ppo_policy_loss", mutates_args=())
def _ppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    weights: Tensor,
    valid: Tensor,
    ref_logprobs: Optional[Tensor],
    entropy: Optional[Tensor],
    terms: list[float],
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    # token tensors: (N,) contiguous; terms: a LossTerms
    # -> loss (), stats (len(STATS),), d loss / d logprobs (N,) fp32
    impl, terms = implementation(backend, "ppo_policy_loss"), LossTerms.from_floats(terms)
    N = logprobs.numel()
    grad = torch.empty(N, dtype=torch.float32, device=logprobs.device)
    partials = torch.zeros(impl.num_programs(N), len(PARTIALS), dtype=torch.float32, device=logprobs.device)
    impl.ppo_loss_forward(
        logprobs, old_logprobs, advantages, weights, valid, ref_logprobs, entropy, terms, grad, partials
    )
    return (*summarize(partials, terms), grad)


def summarize(partials: Tensor, terms: LossTerms) -> tuple:
    """``(loss (), stats (len(STATS),))`` from the kernels' partial sums ``(P, len(PARTIALS))``."""
    p = dict(zip(PARTIALS, partials.sum(dim=0).unbind()))
    count = p["count"].clamp(min=1.0)
    loss = p["pg"] + terms.kl_coef * p["kl"] - terms.entropy_coef * p["entropy"]
    stats = torch.stack(
        [
            p["pg"],
            p["kl"],
            p["entropy"],
            p["clipped"] / count,
            p["half_lr_sq"] / count,
            p["ratio"] / count,
            partials[:, PARTIALS.index("ratio_max")].max(),
            p["dual_clipped"] / count,
        ]
    )
    return loss, stats


@_ppo_loss.register_fake
def _(logprobs, *_):
    f32 = dict(dtype=torch.float32)
    return (
        logprobs.new_empty((), **f32),
        logprobs.new_empty(len(STATS), **f32),
        logprobs.new_empty(logprobs.shape[0], **f32),
    )


# _ppo_loss's input names in order (autograd hands the inputs over as a tuple), from its schema
_INPUTS = input_names(torch.ops.fastppo.ppo_policy_loss.default)


def _setup_context(ctx, inputs, output):
    named = dict(zip(_INPUTS, inputs))
    _, stats, grad = output
    ctx.mark_non_differentiable(stats, grad)
    ctx.save_for_backward(grad, named["weights"] if named["entropy"] is not None else None)
    ctx.logprobs_dtype = named["logprobs"].dtype
    ctx.entropy_coef = LossTerms.from_floats(named["terms"]).entropy_coef


def _backward(ctx, grad_loss, _grad_stats, _grad_grad):
    grad, weights = ctx.saved_tensors
    needs = dict(zip(_INPUTS, ctx.needs_input_grad))
    grad_logprobs = (grad_loss * grad).to(ctx.logprobs_dtype) if needs["logprobs"] else None
    grad_entropy = None
    if needs["entropy"] and ctx.entropy_coef != 0:
        grad_entropy = -ctx.entropy_coef * grad_loss * weights
    return gradients(_INPUTS, logprobs=grad_logprobs, entropy=grad_entropy)


torch.library.register_autograd(_ppo_loss, _backward, setup_context=_setup_context)


@dataclass
class LossSpec:
    """A PPO loss's validated arguments, flattened to ``(N,)`` token tensors for the kernels."""

    old_logprobs: Optional[Tensor]  # None: on-policy, the pass's own (ppo_loss_from_hidden only)
    advantages: Tensor
    weights: Tensor  # fp32 aggregation weight per token
    valid: Tensor  # bool
    ref_logprobs: Optional[Tensor]
    terms: LossTerms
    stat_names: list  # the entries of STATS this call reports

    def named(self, stats: Tensor) -> dict:
        every = dict(zip(STATS, stats.unbind()))
        return {name: every[name] for name in self.stat_names}


def loss_spec(
    like: Tensor,
    like_name: str,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    has_entropy: bool,
    ref_logprobs: Optional[Tensor] = None,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    agg: str = "token-mean",
    num_tokens=None,
) -> LossSpec:
    """Check the loss options (those of :func:`ppo_policy_loss`, whose defaults these are) against the
    token shape of ``like`` and flatten them."""
    checks.check_tensor(advantages, "advantages")
    for name, x in (("old_logprobs", old_logprobs), ("advantages", advantages), ("ref_logprobs", ref_logprobs)):
        if x is not None:
            checks.check_token_tensor(x, name, like, like_name)
    valid, invalid = checks.check_mask(mask, like, like_name)
    clip_low, clip_high, kl_coef, entropy_coef = checks.check_coefficients(
        clip_eps, clip_eps_high, kl_coef, entropy_coef
    )
    dual = 0.0 if dual_clip is None else checks.check_number(dual_clip, "dual_clip", above=1.0)
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if kl_coef != 0 and ref_logprobs is None:
        raise ValueError("kl_coef is nonzero but no ref_logprobs were given")
    if entropy_coef != 0 and not has_entropy:
        raise ValueError("entropy_coef is nonzero but no entropy was given")
    stat_names = ["pg_loss", "clipfrac", "approx_kl", "ratio_mean", "ratio_max"]
    stat_names += ["kl"] * (ref_logprobs is not None) + ["entropy"] * has_entropy
    stat_names += ["dual_clipfrac"] * (dual_clip is not None)
    weights = checks.poison(aggregation_weights(valid, agg, num_tokens), invalid)  # NaN where mask is not 0/1
    return LossSpec(
        old_logprobs=None if old_logprobs is None else checks.as_tokens(old_logprobs.detach()),
        advantages=checks.as_tokens(advantages.detach()),
        weights=checks.as_tokens(weights),
        valid=checks.as_tokens(valid),
        ref_logprobs=None if ref_logprobs is None else checks.as_tokens(ref_logprobs.detach()),
        terms=LossTerms(clip_low, clip_high, dual, kl_coef, KL_ESTIMATORS.index(kl_estimator) + 1, entropy_coef),
        stat_names=stat_names,
    )


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logprobs: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    agg: str = "token-mean",
    num_tokens=None,
    backend: str = "auto",
) -> tuple[Tensor, dict]:
    """The PPO clipped policy loss, with optional KL-to-reference and entropy terms.

    Per valid token (``mask`` true), in fp32::

        lr    = clamp(logp - old_logp, -20, 20);   ratio = exp(lr)   (NaN stays NaN)
        pg    = max(-A * ratio, -A * clamp(ratio, 1 - clip_eps, 1 + (clip_eps_high or clip_eps)))
        pg    = min(pg, -A * dual_clip)   where A < 0   (dual clip, when dual_clip = c > 1)
        kl    = kl_penalty(logp, ref_logp, kl_estimator)

    ``loss = agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)``, ``agg`` one of
    ``token-mean`` (optionally over ``num_tokens``), ``seq-mean-token-mean``,
    ``seq-mean-token-sum``, ``seq-mean-token-sum-norm`` (see ``fastppo.ops.aggregation``).

    Token tensors share one shape (``(B, T)`` for the ``seq-*`` modes) and may be any views;
    ``mask`` is bool or 0/1. Masked positions may hold anything, NaN included: they change
    neither the loss nor any gradient. A NaN at a valid position, or a mask value other than
    0/1, makes the loss NaN (with ``FASTPPO_CHECK=1`` the mask value is a ``ValueError``).

    Returns ``(loss, stats)``: a 0-dim fp32 loss, differentiable w.r.t. ``logprobs`` and
    ``entropy``, and a dict of detached 0-dim fp32 tensors: ``pg_loss`` (= agg(pg)),
    ``clipfrac`` (fraction of valid tokens where the clipped term won), ``approx_kl`` (token mean
    of lr**2 / 2), ``ratio_mean``, ``ratio_max``, plus ``kl`` (= agg(kl)) with a reference,
    ``entropy`` (= agg(entropy)) when given, ``dual_clipfrac`` with dual clipping.
    """
    checks.check_floating(logprobs, "logprobs")
    checks.check_tensor(old_logprobs, "old_logprobs")
    if entropy is not None:
        checks.check_token_tensor(entropy, "entropy", logprobs, "logprobs")
    spec = loss_spec(
        logprobs,
        "logprobs",
        old_logprobs,
        advantages,
        mask,
        ref_logprobs=ref_logprobs,
        has_entropy=entropy is not None,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        dual_clip=dual_clip,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        agg=agg,
        num_tokens=num_tokens,
    )
    backend = resolve_backend(backend, logprobs.device)
    loss, stats, _ = _ppo_loss(
        checks.as_tokens(logprobs),
        spec.old_logprobs,
        spec.advantages,
        spec.weights,
        spec.valid,
        spec.ref_logprobs,
        None if entropy is None else checks.as_tokens(entropy),
        spec.terms,
        backend,
    )
    return loss, spec.named(stats)
