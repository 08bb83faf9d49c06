"""``value_loss``: the critic's clipped squared error, aggregated like the policy loss.

A handful of elementwise ops on (B, T) tensors: plain PyTorch and its own autograd are as fast
as a kernel would be here, so there is none.
"""

from typing import Optional

import torch
from torch import Tensor

from . import checks
from .aggregation import aggregation_weights


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_eps: Optional[float] = 0.2,
    agg: str = "token-mean",
    num_tokens=None,
) -> tuple[Tensor, dict]:
    """``agg(0.5 * max((v - R)**2, (v_clip - R)**2))`` with ``v_clip = old_v + clamp(v - old_v, ±clip_eps)``.

    ``clip_eps=None`` disables clipping (``0.5 * (v - R)**2``). Token tensors share one shape;
    ``mask`` is bool or 0/1 and masked positions contribute nothing (NaN there is harmless, to
    the loss and to the gradient); NaN at a valid position, or a mask value other than 0/1,
    makes the loss NaN.
    ``agg`` and ``num_tokens`` are as in :func:`fastppo.ppo_policy_loss`.

    Returns ``(loss, stats)``: a 0-dim fp32 loss differentiable w.r.t. ``values``, and detached
    ``vf_loss``, ``vf_clipfrac`` (fraction of valid tokens where the clipped error won) and
    ``value_mean`` (token mean of the values).
    """
    for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
        checks.check_floating(x, name)
        if x.shape != values.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but values has {tuple(values.shape)}")
    checks.check_same_device(values.device, "values", old_values=old_values, returns=returns)
    valid, invalid = checks.check_mask(mask, values, "values")
    if clip_eps is not None and (not checks.is_real(clip_eps) or not 0 <= clip_eps < float("inf")):
        raise ValueError(f"clip_eps must be a finite number >= 0 or None, got {clip_eps!r}")

    weights = checks.poison(aggregation_weights(valid, agg, num_tokens), invalid)  # NaN where mask is not 0/1
    v = torch.where(valid, values.float(), 0.0)
    old = torch.where(valid, old_values.detach().float(), 0.0)
    target = torch.where(valid, returns.detach().float(), 0.0)
    error = (v - target) ** 2
    if clip_eps is None:
        per_token, clipped = 0.5 * error, torch.zeros_like(valid)
    else:
        clipped_error = (old + (v - old).clamp(-clip_eps, clip_eps) - target) ** 2
        per_token, clipped = 0.5 * torch.maximum(error, clipped_error), clipped_error > error
    loss = (weights * per_token).sum()
    count = valid.sum().clamp(min=1)
    stats = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": (clipped & valid).sum() / count,
        "value_mean": v.detach().sum() / count,
    }
    return loss, stats
