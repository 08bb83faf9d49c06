"""Truncated importance weights that correct for a sampler computing in another precision.

The sampler decodes on a bf16 copy of the policy while the update recomputes log-probs on the
fp32 master weights, so the tokens come from a slightly different distribution than the one PPO's
ratio assumes. Truncated importance sampling (Yao et al., "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training", 2025; offered by verl, TRL and OpenRLHF) reweights each
token's policy-gradient term by ``min(pi_old / pi_sampler, cap)``.

Because the weight is positive, scaling the PPO term by it is the same as scaling the token's
advantage: ``w * max(-A r, -A clip(r)) = max(-(wA) r, -(wA) clip(r))`` and likewise for the dual
clip, so the loss kernels need no extra input: the weights multiply the advantages (inside
``ppo_loss_from_hidden`` when it is given ``sampler_logprobs``, where the old log-probs may be the
pass's own).
"""

import torch
from torch import Tensor

from . import checks


def rollout_is_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float) -> Tensor:
    """``min(exp(old_logprobs - sampler_logprobs), cap)`` per valid token, 0 where masked; fp32.

    The log-ratio is clamped to [-20, 20] before the exponential (as the PPO ratio is); a NaN at
    a valid position stays NaN. Masked positions may hold anything. Not differentiable: both
    inputs are constants of the update.
    """
    checks.check_floating(old_logprobs, "old_logprobs")
    checks.check_token_tensor(sampler_logprobs, "sampler_logprobs", old_logprobs, "old_logprobs")
    cap = checks.check_number(cap, "cap", above=1)
    valid, invalid = checks.check_mask(mask, old_logprobs, "old_logprobs")
    return checks.poison(rollout_is_weights_unchecked(old_logprobs, sampler_logprobs, valid, cap), invalid)


def rollout_is_weights_unchecked(old_logprobs: Tensor, sampler_logprobs: Tensor, valid: Tensor, cap: float) -> Tensor:
    """The weights of checked arguments (``valid`` bool); also used inside the fused loss."""
    log_ratio = (old_logprobs.detach().float() - sampler_logprobs.detach().float()).clamp(-20.0, 20.0)
    return torch.where(valid, log_ratio.exp().clamp(max=cap), 0.0)  # NaN survives clamp and exp
