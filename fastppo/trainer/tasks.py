"""Built-in tasks (prompts and a programmatic reward) and loading user prompts and rewards.

A reward function is called as ``f(prompts, completions, **fields)`` with lists of strings and,
for each field that any prompt row has besides ``prompt``, the list of its values (None for a
row without it), so every call gets the same keywords. It returns one real number per completion
(a Python, NumPy or 0-dim tensor number). Its failures are reported with its name, never as a
crash deep in the trainer.
"""

import importlib
import json
import math
import numbers
import random
from pathlib import Path

import torch

from .errors import UsageError

# The largest score the trainer can hold: scores become fp32 tensors.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)

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


# task name -> (prompt rows, reward function); the rows are dicts with at least 'prompt'
TASKS = {"arithmetic": (arithmetic_prompts, arithmetic_reward), "vowels": (vowels_prompts, vowels_reward)}


def configured_prompts(data, seed: int) -> tuple:
    """``(rows, origins)`` of a run: the ``--prompts`` file's (see :func:`load_prompts`), else the
    built-in task's, drawn with ``seed``."""
    if data.prompts:
        return load_prompts(data.prompts)
    rows = TASKS[data.task][0](seed=seed)
    return rows, [f"task {data.task}, prompt {i}" for i in range(len(rows))]


def load_prompts(path: str) -> tuple:
    """``(rows, origins)`` of a JSONL file: the JSON objects with a non-empty string 'prompt', and
    ``"path:line"`` of each; any other line (blank ones aside) is an error naming it."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise UsageError(f"--prompts {path}: {error.strerror or error}") from None
    rows, origins = [], []
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UsageError(f"{path}:{number}: not UTF-8 text (byte {error.start} of the line)") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UsageError(f"{path}:{number}: each line must be a JSON object with a string 'prompt' field")
        if not row["prompt"]:
            raise UsageError(f"{path}:{number}: the prompt is empty")
        rows.append(row)
        origins.append(f"{path}:{number}")
    if not rows:
        raise UsageError(f"{path}: no prompts")
    return rows, origins


def field_names(rows: list) -> list:
    """Every field besides 'prompt' that any row has, in order of first appearance."""
    return list(dict.fromkeys(k for row in rows for k in row if k != "prompt"))


def load_reward(spec: str):
    """The function named by 'module:function'."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UsageError(f"reward must be 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"reward {spec!r}: cannot import {module_name} ({error})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"reward {spec!r}: {module_name} has no function {name}")
    return fn


def _real(value):
    """``value`` as a float if it is one real number (Python, NumPy, 0-dim tensor), else None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def score(reward_fn, prompts: list, completions: list, fields: dict) -> list:
    """Call the reward function and check what it returns: one finite real number per completion,
    within fp32's range."""
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    try:
        scores = list(reward_fn(prompts, completions, **fields))
    except Exception as error:
        raise RuntimeError(f"reward function {name} raised {type(error).__name__}: {error}") from error
    if len(scores) != len(completions):
        raise UsageError(f"reward function {name} returned {len(scores)} scores for {len(completions)} completions")
    values = []
    for i, value in enumerate(scores):
        real = _real(value)
        if real is None:
            raise UsageError(f"reward function {name} returned {type(value).__name__} {value!r} for completion "
                             f"{i}: scores must be real numbers")
        if not (math.isfinite(real) and abs(real) <= FLOAT32_MAX):
            raise UsageError(f"reward function {name} returned {real!r} for completion {i}: scores must be finite "
                             f"and within float32's range (|score| <= {FLOAT32_MAX:.3g})")
        values.append(real)
    return values
