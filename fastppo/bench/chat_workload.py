"""The GRPO workload a practitioner runs, for the update benches and ``--versus-trl``: chat prompts
of 150-300 tokens, 8 samples per prompt, answers with a long tail up to 128 new tokens, and a
verifier as the reward.

Each prompt is a system message and a user message holding one or two worked examples (a short
word problem, its working, the answer after ``####``) before the question; the reward is
:func:`fastppo.rewards.gsm8k_reward` against the true answer. With SmolLM2-135M-Instruct's chat
template the prompts are 150-300 tokens, so in a group of 8 most of the tokens a padded forward
processes are copies of the prompt, and the answers' lengths vary from a few tokens to the cap.
"""

import json
import random
from pathlib import Path

SYSTEM = (
    "You are a careful math tutor. Work each problem out in a few short steps, then give the final "
    "answer as a number on its own line after ####."
)


def _problem(rng: random.Random) -> tuple:
    """``(question, working, answer)`` of a two-step shop problem."""
    have, boxes, each, sold = rng.randint(10, 90), rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 9)
    bought = boxes * each
    total = have + bought - sold
    question = (
        f"A shop has {have} apples. It buys {boxes} boxes with {each} apples in each box, then sells "
        f"{sold} apples. How many apples does the shop have now?"
    )
    working = f"It buys {boxes} x {each} = {bought} apples. {have} + {bought} = {have + bought}. "
    working += f"After selling {sold}: {have + bought} - {sold} = {total}."
    return question, working, total


def rows(count: int, seed: int = 0) -> list:
    """``count`` prompts as chat messages, each with its ``answer`` (``"#### N"``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        examples = []
        for _ in range(rng.randint(1, 2)):
            question, working, total = _problem(rng)
            examples.append(f"Problem: {question}\nSolution: {working}\n#### {total}")
        question, _, total = _problem(rng)
        user = "Here are worked examples.\n\n" + "\n\n".join(examples) + f"\n\nNow solve this one.\nProblem: {question}"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        out.append({"prompt": messages, "answer": f"#### {total}"})
    return out


def write_prompts(directory: Path, count: int, seed: int = 0) -> Path:
    """The prompts as a JSONL file for ``fastppo train --prompts`` (with ``--reward gsm8k``)."""
    path = Path(directory) / "chat_prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows(count, seed)))
    return path


def train_fields(directory: Path, samples: int = 8, max_new_tokens: int = 128, count: int = 256) -> dict:
    """The config fields of a ``fastppo train`` run of this workload (prompts written under ``directory``)."""
    return {
        "prompts": str(write_prompts(directory, count)),
        "reward": ["gsm8k"],
        "samples_per_prompt": samples,
        "max_new_tokens": max_new_tokens,
        "estimator": "grpo",
    }
