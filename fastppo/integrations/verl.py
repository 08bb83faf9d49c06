"""verl's PPO helpers with verl's signatures and semantics, backed by fastppo's kernels.

Follows every verl release in ``VERL`` (0.6.0 to 0.9.1), the installed one (see
``fastppo.integrations.peers``; without verl, the newest). Mirrors ``verl.utils.torch_functional``
(``logprobs_from_logits``, ``entropy_from_logits``, ``entropy_from_logits_with_chunking``,
``masked_sum``, ``masked_mean``, ``masked_whiten``) and ``verl.trainer.ppo.core_algos``
(``compute_gae_advantage_return``, the GRPO, RLOO and REINFORCE++ outcome advantages,
``kl_penalty``, ``agg_loss``, ``compute_policy_loss_vanilla``, ``compute_policy_loss_gspo``,
the older ``compute_policy_loss``, ``compute_value_loss``). ``patch()`` swaps them into the
installed verl, registries included. Importing this module does not import verl.

What each release changed, the semantics of verl's that these reproduce where they differ from
fastppo's own ops, and where they deviate from verl on purpose: ``docs/integrations.md``
("verl, release by release").
"""

import numpy as np
import torch
from torch import Tensor

from ..ops.aggregation import aggregation_weights
from ..ops.gae import gae
from ..ops.gae_torch import reverse_affine_scan
from ..ops.kl import kl_penalty as _kl
from ..ops.ppo_policy_loss import ppo_policy_loss
from ..ops.token_logprobs import token_logprobs
from ..ops.value_loss import value_loss
from ._nan import nan_gradient, nan_unless
from .patching import Patch
from .peers import Peer, parameters

VERL = Peer(
    "verl",
    {
        "0.6.0": (),
        "0.6.1": ("policy-loss-returns-metrics", "seq-mean-leaves-out-empty-rows"),
        "0.7.0": ("global-batch",),
        "0.7.1": ("sum-norm-over-global-batch", "global-counts-required"),
        "0.8.0": ("kl-plus-suffix",),
        "0.9.0": ("token-sum", "value-loss-global-batch", "reinforce-pp-spans"),
        "0.9.1": ("gspo-follows-agg-mode",),
    },
)
_KL_MODES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_GLOBAL_BATCH = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None)


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


def compute_gae_advantage_return(
    token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma, lam
) -> tuple:
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


def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
) -> tuple:
    """verl's GRPO: each response's score against its group's, ``(advantages, advantages)`` ``(B, T)``."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        _, mean, std = _groups(scores, index)
        centred = scores - mean
        advantages = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index, epsilon: float = 1e-6, config=None, **kwargs
) -> tuple:
    """verl's RLOO: each score minus the mean of its group's others (a lone response keeps its score)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        n, mean, _ = _groups(scores, index)
        loo = (scores - mean) * n / (n - 1).clamp(min=1)  # a lone response: mean 0, its raw score
        advantages = loo.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, config=None, **kwargs
) -> tuple:
    """verl's REINFORCE++: discounted returns over each response, whitened over the mask.

    Before 0.9.0 the running return restarts after every masked position; from 0.9.0 it is carried
    through masked spans unchanged and the returns there are 0 (see the module docstring)."""
    if config is None:
        raise ValueError("compute_reinforce_plus_plus_outcome_advantage needs config (for config.gamma)")
    gamma = float(_option(config, "gamma", 1.0))
    with torch.no_grad():
        mask, rewards = response_mask.float(), token_level_rewards.float()
        if VERL.has("reinforce-pp-spans"):
            # G_t = m_t r_t + (m_t g + 1 - m_t) G_{t+1}; the return written at t is m_t (r_t + g G_{t+1})
            running = reverse_affine_scan(mask * gamma + 1.0 - mask, mask * rewards)
            following = torch.nn.functional.pad(running[:, 1:], (0, 1))  # G_{t+1}, 0 after the end
            returns = mask * (rewards + gamma * following)
        else:  # G_t = r_t + g m_{t+1} G_{t+1}
            carry = torch.cat([gamma * mask[:, 1:], mask.new_zeros(mask.shape[0], 1)], dim=1)
            returns = reverse_affine_scan(carry, rewards)
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """verl's per-token KL estimates: kl/k1, abs, mse/k2, low_var_kl/k3 (clamped to [-10, 10]), and
    from 0.8.0 any of them with "+" (its value, k2's gradient)."""
    straight_through = kl_penalty.endswith("+") and VERL.has("kl-plus-suffix")
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


def _aggregation(
    mask: Tensor, mode: str, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None
) -> tuple:
    """verl's ``agg_loss`` as ``(agg, scale, poison, nan_rows)``: fastppo's ``agg`` times ``scale``,
    plus ``poison`` (0, or NaN where verl divides 0 by 0), with a NaN gradient over the rows
    ``nan_rows`` (B, 1) (or None), where verl's own division by a row's count of 0 reaches the
    gradient (:func:`_followed`), for the release followed.

    ``scale`` is a tensor, so a count of 0 (an int or a tensor) gives verl's inf or NaN; with no
    valid token at all verl's numerator is 0 behind a ``where``: the value is 0 / count and the
    gradient 0."""
    modes = _AGG_MODES + ("token-sum",) * VERL.has("token-sum")
    if mode not in modes:
        raise ValueError(f"Invalid loss_agg_mode: {mode}")
    valid = mask.bool()
    B = valid.new_tensor(valid.shape[0], dtype=torch.float32)  # as tensors: verl's x / 0 is inf, not an error
    T = valid.new_tensor(valid.shape[-1], dtype=torch.float32)
    tokens = valid.sum()
    rows = (valid.sum(dim=-1) > 0).sum() if valid.dim() > 1 else (tokens > 0).long()
    if not VERL.has("global-batch"):
        if mode == "seq-mean-token-sum-norm":  # the total over T, from fastppo's total over B
            return "seq-mean-token-sum", B / T, 0.0, None
        if VERL.has("seq-mean-leaves-out-empty-rows"):
            return mode, B / rows.clamp(min=1) if mode == "seq-mean-token-sum" else 1.0, 0.0, None
        if mode == "seq-mean-token-mean":  # the mean over every row of each row's mean: 0 / 0 in an empty row
            empty = ~valid.any(dim=-1, keepdim=True) if valid.dim() > 1 else ~valid.any().reshape(1)
            return mode, rows / B, nan_unless(~empty.any()), empty  # fastppo's mean: over the rows with a token
        return mode, 1.0, 0.0, None
    required = VERL.has("global-counts-required") and dp_size > 1
    if mode == "token-sum":
        agg, scale = "token-mean", tokens.clamp(min=1) * dp_size
    elif mode == "token-mean":
        if batch_num_tokens is None and required:
            raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
        count = tokens if batch_num_tokens is None else batch_num_tokens
        agg, scale = mode, tokens.clamp(min=1) * dp_size / count
    else:
        if global_batch_size is None and required:
            raise ValueError("global_batch_size is required when dp_size > 1")
        sequences = rows if global_batch_size is None else global_batch_size
        width = T if loss_scale_factor is None else loss_scale_factor
        if mode == "seq-mean-token-sum-norm" and not VERL.has("sum-norm-over-global-batch"):
            agg, scale = "seq-mean-token-sum", B / width
        elif mode == "seq-mean-token-mean":
            agg, scale = mode, rows.clamp(min=1) * dp_size / sequences
        else:
            scale = B * dp_size / sequences  # fastppo's seq-mean-token-sum divides the rows' sums by B
            agg, scale = "seq-mean-token-sum", scale / width if mode == "seq-mean-token-sum-norm" else scale
    scale = torch.as_tensor(scale, dtype=torch.float32, device=valid.device)
    no_token = tokens == 0
    return agg, torch.where(no_token, 0.0, scale), nan_unless(~(no_token & ~scale.isfinite())), None


def _followed(loss: Tensor, scale, poison, nan_rows, *inputs) -> Tensor:
    """verl's result from fastppo's ``loss`` and :func:`_aggregation`'s terms, with a NaN gradient
    for each of ``inputs`` (B, T) over ``nan_rows``, as verl's own division gives it."""
    return loss * scale + poison + sum(nan_gradient(x, nan_rows) for x in inputs)


def _agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str, *inputs, **batch_info) -> Tensor:
    """verl's aggregation of ``loss_mat``; its NaN rows reach the gradient of ``inputs`` (default: ``loss_mat``)."""
    agg, scale, poison, nan_rows = _aggregation(loss_mask, loss_agg_mode, **batch_info)
    valid = loss_mask.bool()
    weights = aggregation_weights(valid, agg)
    total = (torch.where(valid, loss_mat.float(), 0.0) * weights).sum()
    return _followed(total, scale, poison, nan_rows, *(inputs or (loss_mat,)))


@VERL.follows(
    {
        "0.6.0": parameters("loss_mat", "loss_mask", "loss_agg_mode"),
        "0.7.0": parameters("loss_mat", "loss_mask", "loss_agg_mode", **_GLOBAL_BATCH),
    }
)
def agg_loss(loss_mat, loss_mask, loss_agg_mode, **batch_info) -> Tensor:
    """verl's loss aggregation, fp32 (the global-batch arguments from 0.7.0; see the module docstring)."""
    return _agg_loss(loss_mat, loss_mask, loss_agg_mode, **batch_info)


def _clip_fractions(
    log_ratio: Tensor, advantages: Tensor, mask: Tensor, low: float, high: float, clip_c: float
) -> tuple:
    """verl's ``pg_clipfrac`` and ``pg_clipfrac_lower`` from the unweighted advantages, ``(B, T)``."""
    ratio = log_ratio.exp()
    pg1, pg2 = -advantages * ratio, -advantages * ratio.clamp(1 - low, 1 + high)
    clipped = torch.maximum(pg1, pg2)
    lower = (clipped > -advantages * clip_c) & (advantages < 0)
    return masked_mean((pg2 > pg1).float(), mask), masked_mean(lower.float(), mask)


def _vanilla(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode,
    clip_low,
    clip_high,
    clip_c,
    rollout_is_weights,
    batch_info,
) -> tuple:
    """verl's dual-clip PPO loss on the fused kernel: ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``."""
    if clip_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1.0, got {clip_c}")
    agg, scale, poison, nan_rows = _aggregation(response_mask, loss_agg_mode, **batch_info)
    weighted = advantages
    if rollout_is_weights is not None:  # weights >= 0 commute with the clipping; others poison the loss
        weighted = advantages * rollout_is_weights.detach()
        negative = ((rollout_is_weights < 0) & response_mask.bool()).any()  # and its gradient, everywhere
        poison = poison + nan_unless(~negative)
        nan_rows = negative.reshape(1, 1) if nan_rows is None else nan_rows | negative
    pg_loss, stats = ppo_policy_loss(
        log_prob,
        old_log_prob,
        weighted,
        response_mask,
        clip_eps=clip_low,
        clip_eps_high=clip_high,
        dual_clip=clip_c,
        agg=agg,
    )
    log_ratio = (log_prob.float() - old_log_prob.float()).clamp(-20.0, 20.0)
    ppo_kl = masked_mean(-log_ratio, response_mask)  # differentiable, as verl's (0.6.0 returns it)
    clipfrac, lower = stats["clipfrac"], stats["dual_clipfrac"]
    if rollout_is_weights is not None:  # the kernel's counts saw the weighted advantages
        clipfrac, lower = _clip_fractions(
            log_ratio.detach(), advantages.detach().float(), response_mask, clip_low, clip_high, clip_c
        )
    return _followed(pg_loss, scale, poison, nan_rows, log_prob), clipfrac, ppo_kl, lower


def _clip_range(config) -> tuple:
    """``(clip_ratio_low, clip_ratio_high)`` from verl's actor config, each defaulting to ``clip_ratio``."""
    clip = _option(config, "clip_ratio", 0.2)
    return _option(config, "clip_ratio_low", clip), _option(config, "clip_ratio_high", clip)


def _batch_info(config) -> dict:
    """``config.global_batch_info``, which the policy losses pass to ``agg_loss`` from 0.7.0."""
    return dict(_option(config, "global_batch_info", {})) if VERL.has("global-batch") else {}


def _policy_result(pg_loss: Tensor, clipfrac: Tensor, ppo_kl: Tensor, clipfrac_lower: Tensor) -> tuple:
    """A policy loss's result as the followed release returns it: four values in 0.6.0,
    ``(pg_loss, metrics)`` from 0.6.1."""
    if not VERL.has("policy-loss-returns-metrics"):
        return pg_loss, clipfrac, ppo_kl, clipfrac_lower
    return pg_loss, {
        "actor/pg_clipfrac": clipfrac.item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": clipfrac_lower.item(),
    }


def compute_policy_loss_vanilla(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
) -> tuple:
    """verl's vanilla PPO loss: ``(pg_loss, metrics)`` from 0.6.1, ``(pg_loss, pg_clipfrac, ppo_kl,
    pg_clipfrac_lower)`` in 0.6.0.

    ``config`` holds ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c`` and
    (from 0.7.0) ``global_batch_info``, as attributes or keys, as verl's actor config.
    """
    low, high = _clip_range(config)
    return _policy_result(
        *_vanilla(
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            loss_agg_mode,
            low,
            high,
            _option(config, "clip_ratio_c", 3.0),
            rollout_is_weights,
            _batch_info(config),
        )
    )


def compute_policy_loss_gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
) -> tuple:
    """verl's GSPO loss (one importance ratio per sequence, its gradient through each token),
    returned as ``compute_policy_loss_vanilla`` returns; aggregated seq-mean-token-mean before
    0.9.1, by ``loss_agg_mode`` from 0.9.1.

    Plain PyTorch over ``(B, T)`` log-probs, as :func:`fastppo.sequence_ppo_loss` is (a
    cross-token reduction); unlike that op it takes verl's per-token advantages and weights.
    """
    low, high = _clip_range(config)
    valid = response_mask.bool()
    log_prob32 = torch.where(valid, log_prob.float(), 0.0)  # (B, T); masked garbage gets no gradient
    log_ratio = torch.where(valid, log_prob32 - old_log_prob.detach().float(), 0.0)
    sequence = log_ratio.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)  # (B,): the geometric mean's log
    # s_{i,t} = sg[s_i] * p_t / sg[p_t]: the value of s_i, the gradient of one token's log-prob
    ratio = torch.exp((log_prob32 - log_prob32.detach() + sequence.detach().unsqueeze(-1)).clamp(max=10.0))
    advantages = advantages.detach().float()
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - low, 1 + high)
    losses = torch.maximum(unclipped, clipped)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights.detach()
    mode = loss_agg_mode if VERL.has("gspo-follows-agg-mode") else "seq-mean-token-mean"
    pg_loss = _agg_loss(losses, response_mask, mode, log_prob, **_batch_info(config))
    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)  # differentiable, as verl's (0.6.0 returns it)
    return _policy_result(pg_loss, clipfrac, ppo_kl, torch.zeros((), device=pg_loss.device))  # no dual clip


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    cliprange=None,
    cliprange_low=None,
    cliprange_high=None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple:
    """verl's older policy-loss API (deprecated there, still called):
    ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``."""
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    return _vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, low, high, clip_ratio_c, None, {})


@VERL.follows(
    {
        "0.6.0": parameters(
            "vpreds", "returns", "values", "response_mask", "cliprange_value", loss_agg_mode="token-mean"
        ),
        "0.9.0": parameters(
            "vpreds",
            "returns",
            "values",
            "response_mask",
            "cliprange_value",
            loss_agg_mode="token-mean",
            **_GLOBAL_BATCH,
        ),
    }
)
def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    **batch_info,
) -> tuple:
    """verl's clipped value loss on fastppo's ``value_loss``: ``(vf_loss, vf_clipfrac)`` (the
    global-batch arguments from 0.9.0)."""
    agg, scale, poison, nan_rows = _aggregation(response_mask, loss_agg_mode, **batch_info)
    loss, _ = value_loss(vpreds, values, returns, response_mask, clip_eps=cliprange_value, agg=agg)
    # verl's count of the clipped error winning, from verl's clip: ties (no clipping) count as not
    v, old, target = vpreds.detach(), values.detach(), returns.detach()
    clipped = torch.max(torch.min(v, old + cliprange_value), old - cliprange_value)
    clipfrac = masked_mean(((clipped - target) ** 2 > (v - target) ** 2).float(), response_mask)
    return _followed(loss, scale, poison, nan_rows, vpreds), clipfrac


_CORE, _FUNCTIONAL = "verl.trainer.ppo.core_algos", "verl.utils.torch_functional"
_PATCH = Patch(
    "verl",
    {
        **{
            (_FUNCTIONAL, f.__name__): f
            for f in (
                logprobs_from_logits,
                entropy_from_logits,
                entropy_from_logits_with_chunking,
                masked_sum,
                masked_mean,
                masked_whiten,
            )
        },
        **{
            (_CORE, f.__name__): f
            for f in (
                compute_gae_advantage_return,
                compute_grpo_outcome_advantage,
                compute_rloo_outcome_advantage,
                compute_reinforce_plus_plus_outcome_advantage,
                kl_penalty,
                agg_loss,
                compute_policy_loss_vanilla,
                compute_policy_loss_gspo,
                compute_policy_loss,
                compute_value_loss,
            )
        },
    },
    caller="fastppo.integrations.verl.patch()",
    install_hint="pip install verl",
)


def patch() -> Patch:
    """Make the installed verl call fastppo: every ``verl`` module (and registry, such as the
    policy-loss and advantage-estimator tables) holding one of these functions gets fastppo's.
    Returns a context manager that unpatches on exit."""
    return _PATCH.install(VERL)


def unpatch() -> None:
    """Restore verl's functions in every ``verl`` module, including those imported while patched."""
    _PATCH.remove()
