"""OpenRLHF's PPO helpers with OpenRLHF's signatures and semantics, backed by fastppo's kernels.

Mirrors ``openrlhf.models.utils`` (``log_probs_from_logits``, ``compute_approx_kl``),
``openrlhf.models.loss.PolicyLoss`` and the experience maker's ``get_advantages_and_returns``
(OpenRLHF 0.5-0.8). Importing this module does not import OpenRLHF.

Where OpenRLHF's semantics differ from fastppo's, these reproduce OpenRLHF's:

* GAE zeroes values and rewards at masked positions and runs the recurrence straight through
  them (a hole is a zero-valued step, not skipped as in :func:`fastppo.gae`); advantages and
  returns come out at every position.
* ``compute_approx_kl`` clamps every estimator's result to [-10, 10].
* Masked means divide by the mask's sum, so an all-masked batch gives NaN (fastppo gives 0), and
  with ``token_level_loss=False`` a row with no valid token makes the loss NaN.

Two deliberate differences: ``log_probs_from_logits`` does not divide ``logits`` in place by the
temperature (OpenRLHF does, to save memory; the returned values are the same), and the policy
loss clamps log-ratios to [-20, 20] before ``exp`` (OpenRLHF's ratio overflows to inf there).
"""

import torch
from torch import Tensor, nn

from ..ops.gae import gae
from ..ops.kl import kl_penalty
from ..ops.ppo_loss import ppo_policy_loss
from ..ops.token_logprobs import token_logprobs
from ._nan import nan_unless


def log_probs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)[labels]`` in the logits' dtype, computed in fp32."""
    return token_logprobs(logits, labels, temperature=temperature).to(logits.dtype)


def compute_approx_kl(log_probs: Tensor, log_probs_base: Tensor, kl_estimator: str = "k1") -> Tensor:
    """OpenRLHF's per-token KL estimate (k1, k2 or k3), fp32, clamped to [-10, 10]."""
    if kl_estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"kl_estimator must be k1, k2 or k3, got {kl_estimator!r}")
    return kl_penalty(log_probs, log_probs_base, kl_estimator).clamp(-10.0, 10.0)


def get_advantages_and_returns(values: Tensor, rewards: Tensor, action_mask: Tensor, gamma: float,
                               lambd: float) -> tuple:
    """OpenRLHF's GAE: ``(advantages, returns)``, ``(B, T)`` fp32, one kernel launch."""
    if action_mask is not None:
        values, rewards = action_mask * values, action_mask * rewards
    every_step = torch.ones(values.shape, dtype=torch.bool, device=values.device)
    advantages, returns = gae(rewards, values, every_step, gamma=float(gamma), lam=float(lambd))
    return advantages.detach(), returns


class PolicyLoss(nn.Module):
    """OpenRLHF's PPO policy loss (``policy_loss_type="ppo"``) on fastppo's fused kernel.

    ``forward(log_probs, old_log_probs, advantages, action_mask=None)`` returns
    ``(loss, clip_ratio, ppo_kl)``.
    """

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: float = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo") -> None:
        super().__init__()
        if policy_loss_type != "ppo":
            raise ValueError(f"fastppo reproduces policy_loss_type='ppo' only, got {policy_loss_type!r}")
        if dual_clip is not None and dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
        self.clip_eps_low, self.clip_eps_high, self.dual_clip = clip_eps_low, clip_eps_high, dual_clip
        self.token_level_loss = token_level_loss

    def forward(self, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, action_mask: Tensor = None):
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask
        loss, stats = ppo_policy_loss(log_probs, old_log_probs, advantages, mask, clip_eps=self.clip_eps_low,
                                      clip_eps_high=self.clip_eps_high, dual_clip=self.dual_clip,
                                      agg="token-mean" if self.token_level_loss else "seq-mean-token-mean")
        count = mask.sum()
        poison = nan_unless(count > 0)
        if not self.token_level_loss:
            poison = poison + nan_unless((mask.sum(dim=-1) > 0).all())
        log_ratio = (log_probs - old_log_probs).detach().float()
        ppo_kl = (torch.where(mask.bool(), -log_ratio, 0.0) * mask).sum() / count
        return loss + poison, stats["clipfrac"] + nan_unless(count > 0), ppo_kl
