"""Built-in tasks: their prompts, their programmatic reward and their held-out prompts, drawn from a
seed. ``arithmetic`` is the embedded default's; ``multiply`` is for a run with the calculator tool.
"""

import random
from dataclasses import dataclass
from typing import Callable

from ...rewards.verifiers import gsm8k_reward

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
