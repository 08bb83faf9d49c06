"""Scores: each reward function called and its result checked, and several functions' scores summed
by their weights.

A reward function is called as ``f(prompts, completions, **fields)`` with lists of strings (the
prompts as the sampler saw them, a chat prompt rendered by its template) and, for each field that
any prompt row has besides its prompt, the list of its values (None for a row without it), so
every call gets the same keywords. It returns one real number per completion
(a Python, NumPy or 0-dim tensor number), or None for a completion it does not score (TRL's
convention: an environment's reward for another environment's rows). A completion's score is
the weighted sum of the scores it has; one no function scores gets 0, with a warning, as in TRL.
Its failures are reported with its name, never as a crash deep in the trainer.
"""

import math
import numbers
import warnings
from collections.abc import Iterable, Mapping

import torch

from ..errors import RewardFailed, UsageError
from ..limits import FLOAT32_MAX


class Rewards:
    """Several reward functions and their weights: a completion's score is the weighted sum of
    theirs (the trainer logs each function's mean under ``reward/<name>``)."""

    def __init__(self, named: list, weights=None):
        if weights is not None and len(weights) != len(named):
            raise UsageError(
                f"--reward-weights has {len(weights)} weight(s) for {len(named)} reward(s) "
                f"({', '.join(name for name, _ in named)}): give one per reward"
            )
        self.named = named
        self.weights = list(weights) if weights is not None else [1.0] * len(named)

    def check_fields(self, fields: list, origins: list) -> None:
        """Each function's ``needs`` (the fields a verifier reads) present in every row."""
        for name, fn in self.named:
            for needed in getattr(fn, "needs", ()):
                for row, origin in zip(fields, origins):
                    if row.get(needed) is None:
                        raise UsageError(
                            f"reward {name} needs an {needed!r} field in every row, and {origin} has "
                            f"none (map a column to it with --field-map column={needed})"
                        )

    def __call__(self, prompts: list, completions: list, fields: dict) -> tuple:
        """``(scores, each)``: the weighted sum per completion of the scores it has, and ``{name:
        scores}`` of each function (NaN where it gave None)."""
        total, each, scored = [0.0] * len(completions), {}, [False] * len(completions)
        for (name, fn), weight in zip(self.named, self.weights):
            values = score(fn, prompts, completions, fields)
            each[name] = [math.nan if v is None else v for v in values]
            for i, value in enumerate(values):
                if value is not None:
                    total[i] += weight * value
                    scored[i] = True
        unscored = [i for i, s in enumerate(scored) if not s]
        if unscored:
            warnings.warn(
                f"no reward function scored {len(unscored)} of {len(completions)} completions (each returned "
                f"None for them, the first {unscored[0]}): their score is 0"
            )
        return total, each


def _real(value):
    """``value`` as a float if it is one real number (Python, NumPy, 0-dim tensor), else None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return float(value.item())
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:  # an int past float's range (10**400): infinite as a score
            return math.inf if value > 0 else -math.inf
    return None


def score(reward_fn, prompts: list, completions: list, fields: dict) -> list:
    """Call the reward function and check what it returns: one finite real number per completion,
    within fp32's range, or None or NaN (no score, as TRL reads both)."""
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    try:  # copies: a function that changes its lists in place changes nothing here
        returned = reward_fn(list(prompts), list(completions), **{k: list(v) for k, v in fields.items()})
    except (Exception, SystemExit) as error:  # sys.exit() in a reward ends the run as a failure, not a success
        raise RewardFailed(f"reward function {name} raised {type(error).__name__}: {error}") from error
    if (
        isinstance(returned, (Mapping, str, bytes, set))
        or not isinstance(returned, Iterable)
        or (isinstance(returned, torch.Tensor) and returned.dim() != 1)
    ):
        kind = f"a {returned.dim()}-dim tensor" if isinstance(returned, torch.Tensor) else type(returned).__name__
        raise UsageError(
            f"reward function {name} returned {kind}; it must return one real number (or None) per "
            "completion, in order (a list, tuple, NumPy array or 1-dim tensor)"
        )
    scores = list(returned)
    if len(scores) != len(completions):
        raise UsageError(f"reward function {name} returned {len(scores)} scores for {len(completions)} completions")
    values = []
    for i, value in enumerate(scores):
        if value is None:
            values.append(None)
            continue
        real = _real(value)
        if real is None:
            raise UsageError(
                f"reward function {name} returned {type(value).__name__} {value!r} for completion "
                f"{i}: scores must be real numbers (or None: no score)"
            )
        if math.isnan(real):  # no score, as TRL reads a NaN
            values.append(None)
            continue
        if isinstance(value, numbers.Integral) and math.isinf(real):
            raise UsageError(
                f"reward function {name} returned an integer of {len(str(abs(int(value))))} digits for "
                f"completion {i}: it is out of float range (|score| <= {FLOAT32_MAX:.3g})"
            )
        if not (math.isfinite(real) and abs(real) <= FLOAT32_MAX):
            raise UsageError(
                f"reward function {name} returned {real!r} for completion {i}: scores must be finite "
                f"and within float32's range (|score| <= {FLOAT32_MAX:.3g})"
            )
        values.append(real)
    return values
