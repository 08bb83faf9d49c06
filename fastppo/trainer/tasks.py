"""Built-in tasks (prompts and a programmatic reward) and loading user prompts and rewards.

A reward function is called as ``f(prompts, completions, **fields)`` with lists of strings and,
for each other field of the prompt rows, the list of its values; it returns one float per
completion. Its failures are reported with its name, never as a crash deep in the trainer.
"""

import importlib
import json
import math
import random
from pathlib import Path

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


def load_prompts(path: str) -> list:
    """Rows of a JSONL file; a line that is not a JSON object with a string 'prompt' is an error naming it."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line must be a JSON object with a string 'prompt' field")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def load_reward(spec: str):
    """The function named by 'module:function'."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"reward must be 'module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module_name), name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no function {name}")
    return fn


def score(reward_fn, prompts: list, completions: list, fields: dict) -> list:
    """Call the reward function and check what it returns: one finite float per completion."""
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    try:
        scores = list(reward_fn(prompts, completions, **fields))
    except Exception as error:
        raise RuntimeError(f"reward function {name} raised {type(error).__name__}: {error}") from error
    if len(scores) != len(completions):
        raise ValueError(f"reward function {name} returned {len(scores)} scores for {len(completions)} completions")
    for i, value in enumerate(scores):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"reward function {name} returned {value!r} for completion {i}: scores must be finite")
    return [float(s) for s in scores]
