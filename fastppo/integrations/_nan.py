"""Reproducing peers' 0 / 0 without a host sync: they return NaN where fastppo returns 0, in a
result's value (:func:`nan_unless`) and, where their division sits on the gradient's path, in its
gradient (:func:`nan_gradient`). A peer divides a group's ``sum(loss * mask)`` by the group's
count of 0: the value is NaN, and the gradient reaching each per-token loss of the group is
``inf * 0``, NaN, which its per-token graph carries to an input wherever that input's term is
live and a clamp or a selection does not cut it (there the peer's gradient stays 0)."""

from typing import Callable, Optional

import torch
from torch import Tensor


def nan_unless(condition: Tensor) -> Tensor:
    """0-dim fp32: 0 where ``condition`` holds, NaN otherwise; add it to a result to poison its value."""
    return torch.where(condition, 0.0, float("nan"))


def nan_gradient(x: Tensor, where: Optional[Tensor], live: Optional[Callable] = None) -> Tensor:
    """A 0-dim 0 to add to a result: its gradient is NaN at the entries of ``x`` where ``where``
    (broadcast to ``x``) holds and, when given, ``live()`` (a bool tensor like ``x``: where the
    peer's per-token graph carries a gradient to ``x``, asked only in the backward), and exactly 0
    at the others, whatever they hold. None: no poison."""
    if where is None:
        return x.new_zeros((), dtype=torch.float32)
    return _NanGradient.apply(x, where.expand(x.shape), live)


class _NanGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, where, live):
        ctx.save_for_backward(where)
        ctx.live, ctx.dtype = live, x.dtype
        return x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        (where,) = ctx.saved_tensors
        if ctx.live is not None:
            with torch.enable_grad():
                where = where & ctx.live()
        return (torch.where(where, float("nan"), 0.0) * grad).to(ctx.dtype), None, None


def live_entries(loss: Callable, x: Tensor) -> Tensor:
    """Where ``loss(x)`` (a scalar of per-token terms) depends on each entry of ``x``: its gradient
    there is not exactly 0 (NaN counts as live)."""
    leaf = x.detach().float().requires_grad_()
    (grad,) = torch.autograd.grad(loss(leaf), leaf)
    return grad != 0
