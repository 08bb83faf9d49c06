"""OpenRLHF's PPO helpers with OpenRLHF's signatures and semantics, backed by fastppo's kernels.

Supported: OpenRLHF 0.8.0 to 0.11.0, following the installed OpenRLHF (see
``fastppo.integrations.peers``; without it, 0.11). Mirrors ``openrlhf.models.utils``
(``log_probs_from_logits``, ``compute_approx_kl``, ``compute_entropy``, ``masked_mean``),
``openrlhf.models.loss`` (``PolicyLoss``, ``ValueLoss``) and the experience maker's
``get_advantages_and_returns``. ``patch()`` swaps them into the installed OpenRLHF, the
experience maker's method included (build the trainer after it: losses already constructed stay
OpenRLHF's). Importing this module does not import OpenRLHF.

``PolicyLoss`` changed often; by version it follows:

* what ``forward`` returns: the loss (0.8.0-0.8.2), ``(loss, clip_ratio)`` (to 0.8.7),
  ``(..., ppo_kl)`` (0.8.8), ``(..., vllm_kl)`` (0.8.9 on; None without the correction);
* the constructor: ``clip_eps`` (0.8.0-0.8.2), then ``clip_eps_low``/``clip_eps_high``,
  ``dual_clip`` (0.8.6), ``policy_loss_type`` (0.8.8; fastppo reproduces ``"ppo"``), and the
  vLLM importance-sampling correction of ``old_log_probs`` over ``rollout_log_probs``: on when
  ``vllm_is_truncated_threshold`` is set, weights ``exp(old - rollout)`` capped above (0.8.9);
  behind ``enable_vllm_is_correction`` (0.8.10); ``[low, high]`` thresholds and ``use_icepop``
  (0.9.1); ``vllm_is_correction_type`` ``tis`` / ``icepop`` / ``mis`` (0.9.3), ``mis`` renamed
  ``seq-mask-tis`` (0.9.5). ``tis`` clamps each weight to [low, high], ``icepop`` zeroes weights
  outside it, ``seq-mask-tis`` zeroes the rows whose geometric-mean weight is outside it;
* from 0.10.3, ``forward(..., dp_size, batch_num_tokens, global_batch_size)``: the token mean is
  the sum over ``batch_num_tokens`` times ``dp_size``, the sequence mean averages the rows with a
  valid token (over ``global_batch_size`` times ``dp_size`` when given). Before, the sequence mean
  averaged every row, so a row with no valid token made it NaN. ``ValueLoss`` follows the same.

Where OpenRLHF's semantics differ from fastppo's, these reproduce OpenRLHF's:

* GAE zeroes values and rewards at masked positions and runs the recurrence straight through
  them (a hole is a zero-valued step, not skipped as in :func:`fastppo.gae`); advantages and
  returns come out at every position.
* ``compute_approx_kl`` clamps every estimator's result to [-10, 10].
* Masked means divide by the mask's sum, so an all-masked batch gives NaN (fastppo gives 0).

Two deliberate differences: ``log_probs_from_logits`` does not divide ``logits`` in place by the
temperature (OpenRLHF does, to save memory; the returned values are the same), and the policy
loss clamps log-ratios to [-20, 20] before ``exp``, as OpenRLHF does only from 0.10.3 (before,
its ratio overflows to inf there).
"""

import torch
from torch import Tensor, nn

from ..ops.gae import gae
from ..ops.kl import kl_penalty
from ..ops.ppo_loss import ppo_policy_loss
from ..ops.token_logprobs import token_logprobs
from ..ops.value_loss import value_loss
from ._nan import nan_unless
from .patching import Patch
from .peers import Peer

OPENRLHF = Peer("openrlhf", oldest="0.8.0", newest="0.11.0")
_CORRECTIONS = {"0.9.3": ("tis", "icepop", "mis"), "0.9.5": ("tis", "icepop", "seq-mask-tis")}


def log_probs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)[labels]`` in the logits' dtype, computed in fp32."""
    return token_logprobs(logits, labels, temperature=temperature).to(logits.dtype)


def compute_entropy(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim, in the logits' dtype, computed in fp32."""
    zeros = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return token_logprobs(logits, zeros, return_entropy=True)[1].to(logits.dtype)


def masked_mean(tensor: Tensor, mask, dim=None) -> Tensor:
    """OpenRLHF's ``(tensor * mask).sum(dim) / mask.sum(dim)`` (NaN where nothing is valid), with
    whatever sits at masked positions dropped; the plain mean when ``mask`` is None."""
    if mask is None:
        return tensor.mean(dim=dim)
    return (torch.where(mask.bool(), tensor, 0.0) * mask).sum(dim=dim) / mask.sum(dim=dim)


def compute_approx_kl(log_probs: Tensor, log_probs_base: Tensor, kl_estimator: str = "k1") -> Tensor:
    """OpenRLHF's per-token KL estimate (k1, k2 or k3), fp32, clamped to [-10, 10]."""
    if kl_estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"Unknown kl_estimator: {kl_estimator}")
    return kl_penalty(log_probs, log_probs_base, kl_estimator).clamp(-10.0, 10.0)


def get_advantages_and_returns(values: Tensor, rewards: Tensor, action_mask: Tensor, gamma: float,
                               lambd: float) -> tuple:
    """OpenRLHF's GAE: ``(advantages, returns)``, ``(B, T)`` fp32, one kernel launch."""
    if action_mask is not None:
        values, rewards = action_mask * values, action_mask * rewards
    every_step = torch.ones(values.shape, dtype=torch.bool, device=values.device)
    advantages, returns = gae(rewards, values, every_step, gamma=float(gamma), lam=float(lambd))
    return advantages.detach(), returns


def _aggregation(mask: Tensor, token_level_loss: bool, dp_size, batch_num_tokens, global_batch_size) -> tuple:
    """OpenRLHF's reduction as ``(agg, scale, poison)``: fastppo's ``agg`` times ``scale`` plus
    ``poison`` (NaN where OpenRLHF divides 0 by 0), for the version followed."""
    valid = mask.bool()
    tokens, rows = valid.sum(), valid.sum(dim=-1) > 0
    if not OPENRLHF.at_least("0.10.3"):
        if (dp_size, batch_num_tokens, global_batch_size) != (1, None, None):
            raise TypeError("OpenRLHF before 0.10.3 takes no dp_size, batch_num_tokens or global_batch_size")
        if token_level_loss:
            return "token-mean", 1.0, nan_unless(tokens > 0)
        return "seq-mean-token-mean", 1.0, nan_unless(rows.all())  # the mean over every row: NaN if one is empty
    if token_level_loss:
        if batch_num_tokens is None:
            return "token-mean", 1.0, nan_unless(tokens > 0)
        return "token-mean", tokens.clamp(min=1) * dp_size / batch_num_tokens, 0.0
    if global_batch_size is None:
        return "seq-mean-token-mean", 1.0, nan_unless(rows.any())
    return "seq-mean-token-mean", rows.sum().clamp(min=1) * dp_size / global_batch_size, 0.0


class PolicyLoss(nn.Module):
    """OpenRLHF's PPO policy loss (``policy_loss_type="ppo"``) on fastppo's fused kernel.

    ``forward(log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None,
    dp_size=1, batch_num_tokens=None, global_batch_size=None)`` returns what the followed
    version returns (see the module docstring).
    """

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: float = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo", enable_vllm_is_correction: bool = False,
                 vllm_is_truncated_threshold=None, vllm_is_correction_type: str = "tis", use_icepop: bool = False,
                 clip_eps: float = None) -> None:
        super().__init__()
        if policy_loss_type != "ppo":
            raise ValueError(f"fastppo reproduces policy_loss_type='ppo' only, got {policy_loss_type!r}")
        if dual_clip is not None and dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
        if clip_eps is not None:  # OpenRLHF 0.8.0-0.8.2's one clip range
            clip_eps_low = clip_eps_high = clip_eps
        self.clip_eps_low, self.clip_eps_high, self.dual_clip = clip_eps_low, clip_eps_high, dual_clip
        self.token_level_loss = token_level_loss
        self.correction = self._correction(enable_vllm_is_correction, vllm_is_truncated_threshold,
                                           vllm_is_correction_type, use_icepop)
        self.vllm_is_truncated_threshold = vllm_is_truncated_threshold

    @staticmethod
    def _correction(enabled, threshold, correction_type, use_icepop):
        """The vLLM correction the followed version applies with these options, or None."""
        if not OPENRLHF.at_least("0.8.9"):
            return None
        if not OPENRLHF.at_least("0.8.10"):
            return None if threshold is None else "cap"
        if not enabled:
            return None
        if not OPENRLHF.at_least("0.9.1"):
            return "cap"
        if not OPENRLHF.at_least("0.9.3"):
            return "icepop" if use_icepop else "tis"
        types = _CORRECTIONS["0.9.5" if OPENRLHF.at_least("0.9.5") else "0.9.3"]
        if correction_type not in types:
            raise ValueError(f"Invalid vllm_is_correction_type: {correction_type}, must be one of {'/'.join(types)}")
        return "seq-mask-tis" if correction_type == "mis" else correction_type

    def _is_weights(self, old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> Tensor:
        log_ratio = (old_log_probs - rollout_log_probs).detach().float()
        weights = torch.exp(log_ratio)
        if self.correction == "cap":
            return weights.clamp(max=self.vllm_is_truncated_threshold)
        low, high = self.vllm_is_truncated_threshold
        if self.correction == "tis":
            return weights.clamp(min=low, max=high)
        if self.correction == "icepop":
            return weights * ((weights >= low) & (weights <= high))
        sequence = torch.exp(masked_mean(log_ratio, mask, dim=-1))  # seq-mask-tis: (B,) geometric means
        return weights * ((sequence >= low) & (sequence <= high)).unsqueeze(-1)

    def forward(self, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, action_mask: Tensor = None,
                rollout_log_probs: Tensor = None, dp_size: int = 1, batch_num_tokens=None, global_batch_size=None):
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask
        agg, scale, poison = _aggregation(mask, self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        weighted = advantages
        if self.correction is not None:
            if rollout_log_probs is None:
                raise ValueError("the vLLM importance-sampling correction needs rollout_log_probs")
            weighted = advantages * self._is_weights(old_log_probs, rollout_log_probs, mask)
        loss, _ = ppo_policy_loss(log_probs, old_log_probs, weighted, mask, clip_eps=self.clip_eps_low,
                                  clip_eps_high=self.clip_eps_high, dual_clip=self.dual_clip, agg=agg)
        loss = loss * scale + poison
        if not OPENRLHF.at_least("0.8.3"):
            return loss
        log_ratio = (log_probs - old_log_probs).detach().float()
        ratio = log_ratio.clamp(-20.0, 20.0).exp()
        advantages = advantages.detach().float()
        clipped = ratio.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantages < ratio * advantages
        clip_ratio = masked_mean(clipped.float(), mask)
        if not OPENRLHF.at_least("0.8.8"):
            return loss, clip_ratio
        ppo_kl = masked_mean(-log_ratio, mask)
        if not OPENRLHF.at_least("0.8.9"):
            return loss, clip_ratio, ppo_kl
        vllm_kl = None
        if self.correction is not None:
            vllm_kl = masked_mean((rollout_log_probs - old_log_probs).detach().float(), mask)
        return loss, clip_ratio, ppo_kl, vllm_kl


class ValueLoss(nn.Module):
    """OpenRLHF's clipped value loss on fastppo's ``value_loss``: ``forward(values, old_values,
    returns, action_mask=None, dp_size=1, batch_num_tokens=None, global_batch_size=None)``."""

    def __init__(self, clip_eps: float = None, token_level_loss: bool = True) -> None:
        super().__init__()
        self.clip_eps, self.token_level_loss = clip_eps, token_level_loss

    def forward(self, values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor = None,
                dp_size: int = 1, batch_num_tokens=None, global_batch_size=None) -> Tensor:
        mask = torch.ones_like(values, dtype=torch.bool) if action_mask is None else action_mask
        agg, scale, poison = _aggregation(mask, self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        loss, _ = value_loss(values, old_values, returns, mask, clip_eps=self.clip_eps, agg=agg)
        return loss * scale + poison


_UTILS, _LOSS = "openrlhf.models.utils", "openrlhf.models.loss"
_PATCH = Patch("openrlhf", {
    **{(_UTILS, f.__name__): f for f in (log_probs_from_logits, compute_approx_kl, compute_entropy, masked_mean)},
    (_LOSS, "PolicyLoss"): PolicyLoss,
    (_LOSS, "ValueLoss"): ValueLoss,
    ("openrlhf.trainer.ppo_utils.experience_maker", "RemoteExperienceMaker.get_advantages_and_returns"):
        get_advantages_and_returns,
}, missing="fastppo.integrations.openrlhf.patch() needs OpenRLHF: pip install openrlhf")


def patch() -> Patch:
    """Make the installed OpenRLHF use fastppo: every ``openrlhf`` module holding one of these
    gets fastppo's. Returns a context manager that unpatches on exit."""
    return _PATCH.install(OPENRLHF)


def unpatch() -> None:
    """Restore OpenRLHF's in every ``openrlhf`` module, including those imported while patched."""
    _PATCH.remove()
