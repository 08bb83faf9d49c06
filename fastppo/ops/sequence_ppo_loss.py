"""``sequence_ppo_loss``: GSPO's clipped objective, one importance ratio per sequence.

GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization") replaces PPO's per-token ratio
with the geometric mean of a sequence's token ratios, ``s_i = exp(mean_t (logp - old_logp))``,
and clips it per sequence: ``loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps, 1 + eps_high))``,
averaged over the sequences with a valid token. Its gradient reaches every token of a sequence
as ``-A_i s_i / |y_i|`` (zero when the clip is active), so it needs the whole sequence's
log-probs first: a cross-token reduction the chunked kernels, which see rows of tokens, do not
have. It is therefore plain PyTorch over token log-probs (from ``token_logprobs_from_hidden``), a few
reductions over ``(B, T)``. On-policy (the first step after a rollout) every ``s_i`` is exactly 1
and the gradient is ``-A_i / |y_i|`` per token, which is ``ppo_loss_from_hidden`` with
``agg="seq-mean-token-mean"``: the trainer takes that fused path there.

The KL and entropy terms are token-level, aggregated the same way (a mean over sequences of each
sequence's token mean). Masked positions may hold anything (NaN included) and get a zero
gradient; a NaN at a valid position gives a NaN loss. A sequence log-ratio beyond +-20 is
clamped there, as the token loss clamps each token's, with zero gradient.
"""

from typing import Optional

import torch
from torch import Tensor

from . import checks
from .kl import kl_penalty

LOG_RATIO_BOUND = 20.0  # the token loss's (ppo_policy_loss_torch.py, kernels/ppo_policy_loss.py)


def sequence_ppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 3e-4,
    clip_eps_high: Optional[float] = None,
    ref_logprobs: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Optional[Tensor] = None,
    entropy_coef: float = 0.0,
) -> tuple:
    """GSPO's policy loss and its statistics.

    Args:
        logprobs: ``(B, T)`` log-probs of the response tokens under the policy (differentiable).
        old_logprobs: ``(B, T)``, the sampling policy's; ``mask`` ``(B, T)`` bool or 0/1.
        advantages: ``(B,)``, one per sequence (GRPO's group advantages, say).
        clip_eps, clip_eps_high: the sequence ratio is clipped to ``[1 - clip_eps, 1 +
            clip_eps_high]`` (``clip_eps_high`` defaults to ``clip_eps``); GSPO's paper uses
            3e-4 and 4e-4, the sequence ratio being much closer to 1 than a token's.
        ref_logprobs, kl_coef, kl_estimator: a KL-to-reference term (:func:`fastppo.kl_penalty`).
        entropy, entropy_coef: an entropy bonus from ``(B, T)`` entropies.

    Returns:
        ``(loss, stats)``: an fp32 scalar, and 0-dim tensors ``pg_loss``, ``clipfrac`` (the share
        of sequences whose clip is active), ``approx_kl`` (half the mean squared token log-ratio),
        ``ratio_mean``, ``ratio_max`` (of the sequence ratios), and ``kl`` / ``entropy`` when given.
    """
    checks.check_floating(logprobs, "logprobs")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    checks.check_token_tensor(old_logprobs, "old_logprobs", logprobs, "logprobs")
    valid, invalid = checks.check_mask(mask, logprobs, "logprobs")
    checks.check_tensor(advantages, "advantages")
    if advantages.shape != logprobs.shape[:1] or not advantages.is_floating_point():
        raise ValueError(
            f"advantages must be a floating (B,) = {tuple(logprobs.shape[:1])} tensor, one per "
            f"sequence, got shape {tuple(advantages.shape)} and dtype {advantages.dtype}"
        )
    clip_low, clip_high, kl_coef, entropy_coef = checks.check_coefficients(
        clip_eps, clip_eps_high, kl_coef, entropy_coef
    )
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")

    logp = checks.poison(logprobs.float(), invalid)  # NaN where the mask is not 0/1
    tokens = valid.sum(dim=1)  # (B,)
    rows = tokens > 0
    sequences = rows.sum().clamp(min=1)

    def sequence_mean(x: Tensor) -> Tensor:  # (B, T) -> (B,), each valid row's token mean
        return torch.where(valid, x, 0.0).sum(dim=1) / tokens.clamp(min=1)

    log_ratio = torch.where(valid, logp - old_logprobs.detach().float(), 0.0)  # (B, T)
    # clamped as the token loss clamps its log-ratio: beyond +-20 the ratio stays finite and the
    # gradient is 0, where exp would overflow to inf (and the loss to inf or NaN) above ~88
    ratio = torch.exp(sequence_mean(log_ratio).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # (B,)
    adv = advantages.detach().float()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.where(rows, torch.maximum(unclipped, clipped), 0.0).sum() / sequences
    loss = pg
    stats = {
        "pg_loss": pg.detach(),
        "clipfrac": ((clipped > unclipped) & rows).sum() / sequences,
        "approx_kl": 0.5 * torch.where(valid, log_ratio.detach() ** 2, 0.0).sum() / tokens.sum().clamp(min=1),
        "ratio_mean": torch.where(rows, ratio.detach(), 0.0).sum() / sequences,
        "ratio_max": torch.where(rows, ratio.detach(), 0.0).max() if ratio.numel() else ratio.new_zeros(()),
    }
    if ref_logprobs is not None:
        checks.check_token_tensor(ref_logprobs, "ref_logprobs", logprobs, "logprobs")
        kl_tokens = kl_penalty(
            torch.where(valid, logp, 0.0), torch.where(valid, ref_logprobs.float(), 0.0), estimator=kl_estimator
        )
        kl = torch.where(rows, sequence_mean(kl_tokens), 0.0).sum() / sequences
        loss = loss + kl_coef * kl
        stats["kl"] = kl.detach()
    if entropy is not None:
        checks.check_token_tensor(entropy, "entropy", logprobs, "logprobs")
        mean_entropy = torch.where(rows, sequence_mean(entropy.float()), 0.0).sum() / sequences
        loss = loss - entropy_coef * mean_entropy
        stats["entropy"] = mean_entropy.detach()
    return loss, stats
