"""What turns scores into advantages, beside GAE: whitening, group baselines, KL-shaped rewards.

These are a handful of reductions each, memory-light and already one or two kernels in PyTorch,
so they are plain PyTorch (no Triton) and never synchronise with the device.
"""

from typing import Optional

import torch
from torch import Tensor

from . import checks
from .kl import kl_penalty

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_baseline")


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    group: Optional["torch.distributed.ProcessGroup"] = None,
) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the valid entries; 0 at masked entries.

    The mean and the unbiased variance are taken over entries where ``mask`` is true; with a
    ``torch.distributed`` process group as ``group`` they are global across its ranks (one
    all-reduce of the sum, the sum of squares and the count, accumulated in float64).
    ``shift_mean=False`` adds the mean back (PPO whitens rewards that way). One valid entry, or
    none, gives zeros, never NaN. Masked entries may hold anything; a NaN at a valid entry (or a
    mask value other than 0/1) makes every valid entry NaN. Returns fp32 of ``x``'s shape.
    """
    checks.check_floating(x, "x")
    eps = checks.check_number(eps, "eps", minimum=0.0)
    valid, invalid = checks.check_mask(mask, x, "x")
    x = checks.poison(x.detach(), invalid)
    xs = torch.where(valid, x.double(), 0.0)
    stats = torch.stack([xs.sum(), (xs * xs).sum(), valid.sum().double()])  # (3,) sum, sum sq, count
    if group is not None:
        torch.distributed.all_reduce(stats, group=group)
    total, total_sq, count = stats.unbind()
    mean = total / count.clamp(min=1.0)
    var = ((total_sq - count * mean * mean) / (count - 1.0).clamp(min=1.0)).clamp(min=0.0)
    # Only the statistics need float64. The result is fp32 arithmetic, with the mean split in a
    # high and a low fp32 part: x - high is exact for x near the mean (Sterbenz), so a large
    # offset (x ~ 1e4 +- 1) loses nothing, and no float64 copy of x is made.
    high = mean.float()
    low = (mean - high.double()).float()
    whitened = ((x.detach().float() - high) - low) * torch.rsqrt(var + eps).float()
    if not shift_mean:
        whitened = whitened + high + low
    return torch.where(valid, whitened, 0.0)


def group_advantages(scores: Tensor, group_size: int, *, estimator: str = "grpo", eps: float = 1e-6) -> Tensor:
    """Critic-free advantages from sequence scores, with a baseline from each prompt's group.

    ``scores`` is ``(B,)``, made of consecutive groups of ``group_size`` samples of one prompt.
    With the group's mean and (unbiased) std:

    * ``grpo``: ``(s - mean) / (std + eps)`` (a group of one gives 0);
    * ``dr_grpo``: ``s - mean`` (no std normalisation, as Dr. GRPO argues);
    * ``rloo``: ``s - mean of the other samples`` (needs ``group_size >= 2``);
    * ``reinforce_baseline``: ``s - mean``, meant to be whitened over the whole batch afterwards
      (REINFORCE++ with baseline); the whitening is :func:`masked_whiten`'s job.

    Returns fp32 ``(B,)``.
    """
    checks.check_tensor(scores, "scores")
    if scores.dim() != 1 or not scores.is_floating_point():
        raise ValueError(
            f"scores must be a 1-D floating tensor, got shape {tuple(scores.shape)} and dtype {scores.dtype}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if scores.numel() % group_size:
        raise ValueError(f"scores has {scores.numel()} entries, not a multiple of group_size={group_size}")
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"estimator must be one of {GROUP_ESTIMATORS}, got {estimator!r}")
    eps = checks.check_number(eps, "eps", minimum=0.0)
    if estimator == "rloo" and group_size < 2:
        raise ValueError("estimator='rloo' needs group_size >= 2: a sample has no others to compare with")

    s = scores.float().view(-1, group_size)  # (prompts, G)
    mean = s.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        std = s.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        adv = (s - mean) / (std + eps)
    elif estimator == "rloo":
        adv = s - (s.sum(dim=1, keepdim=True) - s) / (group_size - 1)
    else:
        adv = s - mean
    return adv.view(-1)


def token_rewards(
    scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, *, kl_coef: float, kl_estimator: str = "k1"
) -> Tensor:
    """Per-token PPO rewards with the KL penalty in the reward.

    ``-kl_coef * kl(logprobs, ref_logprobs)`` at every valid token (see :func:`kl_penalty`), plus
    the sequence's score at its last valid token. ``scores`` is ``(B,)``; the others ``(B, T)``.
    A row with no valid token gets no reward at all. Returns fp32 ``(B, T)``, 0 where masked
    whatever the inputs hold there; NaN at a valid position (or a mask value other than 0/1)
    stays NaN.
    """
    for name, x in (("scores", scores), ("logprobs", logprobs), ("ref_logprobs", ref_logprobs)):
        checks.check_floating(x, name)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must have shape (B, T), got {tuple(logprobs.shape)}")
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"scores must have shape ({logprobs.shape[0]},), got {tuple(scores.shape)}")
    valid, invalid = checks.check_mask(mask, logprobs, "logprobs")
    checks.check_same_device(logprobs.device, "logprobs", scores=scores, ref_logprobs=ref_logprobs)
    kl_coef = checks.check_number(kl_coef, "kl_coef")
    # masked positions may hold NaN: select them away before the KL, whose gradient would be NaN
    logprobs, ref_logprobs = (checks.poison(torch.where(valid, x, 0.0), invalid) for x in (logprobs, ref_logprobs))
    rewards = torch.where(valid, -kl_coef * kl_penalty(logprobs, ref_logprobs, kl_estimator), 0.0)
    T = logprobs.shape[1]
    last = T - 1 - valid.flip(-1).int().argmax(dim=-1)  # (B,) last valid position (T-1 if none)
    bonus = torch.where(valid.any(dim=-1), scores.float(), 0.0)  # (B,)
    return rewards.scatter_add(1, last.unsqueeze(1), bonus.unsqueeze(1))
