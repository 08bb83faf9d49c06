"""Built-in tasks (prompts, a programmatic reward, held-out prompts) and reward functions.

A reward function is called as ``f(prompts, completions, **fields)`` with lists of strings (the
prompts as the sampler saw them, a chat prompt rendered by its template) and, for each field that
any prompt row has besides its prompt, the list of its values (None for a row without it), so
every call gets the same keywords. It returns one real number per completion
(a Python, NumPy or 0-dim tensor number), or None for a completion it does not score (TRL's
convention: an environment's reward for another environment's rows). A completion's score is
the weighted sum of the scores it has; one no function scores gets 0, with a warning, as in TRL.
Its failures are reported with its name, never as a crash deep in the trainer.
"""

import importlib
import math
import numbers
import os
import random
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Callable

import torch

from ..rewards import gsm8k_reward
from .errors import RewardFailed, UsageError
from .fields import FLOAT32_MAX

# The largest score the trainer can hold: scores become fp32 tensors.

VOWELS = set("aeiou")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def vowels_reward(prompts, completions, **_):
    """Fraction of the completion's letters that are vowels (0 for a completion with no letters)."""
    scores = []
    for text in completions:
        letters = [c for c in text if c in LETTERS]
        scores.append(sum(c in VOWELS for c in letters) / len(letters) if letters else 0.0)
    return scores


def vowels_prompts(count: int = 256, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [{"prompt": "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 6)))} for _ in range(count)]


def arithmetic_example(rng: random.Random) -> tuple:
    """``("a+b=", "sum")`` for a, b in [0, 49]."""
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    return f"{a}+{b}=", str(a + b)


def arithmetic_reward(prompts, completions, **_):
    """1 when the completion is exactly the sum (its stop token excluded), else 0."""
    scores = []
    for prompt, text in zip(prompts, completions):
        a, b = prompt.rstrip("=").split("+")
        scores.append(float(text == str(int(a) + int(b))))
    return scores


def arithmetic_prompts(count: int = 2048, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [{"prompt": arithmetic_example(rng)[0]} for _ in range(count)]


def arithmetic_eval_prompts(count: int = 64, seed: int = 0) -> list:
    """``count`` additions that :func:`arithmetic_prompts` (same seed) never draws: held out."""
    seen = {row["prompt"] for row in arithmetic_prompts(seed=seed)}
    unseen = sorted({f"{a}+{b}=" for a in range(50) for b in range(50)} - seen)
    return [{"prompt": p} for p in random.Random(seed + 1).sample(unseen, min(count, len(unseen)))]


def vowels_eval_prompts(count: int = 64, seed: int = 0) -> list:
    return vowels_prompts(count, seed + 1)


MULTIPLY_SYSTEM = "Answer with the calculator tool, then reply with the number alone."
MULTIPLY_EXAMPLE = [  # one worked exchange, so a small model sees how a call looks
    {"role": "user", "content": "What is 512 * 34?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "512 * 34"}}}
        ],
    },
    {"role": "tool", "name": "calculator", "content": "17408"},
    {"role": "assistant", "content": "17408"},
]


def multiply_rows(count: int, seed: int) -> list:
    """``count`` chat prompts "What is a * b?" (a three-digit, b two-digit) after the worked example,
    with the product as ``answer``."""
    rng = random.Random(f"fastppo multiply {seed}")
    rows = []
    for _ in range(count):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        question = {"role": "user", "content": f"What is {a} * {b}?"}
        rows.append(
            {
                "prompt": [{"role": "system", "content": MULTIPLY_SYSTEM}, *MULTIPLY_EXAMPLE, question],
                "answer": str(a * b),
            }
        )
    return rows


def multiply_prompts(count: int = 1024, seed: int = 0) -> list:
    return multiply_rows(count, seed)


def multiply_eval_prompts(count: int = 64, seed: int = 0) -> list:
    """``count`` products that :func:`multiply_prompts` (same seed) never asks: held out."""
    seen = {row["prompt"][-1]["content"] for row in multiply_prompts(seed=seed)}  # the questions asked
    return [row for row in multiply_rows(4 * count, seed + 1) if row["prompt"][-1]["content"] not in seen][:count]


@dataclass(frozen=True)
class Task:
    prompts: Callable  # (seed=) -> rows, dicts with at least 'prompt'
    reward: Callable
    eval_prompts: Callable  # (seed=) -> rows held out from the training ones


TASKS = {
    "arithmetic": Task(arithmetic_prompts, arithmetic_reward, arithmetic_eval_prompts),
    "vowels": Task(vowels_prompts, vowels_reward, vowels_eval_prompts),
    # for a run with --tools calculator: a model of SmolLM2's size cannot multiply these unaided
    "multiply": Task(multiply_prompts, gsm8k_reward, multiply_eval_prompts),
}


def task_rows(task: str, seed: int, held_out: bool = False) -> tuple:
    """``(rows, origins)`` of a built-in task's training (or held-out) prompts, drawn with ``seed``."""
    rows = (TASKS[task].eval_prompts if held_out else TASKS[task].prompts)(seed=seed)
    kind = "held-out prompt" if held_out else "prompt"
    return rows, [f"task {task}, {kind} {i}" for i in range(len(rows))]


def load_reward(spec: str, format_pattern: str = None):
    """The reward function named by ``spec``: a built-in of :mod:`fastppo.rewards` (``gsm8k``,
    ``math``, ``boxed``, ``format``, the last with ``format_pattern``) or ``module:function``."""
    from .. import rewards

    if spec in rewards.BUILTIN:
        if spec != "format":
            return rewards.BUILTIN[spec]
        try:
            return rewards.format_reward(format_pattern) if format_pattern is not None else rewards.format_reward()
        except ValueError as error:
            raise UsageError(f"--format-pattern: {error}") from None
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UsageError(f"reward must be 'module:function' or one of {', '.join(rewards.BUILTIN)}, got {spec!r}")
    try:
        module = import_from_here(module_name)
    except ImportError as error:
        raise UsageError(f"reward {spec!r}: cannot import {module_name} ({error})") from None
    except Exception as error:  # a syntax error in it, or its own code raising as it is imported
        raise UsageError(f"reward {spec!r}: importing {module_name} raised {type(error).__name__}: {error}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"reward {spec!r}: {module_name} has no function {name}")
    return fn


def import_from_here(name: str):
    """``import name``, finding a module in the working directory as ``python -m`` would: the
    ``fastppo`` script, unlike ``python -m fastppo``, has no working directory on ``sys.path``."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        here = os.getcwd()
        if error.name != name.partition(".")[0] or here in sys.path:
            raise
        sys.path.insert(0, here)
        return importlib.import_module(name)


def configured_rewards(config, reward_fn=None, reward_model=None, environment=()) -> "Rewards":
    """A run's rewards: ``reward_fn`` (the Python API's), else each ``--reward`` and the
    ``--reward-model`` (made by ``reward_model(path)``), else the built-in task's; weighted by
    ``--reward-weights``; and the environments' ``[(name, function)]``, each with weight 1."""
    c = config.reward
    if reward_fn is not None:
        named = [(getattr(reward_fn, "__name__", "reward"), reward_fn)]
    else:
        named = [(spec, load_reward(spec, c.format_pattern)) for spec in c.reward or ()]
        if c.reward_model:
            named.append(("reward_model", reward_model(c.reward_model)))
    if not named and not environment:
        task = config.data.task
        if task not in TASKS:
            raise UsageError(f"no reward: task {task!r} is not built in and --reward is not given")
        named = [(task, TASKS[task].reward)]
    rewards = Rewards(named, c.reward_weights)
    rewards.named += environment
    rewards.weights += [1.0] * len(environment)
    return rewards


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
    within fp32's range, or None (no score)."""
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
        if not (math.isfinite(real) and abs(real) <= FLOAT32_MAX):
            raise UsageError(
                f"reward function {name} returned {real!r} for completion {i}: scores must be finite "
                f"and within float32's range (|score| <= {FLOAT32_MAX:.3g})"
            )
        values.append(real)
    return values
