"""verl's PPO helpers with verl's signatures and semantics, backed by fastppo's kernels.

Mirrors ``verl.utils.torch_functional`` (``logprobs_from_logits``, ``entropy_from_logits``) and
``verl.trainer.ppo.core_algos`` (``compute_gae_advantage_return``, ``kl_penalty``, ``agg_loss``,
``compute_policy_loss_vanilla``) as of verl 0.4-0.5. Importing this module does not import verl.

Where verl's semantics differ from fastppo's, these reproduce verl's:

* GAE: at a masked position verl writes the advantage carried from the next valid position
  (0 after the last one) instead of 0, its return is that plus the position's value, and the
  advantages are then whitened over the valid positions with the masked ones transformed too.
* ``agg_loss``: ``token-mean`` divides by ``mask.sum() + 1e-8``; ``seq-mean-token-mean``
  averages over all rows, so a row with no valid token makes it NaN (as in verl);
  ``seq-mean-token-sum-norm`` divides the total by the response length T (fastppo's own mode of
  that name divides by B * T).
* ``kl_penalty("low_var_kl" / "k3")`` clamps the estimate to [-10, 10] after fastppo's k3.
* ``compute_policy_loss_vanilla`` always applies dual clipping with ``clip_ratio_c`` (3.0).

The log-prob and entropy functions return fp32 (as verl's flash-attn path does), computed in
fp32 whatever the logits' dtype.
"""

import torch
from torch import Tensor

from ..ops.gae import gae
from ..ops.gae_torch import reverse_affine_scan
from ..ops.kl import kl_penalty as _kl
from ..ops.ppo_loss import ppo_policy_loss
from ..ops.token_logprobs import token_logprobs
from ._nan import nan_unless

_KL_MODES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def logprobs_from_logits(logits: Tensor, labels: Tensor, inplace_backward: bool = True) -> Tensor:
    """``log_softmax(logits)[labels]``, fp32 (``inplace_backward`` is accepted for signature parity)."""
    return token_logprobs(logits, labels)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim, fp32."""
    zeros = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return token_logprobs(logits, zeros, return_entropy=True)[1]


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), values, 0.0).mul(mask).sum() / (mask.sum() + 1e-8)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """verl's whitening: unbiased statistics over ``mask``; every position transformed, none zeroed."""
    count = mask.sum()
    if count < 2:  # verl raises on these (its Bessel correction would divide by zero)
        raise ValueError("masked_whiten needs at least two valid entries")
    mean = _masked_mean(values, mask)
    var = _masked_mean((values - mean) ** 2, mask) * count / (count - 1)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened + mean if not shift_mean else whitened


def compute_gae_advantage_return(token_level_rewards: Tensor, values: Tensor, response_mask: Tensor,
                                 gamma, lam) -> tuple:
    """verl's GAE: ``(whitened advantages, returns)``, ``(B, T)`` fp32 (see the module docstring)."""
    mask = response_mask.float()
    advantages, _ = gae(token_level_rewards, values, response_mask, gamma=float(gamma), lam=float(lam))
    # Masked positions carry the advantage of the next valid position: x_t = m_t A_t + (1 - m_t) x_{t+1}
    carried = reverse_affine_scan(1.0 - mask, mask * advantages)
    returns = carried + values.float()
    return masked_whiten(carried, mask), returns


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """verl's per-token KL estimates: kl/k1, abs, mse/k2, low_var_kl/k3 (clamped to [-10, 10])."""
    if kl_penalty == "abs":
        return (logprob.float() - ref_logprob.float()).abs()
    if kl_penalty not in _KL_MODES:
        raise NotImplementedError(f"kl_penalty {kl_penalty!r}")
    kl = _kl(logprob, ref_logprob, _KL_MODES[kl_penalty])
    return kl.clamp(-10.0, 10.0) if _KL_MODES[kl_penalty] == "k3" else kl


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str) -> Tensor:
    """verl's loss aggregation (see the module docstring for how it differs from fastppo's)."""
    masked = torch.where(loss_mask.bool(), loss_mat, 0.0) * loss_mask
    if loss_agg_mode == "token-mean":
        return masked.sum() / (loss_mask.sum() + 1e-8)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked.sum(dim=-1).mean()
    if loss_agg_mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / loss_mask.sum(dim=-1)).mean()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return masked.sum() / loss_mask.shape[-1]
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


def _option(config, name, default):
    if config is None:
        return default
    value = config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)
    return default if value is None else value


def compute_policy_loss_vanilla(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                loss_agg_mode: str = "token-mean", config=None) -> tuple:
    """verl's vanilla PPO loss: ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``.

    ``config`` holds ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high`` and ``clip_ratio_c``
    (attributes or keys, as verl's actor config); the loss is fastppo's fused kernel.
    """
    clip = _option(config, "clip_ratio", 0.2)
    low, high = _option(config, "clip_ratio_low", clip), _option(config, "clip_ratio_high", clip)
    clip_c = _option(config, "clip_ratio_c", 3.0)
    if clip_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1.0, got {clip_c}")
    options = dict(clip_eps=low, clip_eps_high=high, dual_clip=clip_c)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        options.update(agg="token-mean", num_tokens=response_mask.shape[-1])
    elif loss_agg_mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        options.update(agg=loss_agg_mode)
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    pg_loss, stats = ppo_policy_loss(log_prob, old_log_prob, advantages, response_mask, **options)
    if loss_agg_mode == "seq-mean-token-mean":  # verl's row mean of an empty row is 0 / 0
        pg_loss = pg_loss + nan_unless((response_mask.sum(dim=-1) > 0).all())
    ppo_kl = _masked_mean(-(log_prob - old_log_prob).clamp(-20.0, 20.0), response_mask)
    return pg_loss, stats["clipfrac"], ppo_kl, stats["dual_clipfrac"]
