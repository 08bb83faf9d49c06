"""Argument checks shared by the public ops.

Every error names the argument and what was seen, so a user never has to read a stack trace
from inside a kernel. Checks here look at metadata only (shapes, dtypes, devices) and never
synchronise with the device; the value checks that need a sync (label ranges, temperature
signs, mask values) run only when ``FASTPPO_CHECK=1`` is set. Without it a bad value at a valid
position is made visible instead: it turns the op's result into NaN, never a finite number.
"""

import math
import numbers
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The label of a position that does not count: PyTorch's cross-entropy default, which peers pass too.
IGNORE_INDEX = -100


def is_real(x) -> bool:
    """Whether ``x`` is one real number: Python's, or NumPy's (``np.float32(0.5)``), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def value_checks_enabled() -> bool:
    """True when ``FASTPPO_CHECK=1``: ops then also check values, at the cost of a host sync."""
    return os.environ.get("FASTPPO_CHECK", "0") == "1"


def check_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_floating(x, name: str) -> None:
    """``x`` is a tensor of any floating dtype."""
    check_tensor(x, name)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")


def check_float(x, name: str, *, min_dim: int = 1) -> None:
    """``x`` is a fp32/bf16/fp16 tensor with at least ``min_dim`` dimensions."""
    check_tensor(x, name)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(x.shape)}")


def check_same_device(device: torch.device, owner: str, **others) -> None:
    """Every tensor in ``others`` (None allowed) lives on ``device``, the device of ``owner``."""
    for name, x in others.items():
        if x is not None and x.device != device:
            raise ValueError(f"{name} is on {x.device} but {owner} is on {device}")


def check_token_tensor(x, name: str, like: torch.Tensor, like_name: str) -> None:
    """``x`` is a floating tensor of exactly ``like``'s shape (no broadcasting), on its device."""
    check_floating(x, name)
    if x.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but {like_name} has {tuple(like.shape)}")
    check_same_device(like.device, like_name, **{name: x})


def check_integer(x, name: str) -> None:
    """``x`` is a tensor of integer ids: not bool (True is no token id), not floating."""
    check_tensor(x, name)
    if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")


def check_vocabulary(size: int, name: str) -> None:
    if size == 0:
        raise ValueError(f"{name} has a vocabulary of 0 entries; a distribution needs at least one")


def check_labels(labels, lead: torch.Size, lead_name: str) -> None:
    """``labels`` is an integer tensor whose shape is exactly ``lead`` (no broadcasting)."""
    check_integer(labels, "labels")
    if labels.shape != lead:
        raise ValueError(
            f"labels must have shape {tuple(lead)} (the leading dims of {lead_name}), got {tuple(labels.shape)}"
        )


def check_label_values(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """With ``FASTPPO_CHECK=1``: every label is in [0, V) or equals ``ignore_index``."""
    if not value_checks_enabled():
        return
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    if bool(bad.any()):
        example = labels[bad].flatten()[0].item()
        raise ValueError(
            f"labels has {int(bad.sum())} value(s) outside [0, {vocab_size}) that are not "
            f"ignore_index={ignore_index}, e.g. {example}"
        )


def normalize_temperature(temperature, lead: torch.Size, device: torch.device):
    """Return ``(per_row, inv_scalar)``: a ``(N,)`` fp32 tensor or None, and 1 / the scalar.

    A Python number applies to every row. A tensor must broadcast to ``lead`` (e.g. ``(B, 1)``
    for per-sequence temperatures over ``(B, T)`` tokens); it is not differentiated through.
    """
    if isinstance(temperature, torch.Tensor):
        check_floating(temperature, "temperature")
        check_same_device(device, "the inputs", temperature=temperature)
        try:
            shape = torch.broadcast_shapes(temperature.shape, lead)
        except RuntimeError:
            shape = None
        if shape != lead:
            raise ValueError(
                f"temperature of shape {tuple(temperature.shape)} does not broadcast to the token shape {tuple(lead)}"
            )
        per_row = temperature.detach().to(torch.float32).expand(lead).reshape(-1)  # (N,)
        usable = (per_row > 0) & per_row.isfinite()
        # checked where that costs no device sync (a CPU tensor), or everywhere with FASTPPO_CHECK=1
        if (temperature.device.type == "cpu" or value_checks_enabled()) and not bool(usable.all()):
            bad = per_row[~usable][0].item()
            raise ValueError(f"temperature must be positive and finite everywhere, got {bad} at a row")
        # On a device, a row at a temperature <= 0 (or NaN, inf) has no distribution: its log-prob is NaN.
        return torch.where(usable, per_row, float("nan")), 1.0
    if not is_real(temperature):
        raise TypeError(f"temperature must be a positive number or a tensor, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    return None, 1.0 / float(temperature)


def check_number(x, name: str, *, minimum=None, above=None) -> float:
    """``x`` as a float: a finite Python number (not a bool), ``>= minimum`` and ``> above`` if given."""
    if not is_real(x) or not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x!r}")
    if above is not None and x <= above:
        raise ValueError(f"{name} must be > {above}, got {x!r}")
    return float(x)


def check_coefficients(clip_eps, clip_eps_high, kl_coef, entropy_coef) -> tuple:
    """The one rule of every PPO loss's coefficients, as ``(clip_low, clip_high, kl_coef,
    entropy_coef)`` floats: ``0 <= clip_eps < 1`` (the ratio's lower bound ``1 - clip_eps`` stays
    positive), ``clip_eps_high >= 0`` (None: ``clip_eps``), ``kl_coef >= 0`` (a negative one would
    reward moving away from the reference) and ``entropy_coef >= 0``."""
    clip_low = check_number(clip_eps, "clip_eps", minimum=0.0)
    if clip_low >= 1:
        raise ValueError(f"clip_eps must be < 1 (the ratio's lower bound is 1 - clip_eps), got {clip_eps!r}")
    clip_high = clip_low if clip_eps_high is None else check_number(clip_eps_high, "clip_eps_high", minimum=0.0)
    return (
        clip_low,
        clip_high,
        check_number(kl_coef, "kl_coef", minimum=0.0),
        check_number(entropy_coef, "entropy_coef", minimum=0.0),
    )


def check_ignore_index(ignore_index) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def check_mask(mask, like: torch.Tensor, like_name: str, name: str = "mask") -> tuple:
    """``(valid, invalid)`` of a token mask of ``like``'s exact shape and device.

    ``valid`` is bool: true where ``mask`` is nonzero. A bool mask is used as is and ``invalid``
    is None. A numeric mask must hold only 0 and 1; ``invalid`` marks any other value (0.5, -1,
    NaN), which with ``FASTPPO_CHECK=1`` is a ``ValueError`` and otherwise poisons the result
    with NaN (see :func:`poison`), so a mask that is not a mask never gives a finite number.
    """
    check_tensor(mask, name)
    if mask.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but {like_name} has {tuple(like.shape)}")
    check_same_device(like.device, like_name, **{name: mask})
    if mask.dtype == torch.bool:
        return mask, None
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or hold 0/1 numbers, got {mask.dtype}")
    valid = mask != 0
    invalid = valid & (mask != 1)
    if value_checks_enabled() and bool(invalid.any()):
        example = mask[invalid].flatten()[0].item()
        raise ValueError(
            f"{name} must hold only 0 and 1 (or be bool); it has {int(invalid.sum())} other value(s), e.g. {example}"
        )
    return valid, invalid


def poison(x: torch.Tensor, invalid) -> torch.Tensor:
    """``x`` with NaN where ``invalid`` (from :func:`check_mask`) is true; ``x`` itself when None."""
    return x if invalid is None else torch.where(invalid, float("nan"), x)


def as_tokens(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous ``(N,)`` tensor, which the token kernels index with stride 1.

    ``reshape(-1)`` alone keeps a 1-D view's stride (``x[:, 1]`` of a ``(B, T)`` tensor has
    stride T), so this copies whenever the flat view would not be dense.
    """
    return x.reshape(-1).contiguous()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``(..., V)`` as ``(B, T, V)`` for the kernels, without copying when strides allow.

    Two leading dims stay as they are, so a slice like ``logits[:, :-1]`` is read in place.
    """
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(0)
    return x.flatten(0, -3)
