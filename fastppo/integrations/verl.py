"""verl's PPO helpers with verl's signatures and semantics, backed by fastppo's kernels.

Supported: verl 0.6 to main (0.8.0.dev, January 2026), following the installed verl (see
``fastppo.integrations.peers``; without verl, main). Mirrors ``verl.utils.torch_functional``
(``logprobs_from_logits``, ``entropy_from_logits``, ``entropy_from_logits_with_chunking``,
``masked_sum``, ``masked_mean``, ``masked_whiten``) and ``verl.trainer.ppo.core_algos``
(``compute_gae_advantage_return``, the GRPO, RLOO and REINFORCE++ outcome advantages,
``kl_penalty``, ``agg_loss``, ``compute_policy_loss_vanilla``, ``compute_policy_loss_gspo``,
the older ``compute_policy_loss``, ``compute_value_loss``). ``patch()`` swaps them into the installed
verl, registries included. Importing this module does not import verl.

What changed in 0.7 (and holds on main), followed by version:

* ``compute_policy_loss_vanilla`` and ``compute_policy_loss_gspo`` return ``(pg_loss, metrics)``, the metrics a dict of floats
  (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``); 0.6 returned
  ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``. Both take ``rollout_is_weights``.
* ``agg_loss`` takes ``dp_size``, ``batch_num_tokens``, ``global_batch_size`` and
  ``loss_scale_factor`` (the policy loss reads them from ``config.global_batch_info``): token-mean
  is the sum over ``batch_num_tokens`` times ``dp_size``, and NaN with no valid token; the
  seq-mean modes average over ``global_batch_size`` (default: the rows with a valid token)
  times ``dp_size``, leaving fully masked rows out. In 0.6 token-mean of nothing is 0, the
  seq-mean modes average over every row, and ``seq-mean-token-mean`` is NaN if a row is empty.

Where verl's semantics differ from fastppo's own ops, these reproduce verl's:

* GAE: at a masked position verl writes the advantage carried from the next valid position
  (0 after the last one) instead of 0, its return is that plus the position's value, and the
  advantages are then whitened over the valid positions with the masked ones transformed too.
* ``seq-mean-token-sum-norm`` divides the total by ``loss_scale_factor`` or the response length T
  (fastppo's mode of that name divides by B * T).
* ``kl_penalty("low_var_kl" / "k3")`` clamps the estimate to [-10, 10] after fastppo's k3; a "+"
  suffix (``"k3+"``) keeps the value and takes k2's gradient.
* ``compute_policy_loss_vanilla`` always applies dual clipping with ``clip_ratio_c`` (3.0).
* GRPO gives a prompt with one response ``score / (1 + epsilon)``; RLOO leaves it its raw score.

Two deliberate differences: whatever sits at masked positions (NaN included) never reaches a
result, where verl's ``loss * mask`` lets a NaN through; and ``rollout_is_weights`` scale the
advantages inside the fused kernel, which equals verl's weighting of each token's loss for
non-negative weights, except that a token of weight 0 counts as unclipped in ``pg_clipfrac``.
The log-prob and entropy functions return fp32 (as verl's flash-attn path does), computed in
fp32 whatever the logits' dtype; losses come out fp32.
"""

import numpy as np
import torch
from torch import Tensor

from ..ops.aggregation import aggregation_weights
from ..ops.gae import gae
from ..ops.gae_torch import reverse_affine_scan
from ..ops.kl import kl_penalty as _kl
from ..ops.ppo_loss import ppo_policy_loss
from ..ops.token_logprobs import token_logprobs
from ..ops.value_loss import value_loss
from ._nan import nan_unless
from .patching import Patch
from .peers import Peer

VERL = Peer("verl", oldest="0.6.0", newest="0.8.0")
_KL_MODES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def logprobs_from_logits(logits: Tensor, labels: Tensor, inplace_backward: bool = True) -> Tensor:
    """``log_softmax(logits)[labels]``, fp32 (``inplace_backward`` is accepted for signature parity)."""
    return token_logprobs(logits, labels)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim, fp32."""
    zeros = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return token_logprobs(logits, zeros, return_entropy=True)[1]


def entropy_from_logits_with_chunking(logits: Tensor, chunk_size: int = 2048) -> Tensor:
    """verl's chunked entropy of ``(N, V)`` logits, fp32 (fastppo's kernel chunks by itself)."""
    return entropy_from_logits(logits)


def masked_sum(values: Tensor, mask: Tensor, axis=None) -> Tensor:
    """Sum of ``values`` where ``mask`` holds (anything elsewhere, NaN included, is dropped)."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def masked_mean(values: Tensor, mask: Tensor, axis=None) -> Tensor:
    """``masked_sum / (mask.sum() + 1e-8)``, as verl: 0 when nothing is valid."""
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """verl's whitening: unbiased statistics over ``mask``; every position transformed, none zeroed."""
    count = mask.sum()
    if count < 2:  # verl raises on these (its Bessel correction would divide by zero)
        raise ValueError("masked_whiten needs at least two valid entries")
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask) * count / (count - 1)
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


def _groups(scores: Tensor, index) -> tuple:
    """Per response: its group's size, mean and unbiased std (0 and 1 for a group of one), ``(B,)`` each.

    ``index`` holds each response's prompt id (verl passes a NumPy array of uids), in any order."""
    uids, inverse = np.unique(np.asarray(index), return_inverse=True)
    group = torch.as_tensor(inverse.reshape(-1), device=scores.device)  # (B,) each response's group
    count = torch.zeros(len(uids), device=scores.device).index_add_(0, group, torch.ones_like(scores))
    mean = torch.zeros_like(count).index_add_(0, group, scores) / count
    squares = torch.zeros_like(count).index_add_(0, group, (scores - mean[group]) ** 2)
    std = torch.sqrt(squares / (count - 1))
    n = count[group]
    return n, torch.where(n > 1, mean[group], 0.0), torch.where(n > 1, std[group], 1.0)


def compute_grpo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index, epsilon: float = 1e-6,
                                   norm_adv_by_std_in_grpo: bool = True, config=None) -> tuple:
    """verl's GRPO: each response's score against its group's, ``(advantages, advantages)`` ``(B, T)``."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        _, mean, std = _groups(scores, index)
        centred = scores - mean
        advantages = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_rloo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index, epsilon: float = 1e-6,
                                   config=None, **kwargs) -> tuple:
    """verl's RLOO: each score minus the mean of its group's others (a lone response keeps its score)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        n, mean, _ = _groups(scores, index)
        loo = (scores - mean) * n / (n - 1).clamp(min=1)  # a lone response: mean 0, its raw score
        advantages = loo.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, config=None,
                                                  **kwargs) -> tuple:
    """verl's REINFORCE++: discounted returns, reset after each response's end, whitened over the mask."""
    if config is None:
        raise ValueError("compute_reinforce_plus_plus_outcome_advantage needs config (for config.gamma)")
    gamma = float(_option(config, "gamma", 1.0))
    with torch.no_grad():
        mask = response_mask.float()
        carry = torch.cat([gamma * mask[:, 1:], mask.new_zeros(mask.shape[0], 1)], dim=1)  # G_t = r_t + g m_{t+1} G_{t+1}
        returns = reverse_affine_scan(carry, token_level_rewards.float())
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """verl's per-token KL estimates: kl/k1, abs, mse/k2, low_var_kl/k3 (clamped to [-10, 10]), and
    any of them with "+" (its value, k2's gradient)."""
    straight_through = kl_penalty.endswith("+")
    mode = kl_penalty[:-1] if straight_through else kl_penalty
    if mode == "abs":
        value = (logprob.float() - ref_logprob.float()).abs()
    elif mode in _KL_MODES:
        value = _kl(logprob, ref_logprob, _KL_MODES[mode])
        value = value.clamp(-10.0, 10.0) if _KL_MODES[mode] == "k3" else value
    else:
        raise NotImplementedError(f"kl_penalty {kl_penalty!r}")
    if not straight_through or _KL_MODES.get(mode) == "k2":
        return value
    k2 = _kl(logprob, ref_logprob, "k2")
    return k2 - k2.detach() + value.detach()


def _option(config, name, default):
    if config is None:
        return default
    value = config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)
    return default if value is None else value


def _aggregation(mask: Tensor, mode: str, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                 loss_scale_factor=None) -> tuple:
    """verl's ``agg_loss`` as ``(agg, scale, poison)``: fastppo's ``agg`` times ``scale``, plus
    ``poison`` (0, or NaN where verl divides 0 by 0), for the version followed."""
    if mode not in _AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {mode}")
    valid = mask.bool()
    B, T = valid.shape[0], valid.shape[-1]
    rows = valid.sum(dim=-1) > 0 if valid.dim() > 1 else valid.any().reshape(1)
    if not VERL.at_least("0.7"):
        if any(x is not None for x in (batch_num_tokens, global_batch_size, loss_scale_factor)) or dp_size != 1:
            raise TypeError("verl 0.6's agg_loss takes no global-batch arguments")
        if mode == "seq-mean-token-mean":  # the mean over every row of each row's mean: NaN if a row is empty
            return mode, 1.0, nan_unless(rows.all())
        if mode == "seq-mean-token-sum-norm":
            return "seq-mean-token-sum", B / T, 0.0
        return mode, 1.0, 0.0
    if mode == "token-mean":
        if batch_num_tokens is None:
            return mode, float(dp_size), nan_unless(valid.any())
        return mode, valid.sum().clamp(min=1) * dp_size / batch_num_tokens, 0.0
    if mode == "seq-mean-token-sum-norm":
        return "seq-mean-token-sum", B / (T if loss_scale_factor is None else loss_scale_factor), 0.0
    sequences = rows.sum() if global_batch_size is None else global_batch_size  # 0 rows: 0 / 0, NaN
    kept = B if mode == "seq-mean-token-sum" else rows.sum().clamp(min=1)  # fastppo's own divisor
    return mode, kept * dp_size / sequences, 0.0


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str, dp_size: int = 1, batch_num_tokens=None,
             global_batch_size=None, loss_scale_factor=None) -> Tensor:
    """verl's loss aggregation, fp32 (the global-batch arguments from verl 0.7; see the module docstring)."""
    agg, scale, poison = _aggregation(loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size,
                                      loss_scale_factor)
    valid = loss_mask.bool()
    weights = aggregation_weights(valid, agg)
    return (torch.where(valid, loss_mat.float(), 0.0) * weights).sum() * scale + poison


def _vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_low, clip_high, clip_c,
             rollout_is_weights, batch_info) -> tuple:
    """verl's dual-clip PPO loss on the fused kernel: ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``."""
    if clip_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1.0, got {clip_c}")
    agg, scale, poison = _aggregation(response_mask, loss_agg_mode, **batch_info)
    if rollout_is_weights is not None:
        advantages = advantages * rollout_is_weights.detach()
    pg_loss, stats = ppo_policy_loss(log_prob, old_log_prob, advantages, response_mask, clip_eps=clip_low,
                                     clip_eps_high=clip_high, dual_clip=clip_c, agg=agg)
    ppo_kl = masked_mean(-(log_prob - old_log_prob).detach().float().clamp(-20.0, 20.0), response_mask)
    return pg_loss * scale + poison, stats["clipfrac"], ppo_kl, stats["dual_clipfrac"]


def _clip_range(config) -> tuple:
    """``(clip_ratio_low, clip_ratio_high)`` from verl's actor config, each defaulting to ``clip_ratio``."""
    clip = _option(config, "clip_ratio", 0.2)
    return _option(config, "clip_ratio_low", clip), _option(config, "clip_ratio_high", clip)


def _batch_info(config) -> dict:
    """``config.global_batch_info``, which the policy losses pass to ``agg_loss`` from verl 0.7."""
    return dict(_option(config, "global_batch_info", {})) if VERL.at_least("0.7") else {}


def _policy_result(pg_loss: Tensor, clipfrac: Tensor, ppo_kl: Tensor, clipfrac_lower: Tensor) -> tuple:
    """A policy loss's result as the followed verl returns it: four values in 0.6, ``(pg_loss, metrics)`` from 0.7."""
    if not VERL.at_least("0.7"):
        return pg_loss, clipfrac, ppo_kl, clipfrac_lower
    return pg_loss, {"actor/pg_clipfrac": clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
                     "actor/pg_clipfrac_lower": clipfrac_lower.item()}


def compute_policy_loss_vanilla(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                loss_agg_mode: str = "token-mean", config=None, rollout_is_weights=None) -> tuple:
    """verl's vanilla PPO loss: ``(pg_loss, metrics)`` from verl 0.7, ``(pg_loss, pg_clipfrac,
    ppo_kl, pg_clipfrac_lower)`` in 0.6.

    ``config`` holds ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c`` and
    (from 0.7) ``global_batch_info``, as attributes or keys, as verl's actor config.
    """
    low, high = _clip_range(config)
    return _policy_result(*_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, low, high,
                                    _option(config, "clip_ratio_c", 3.0), rollout_is_weights, _batch_info(config)))


def compute_policy_loss_gspo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                             loss_agg_mode: str = "seq-mean-token-mean", config=None, rollout_is_weights=None) -> tuple:
    """verl's GSPO loss (one importance ratio per sequence, its gradient through each token),
    returned as ``compute_policy_loss_vanilla`` returns; always aggregated seq-mean-token-mean.

    Plain PyTorch over ``(B, T)`` log-probs, as :func:`fastppo.sequence_ppo_loss` is (a
    cross-token reduction); unlike that op it takes verl's per-token advantages and weights.
    """
    low, high = _clip_range(config)
    valid = response_mask.bool()
    log_prob32 = log_prob.float()
    log_ratio = torch.where(valid, log_prob32 - old_log_prob.detach().float(), 0.0)  # (B, T)
    sequence = log_ratio.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)  # (B,): the geometric mean's log
    # s_{i,t} = sg[s_i] * p_t / sg[p_t]: the value of s_i, the gradient of one token's log-prob
    ratio = torch.exp((log_prob32 - log_prob32.detach() + sequence.detach().unsqueeze(-1)).clamp(max=10.0))
    advantages = advantages.detach().float()
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - low, 1 + high)
    losses = torch.maximum(unclipped, clipped)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights.detach()
    pg_loss = agg_loss(losses, response_mask, "seq-mean-token-mean", **_batch_info(config))
    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)
    return _policy_result(pg_loss, clipfrac, ppo_kl, torch.zeros((), device=pg_loss.device))  # no dual clip


def compute_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                        cliprange=None, cliprange_low=None, cliprange_high=None, clip_ratio_c: float = 3.0,
                        loss_agg_mode: str = "token-mean") -> tuple:
    """verl's older policy-loss API (deprecated there, still called):
    ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``."""
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    return _vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, low, high, clip_ratio_c,
                    None, {})


def compute_value_loss(vpreds: Tensor, returns: Tensor, values: Tensor, response_mask: Tensor,
                       cliprange_value: float, loss_agg_mode: str = "token-mean") -> tuple:
    """verl's clipped value loss on fastppo's ``value_loss``: ``(vf_loss, vf_clipfrac)``."""
    agg, scale, poison = _aggregation(response_mask, loss_agg_mode)
    loss, stats = value_loss(vpreds, values, returns, response_mask, clip_eps=cliprange_value, agg=agg)
    return loss * scale + poison, stats["vf_clipfrac"]


_CORE, _FUNCTIONAL = "verl.trainer.ppo.core_algos", "verl.utils.torch_functional"
_PATCH = Patch("verl", {
    **{(_FUNCTIONAL, f.__name__): f for f in (logprobs_from_logits, entropy_from_logits,
                                             entropy_from_logits_with_chunking, masked_sum, masked_mean,
                                             masked_whiten)},
    **{(_CORE, f.__name__): f for f in (compute_gae_advantage_return, compute_grpo_outcome_advantage,
                                       compute_rloo_outcome_advantage, compute_reinforce_plus_plus_outcome_advantage,
                                       kl_penalty, agg_loss, compute_policy_loss_vanilla, compute_policy_loss_gspo,
                                       compute_policy_loss, compute_value_loss)},
}, missing="fastppo.integrations.verl.patch() needs verl: pip install verl")


def patch() -> Patch:
    """Make the installed verl call fastppo: every ``verl`` module (and registry, such as the
    policy-loss and advantage-estimator tables) holding one of these functions gets fastppo's.
    Returns a context manager that unpatches on exit."""
    return _PATCH.install(VERL)


def unpatch() -> None:
    """Restore verl's functions in every ``verl`` module, including those imported while patched."""
    _PATCH.remove()
