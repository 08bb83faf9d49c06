"""``gae``: generalised advantage estimation over masked token sequences, in one kernel launch.

A custom op with a fake implementation, so compiled trainers trace through it. It has no
gradient: advantages and returns are targets, so the inputs are detached.
"""

import math

import torch
from torch import Tensor

from . import checks
from .dispatch import implementation, resolve_backend


@torch.library.custom_op("fastppo::gae", mutates_args=())
def _gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, backend: str
) -> tuple[Tensor, Tensor]:
    # (B, T) inputs, any strides -> advantages, returns: (B, T) fp32 contiguous
    advantages = torch.empty(rewards.shape, dtype=torch.float32, device=rewards.device)
    returns = torch.empty_like(advantages)
    implementation(backend, "gae").gae(rewards, values, mask, gamma, lam, advantages, returns)
    return advantages, returns


@_gae.register_fake
def _(rewards, values, mask, gamma, lam, backend):
    out = rewards.new_empty(rewards.shape, dtype=torch.float32)
    return out, torch.empty_like(out)


def _check_unit_interval(x, name: str) -> float:
    if not checks.is_real(x) or not math.isfinite(x) or not 0 <= x <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {x!r}")
    return float(x)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 0.95, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Advantages and returns by GAE, skipping masked positions as if they were absent.

    For each row the valid positions, in order, are the trajectory. For a valid ``t`` whose next
    valid position is ``t'``::

        delta_t = r_t + gamma * V_t' - V_t        (V_t' = 0 when t is the last valid position)
        A_t     = delta_t + gamma * lam * A_t'    (A_t' = 0 likewise)
        returns = A_t + V_t

    Args:
        rewards, values: ``(B, T)`` floating tensors (any dtype and strides).
        mask: ``(B, T)`` bool or 0/1, true where the position belongs to the trajectory.
        gamma, lam: discount and GAE lambda, each in [0, 1].
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see :func:`fastppo.token_logprobs`).

    Masked positions may hold anything (NaN, inf): they change nothing. A NaN at a valid
    position, or a mask value other than 0/1, gives NaN advantages (from there leftwards).

    Returns:
        ``(advantages, returns)``, fp32 ``(B, T)``, exactly 0 at masked positions. No gradient
        flows through them.
    """
    for name, x in (("rewards", rewards), ("values", values)):
        checks.check_floating(x, name)
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape (B, T), got {tuple(x.shape)}")
    if values.shape != rewards.shape:
        raise ValueError(f"values has shape {tuple(values.shape)} but rewards has {tuple(rewards.shape)}")
    checks.check_same_device(rewards.device, "rewards", values=values)
    valid, invalid = checks.check_mask(mask, rewards, "rewards")
    gamma = _check_unit_interval(gamma, "gamma")
    lam = _check_unit_interval(lam, "lam")
    backend = resolve_backend(backend, rewards.device)
    return _gae(checks.poison(rewards.detach(), invalid), values.detach(), valid, gamma, lam, backend)
