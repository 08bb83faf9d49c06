"""Bench cases for slow tools in a multi-turn rollout: the fixed tool schedule against the eager one
(``fastppo/rollout/batching.py``), on SmolLM2-135M-Instruct and its 16 chat questions
(``sampler_real.py``), one row each.

Every row is an episode of up to ``TURNS`` turns. When the model ends a turn (its end-of-turn
token) its tool answers ``latency`` seconds later: a timer, as a remote service's reply would be,
costing this machine nothing, so what the rollout does meanwhile is all that differs. The answer is
the next user message in the model's chat template (SmolLM2's has no tool role), then the next
assistant turn's header. Decoding is
greedy, so both schedules draw the same episodes (up to the rounding of the batch sizes they pass
through: the note gives each one's tokens), and their seconds compare directly:

- **fixed**: a row resumes 16 decode steps after its turn ended, and if its tool is still running
  then, every row waits for it;
- **eager**: a row resumes at the first look after its tool answered, and the rollout waits only
  when no row can decode.

The note gives the seconds a rollout waited for tools with nothing else to do (its median call). At ``--quick``
sizes a tiny random Llama stands in (the suite's smoke test), its turns ended by any of a tenth of
its vocabulary.
"""

import time

import torch

import fastppo

from ..rollout.turns import Turns
from .case import Case, Contender, unavailable
from .sampler import tiny_model
from .sampler_real import QUESTIONS
from .smollm2 import Unavailable, load_smollm2

TURNS = 3  # an episode's turns: two tool answers between them
MAX_NEW = 96  # tokens the model draws in an episode
LATENCIES = (1.0, 5.0)  # seconds a tool takes to answer
ANSWER = "The lookup found nothing more. Please finish your answer."


class TimedTools(Turns):
    """Episodes whose every turn but the last is answered by a tool after ``latency`` seconds."""

    def __init__(self, latency: float, answer: list):
        self.latency, self.answer = latency, answer
        self.turns, self.due = {}, {}

    def turn_ended(self, row, turn, may_continue):
        self.turns[row] = self.turns.get(row, 0) + 1
        if not may_continue or self.turns[row] >= TURNS:
            return False
        self.due[row] = time.monotonic() + self.delay(row)
        return True

    def delay(self, row: int) -> float:
        """Seconds row ``row``'s tool takes to answer its current turn."""
        return self.latency

    def ready(self, row):
        return time.monotonic() >= self.due[row]

    def continuation(self, row, room):
        time.sleep(max(0.0, self.due[row] - time.monotonic()))
        return self.answer

    def truncated(self, row):
        return None


def chat_episodes(tokenizer) -> tuple:
    """The questions' prompts, the tool's answer after a turn (up to the next assistant header) and
    the end-of-turn id."""

    def ids(messages, generation_prompt):
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
            )["input_ids"]
        )

    prompts = [ids([{"role": "user", "content": q}], True) for q in QUESTIONS]
    turn = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    before = ids(turn, False)
    after = ids([*turn, {"role": "user", "content": ANSWER}], True)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer = after[before.index(end, len(before) - 3) + 1 :]  # what follows the assistant's end of turn
    return prompts, answer, (end,)


def tool_latency_cases(device: torch.device, quick: bool) -> list:
    """One case per tool latency; without the model, one case saying how to get it."""
    names = ["fixed schedule (16 steps)", "eager schedule"]
    if quick:
        model = tiny_model(device, quick=True)
        prompts = [[(7 * i + j) % 1000 for j in range(12 + i)] for i in range(4)]
        answer, stop, latencies = [5, 6, 7], tuple(range(0, 1000, 10)), (0.02,)
    else:
        try:
            model, tokenizer = load_smollm2(device)
        except Unavailable as why:
            return [unavailable("tools", "SmolLM2-135M-Instruct", names, why)]
        (prompts, answer, stop), latencies = chat_episodes(tokenizer), LATENCIES
    longest = max(map(len, prompts)) + MAX_NEW + (TURNS - 1) * len(answer)
    sampler = fastppo.Sampler(model, max_batch_size=len(prompts), max_seq_len=longest)
    cases = []
    for latency in latencies:
        waits = {}  # contender -> (seconds waited for tools, tokens drawn) of each call

        def contender(name, schedule, latency=latency, waits=waits):
            def rollout(x):
                out = sampler.generate(
                    prompts,
                    max_new_tokens=MAX_NEW,
                    temperature=0,
                    stop_token_ids=stop,
                    turns=TimedTools(latency, answer),
                    tool_schedule=schedule,
                )
                waits.setdefault(name, []).append((sampler.tool_wait_seconds, int(out.response_mask.sum())))
                return out.response_ids

            def note(x):
                # the median call: the memory measurement's, made last, runs its ops far slower
                waited, tokens = sorted(waits[name])[len(waits[name]) // 2]
                return f"{tokens} tokens drawn; waited {waited:.2f} s for tools (median call)"

            return Contender(name, rollout, baseline=schedule == "fixed", note=note)

        label = (
            f"{'tiny Llama' if quick else 'SmolLM2-135M'}: {len(prompts)} questions, greedy episodes of up to "
            f"{TURNS} turns and {MAX_NEW} drawn tokens, each tool answering after {latency:g} s"
        )
        cases.append(
            Case(
                "tools",
                label,
                dict,
                [contender(names[0], "fixed"), contender(names[1], "eager")],
                bytes_fwd=1,  # a rollout's seconds are the measure here, not its bytes
            )
        )
    return cases
