"""Rewards: the built-in verifiers, reward specs, scoring and the reward model.

The built-in verifiers (``verifiers.py``, also importable from here as
``fastppo.rewards.gsm8k_reward`` and so on), a reward function named by its spec (``loading.py``),
each function's scores checked and several summed by weight (``scoring.py``), and a reward model as
a reward function (``model.py``)."""

from .verifiers import (
    BUILTIN,
    THINK_ANSWER,
    answer_text,
    boxed_reward,
    extract_boxed,
    format_reward,
    gsm8k_answer,
    gsm8k_reward,
    math_reward,
)

__all__ = [
    "BUILTIN",
    "THINK_ANSWER",
    "answer_text",
    "boxed_reward",
    "extract_boxed",
    "format_reward",
    "gsm8k_answer",
    "gsm8k_reward",
    "math_reward",
]
