"""How a per-token loss becomes a scalar: the aggregation modes, as one weight per token.

Every mode is linear, ``agg(x) = sum_t w_t * x_t`` with weights that depend only on the mask, so
the fused losses compute ``w`` once and get each token's gradient from it directly.

* ``token-mean``: ``w = m / (num_tokens or number of valid tokens)``. Passing the global token
  count as ``num_tokens`` makes gradient accumulation and data parallelism exact.
* ``seq-mean-token-mean``: the mean over rows with a valid token of each row's token mean.
* ``seq-mean-token-sum``: the mean over all B rows of each row's token sum.
* ``seq-mean-token-sum-norm``: the total sum over B * T (a constant normaliser, as Dr. GRPO).

:func:`denominator` names each mode's normaliser, so a trainer that splits a batch into
minibatches (or ranks) can rescale each part's loss to the whole batch's.
"""

import torch
from torch import Tensor

from . import checks

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def denominator(valid: Tensor, agg: str, width=None) -> Tensor:
    """The number ``agg`` divides by over ``valid`` (``(B, T)`` bool), as an fp32 0-dim tensor:
    the valid tokens (token-mean), the rows with a valid token (seq-mean-token-mean), the rows
    (seq-mean-token-sum) or rows x ``width`` (seq-mean-token-sum-norm; ``width`` defaults to T,
    a trainer passes its generation budget). Summed over a batch's parts, it is the whole's."""
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    m = valid.float()
    if agg == "token-mean":
        return m.sum()
    if m.dim() != 2:
        raise ValueError(f"agg={agg!r} needs (B, T) token tensors, got shape {tuple(m.shape)}")
    B, T = m.shape
    if agg == "seq-mean-token-mean":
        return (m.sum(dim=1) > 0).sum().float()
    return m.new_tensor(float(B if agg == "seq-mean-token-sum" else B * (T if width is None else width)))


def aggregation_weights(valid: Tensor, agg: str, num_tokens=None) -> Tensor:
    """fp32 weights ``w`` of ``valid``'s shape (0 where not valid) with ``agg(x) = (w * x).sum()``.

    ``valid`` is a bool mask. ``num_tokens`` (a positive int, or a tensor, e.g. an all-reduced
    count) replaces the token count of ``token-mean`` and is refused by the other modes.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    m = valid.float()
    if agg == "token-mean":
        if num_tokens is None:
            return m / m.sum().clamp(min=1.0)
        if isinstance(num_tokens, torch.Tensor):
            checks.check_same_device(valid.device, "mask", num_tokens=num_tokens)
            if num_tokens.numel() != 1:
                raise ValueError(f"num_tokens must hold one number, got shape {tuple(num_tokens.shape)}")
            return m / num_tokens.reshape(()).float().clamp(min=1.0)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int or a tensor, got {num_tokens!r}")
        return m / num_tokens
    if num_tokens is not None:
        raise ValueError(f"num_tokens applies to agg='token-mean' only, not agg={agg!r}")
    if m.dim() != 2:
        raise ValueError(f"agg={agg!r} needs (B, T) token tensors, got shape {tuple(m.shape)}")
    per_row = m / m.sum(dim=1, keepdim=True).clamp(min=1.0) if agg == "seq-mean-token-mean" else m  # (B, T)
    return per_row / denominator(valid, agg).clamp(min=1.0)
