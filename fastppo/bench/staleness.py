"""``fastppo bench --async``: rollouts that never drain (``--max-staleness K``) against rollouts that
drain, K = 0, 1 and 2 side by side in one run.

Three measures, each K's run on the same machine one after the other:

- **long tail**: batches of 2 chat questions x 8 samples on SmolLM2-135M-Instruct, each row drawing
  exactly its budget (a log-normal of median 24 tokens, capped at 128: most rows short, a few at
  the cap), sampled at temperature 1, through a :class:`~fastppo.rollout.stream.RolloutStream`
  whose weights are refreshed between batches as after an update (the packed copy made again, a
  pass over the weights, counted). K = 0 is today's rollout: each batch drains before the next
  (the stream at ``ahead=0`` is ``generate``, bitwise). Seconds per batch and generated tokens per
  second over the same batches, the decode steps' occupancy, and the stale tokens' share.
- **tools**: episodes of up to 3 turns whose tools answer after 1 s, and after 0.5-2 s (each
  call its own delay, fixed by its row and turn), batches of 4 questions x 4 samples: the fixed
  schedule at K = 0 (today), then the eager schedule at K = 0, 1 and 2.
- **learning**: the shipped task (``fastppo train``'s default) at K = 0 and K = 1, three seeds:
  the reward (a moving mean of 10 iterations) against the seconds trained, and when K = 1 first
  reaches K = 0's final reward.

Update time is not in the first two (it is the same at every K on one device): they time the
rollout, which is what staleness changes. ``--quick`` runs a tiny random Llama instead of SmolLM2,
for the suite's smoke test.
"""

import contextlib
import io
import math
import time

import torch

import fastppo

from .sampler import tiny_model
from .sampler_real import QUESTIONS, long_tail_lengths
from .smollm2 import Unavailable, load_smollm2
from .tool_latency import TURNS, TimedTools, chat_episodes

AHEAD = (0, 1, 2)
BATCHES = 6  # long-tail batches per K
TAIL_CAP = 128  # the long tail's budget
TOOL_BATCHES = 4
TOOL_NEW = 96  # tokens an episode draws
LEARNING_ITERATIONS = 60
SMOOTH = 10  # iterations in the learning curve's moving mean
SEEDS = (0, 1, 2)


class SpreadTools(TimedTools):
    """Tools whose every call answers after its own delay in ``[low, high]`` seconds, fixed by the
    call's row and turn (a golden-ratio sequence: spread, and the same at every K)."""

    def __init__(self, low: float, high: float, answer: list):
        super().__init__(low, answer)
        self.low, self.high = low, high

    def delay(self, row: int) -> float:
        step = (row * TURNS + self.turns[row]) * 0.6180339887
        return self.low + (self.high - self.low) * (step - math.floor(step))


def _model(device: torch.device, quick: bool):
    """``(model, name, chat prompts, tool answer, end-of-turn ids)``."""
    if quick:
        model = tiny_model(device, quick=True)
        prompts = [[(7 * i + j) % 1000 for j in range(12 + i)] for i in range(len(QUESTIONS))]
        return model, "tiny random Llama", prompts, [5, 6, 7], tuple(range(0, 1000, 10))
    model, tokenizer = load_smollm2(device)
    prompts, answer, stop = chat_episodes(tokenizer)
    return model, "SmolLM2-135M-Instruct", prompts, answer, stop


def _streamed(sampler, ahead: int, batches: list, stream_options: dict, add) -> dict:
    """Run ``batches`` through a stream ``ahead`` batches ahead; ``add(stream, k)`` queues batch k.
    The seconds, the tokens drawn, the occupancy and the stale share."""
    stream = sampler.stream(ahead=ahead, **stream_options)
    added, tokens, steps, live, sparse, stale, waited = 0, 0, 0, 0, 0, 0, 0.0
    start = time.perf_counter()
    for k in range(len(batches)):
        while added < len(batches) and added <= k + ahead:
            add(stream, added)
            added += 1
        rollout = stream.next(version=k)
        drawn = rollout.response_mask
        tokens += int(drawn.sum())
        stale += int((rollout.versions[drawn] < k).sum())
        steps, live, sparse = steps + stream.steps, live + stream.live_rows, sparse + stream.sparse_steps
        waited += stream.tool_wait_seconds
    seconds = time.perf_counter() - start
    return {
        "ahead": ahead,
        "seconds_per_batch": seconds / len(batches),
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "rows_per_step": live / max(steps, 1),
        "sparse_steps": sparse / max(steps, 1),
        "stale_share": stale / max(tokens, 1),
        "tool_wait_per_batch": waited / len(batches),
    }


def long_tail(model, prompts: list, quick: bool) -> dict:
    """The long-tail rollouts at each K (see the module's docstring)."""
    n, per_batch, batches = 8, 2, 2 if quick else BATCHES
    cap = 16 if quick else TAIL_CAP
    chosen = [[prompts[(k * per_batch + j) % len(prompts)] for j in range(per_batch)] for k in range(batches)]
    budgets = [long_tail_lengths(per_batch * n, cap, seed=k) for k in range(batches)]
    sampler = fastppo.Sampler(model, max_batch_size=per_batch * n, max_seq_len=max(map(len, prompts)) + cap)
    options = dict(
        prompts_per_batch=per_batch,
        max_new_tokens=cap,
        temperature=1.0,
        num_samples_per_prompt=n,
        seed=0,
        stop_token_ids=(),
    )
    runs = [
        _streamed(sampler, ahead, chosen, options, lambda s, k: s.add(chosen[k], max_new_tokens=budgets[k]))
        for ahead in AHEAD
    ]
    median = sorted(b for batch in budgets for b in batch)[len(budgets) * per_batch * n // 2]
    return {"batches": batches, "rows": per_batch * n, "cap": cap, "median_budget": median, "runs": runs}


def tools(model, prompts: list, answer: list, stop: tuple, quick: bool) -> dict:
    """The tools workload at each schedule and K, for each spread of tool latencies."""
    n, per_batch, batches = 4, 4, 2 if quick else TOOL_BATCHES
    new = 12 if quick else TOOL_NEW
    chosen = [[prompts[(k * per_batch + j) % len(prompts)] for j in range(per_batch)] for k in range(batches)]
    longest = max(map(len, prompts)) + new + (TURNS - 1) * len(answer)
    sampler = fastppo.Sampler(model, max_batch_size=per_batch * n, max_seq_len=longest)
    spreads = [(0.02, 0.02)] if quick else [(1.0, 1.0), (0.5, 2.0)]
    out = []
    for low, high in spreads:
        runs = []
        for schedule, ahead in (("fixed", 0), ("eager", 0), ("eager", 1), ("eager", 2)):
            options = dict(
                prompts_per_batch=per_batch,
                max_new_tokens=new,
                temperature=1.0,
                num_samples_per_prompt=n,
                seed=0,
                stop_token_ids=stop,
                episodes=True,
                tool_schedule=schedule,
            )

            def add(stream, k, low=low, high=high):  # each batch's episodes, its own tools
                stream.add(chosen[k], SpreadTools(low, high, answer))

            runs.append({"schedule": schedule, **_streamed(sampler, ahead, chosen, options, add)})
        out.append({"latency": [low, high], "runs": runs})
    return {"batches": batches, "rows": per_batch * n, "max_new_tokens": new, "spreads": out}


def learning(quick: bool) -> dict:
    """The shipped task at K = 0 and 1, for each of ``SEEDS`` (the runs alternating, so the machine's
    drift falls on both): the reward's moving mean by the seconds trained, and when K = 1's first
    reaches K = 0's final one."""
    import tempfile

    from ..trainer import PPOTrainer, TrainConfig

    iterations = 4 if quick else LEARNING_ITERATIONS
    runs = []
    for seed in SEEDS[:1] if quick else SEEDS:
        curves = {}
        for ahead in (0, 1):
            with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):  # its summaries
                fields = dict(
                    out=out, iterations=iterations, evaluate=False, save=False, max_staleness=ahead, seed=seed
                )
                history = PPOTrainer(TrainConfig.from_flat(fields).validate()).train()
            seconds, curve = 0.0, []
            for i, row in enumerate(history):
                seconds += row["time_rollout"] + row["time_forward"] + row["time_update"]
                window = history[max(0, i - SMOOTH + 1) : i + 1]
                curve.append([seconds, sum(r["reward_mean"] for r in window) / len(window)])
            curves[str(ahead)] = curve
        target = curves["0"][-1][1]
        reached = next((s for s, reward in curves["1"] if reward >= target), None)
        runs.append({"seed": seed, "target": target, "k1_reached_at": reached, "curves": curves})
    return {"iterations": iterations, "runs": runs}


def compare(device: torch.device, quick: bool) -> dict:
    try:
        model, name, prompts, answer, stop = _model(device, quick)
    except Unavailable as why:
        raise SystemExit(f"fastppo bench --async: {why}") from None
    return {
        "model": name,
        "long_tail": long_tail(model, prompts, quick),
        "tools": tools(model, prompts, answer, stop, quick),
        "learning": learning(quick),
    }


def _table(columns: list, rows: list) -> list:
    """A markdown table's lines: ``columns`` (names), then ``rows`` (lists of cells)."""
    return [f"| {' | '.join(columns)} |", f"|{' --- |' * len(columns)}", *(f"| {' | '.join(r)} |" for r in rows)]


def markdown(result: dict, machine: str) -> str:
    """The three tables, each K's figures beside K = 0's."""
    tail, t, learn = result["long_tail"], result["tools"], result["learning"]
    base = tail["runs"][0]["tokens_per_s"]
    lines = [
        f"# Rollouts that never drain: {result['model']}, {machine}",
        "",
        f"## Long tail: {tail['batches']} batches of {tail['rows']} rows, budgets median {tail['median_budget']}, "
        f"cap {tail['cap']}",
        "",
        *_table(
            ["K", "s per batch", "tokens/s", "vs K=0", "rows per step", "steps under 1/4 full", "stale tokens"],
            [
                [
                    str(run["ahead"]),
                    f"{run['seconds_per_batch']:.2f}",
                    f"{run['tokens_per_s']:.0f}",
                    f"{run['tokens_per_s'] / base:.2f}x",
                    f"{run['rows_per_step']:.1f}",
                    f"{run['sparse_steps']:.0%}",
                    f"{run['stale_share']:.0%}",
                ]
                for run in tail["runs"]
            ],
        ),
    ]
    for spread in t["spreads"]:
        low, high = spread["latency"]
        today = spread["runs"][0]["seconds_per_batch"]
        lines += [
            "",
            f"## Tools answering after {f'{low:g} s' if low == high else f'{low:g}-{high:g} s'}: {t['batches']} "
            f"batches of {t['rows']} episodes, up to {TURNS} turns and {t['max_new_tokens']} drawn tokens",
            "",
            *_table(
                ["schedule", "K", "s per batch", "vs fixed, K=0", "tokens/s", "waited for tools, s per batch"],
                [
                    [
                        run["schedule"],
                        str(run["ahead"]),
                        f"{run['seconds_per_batch']:.2f}",
                        f"{run['seconds_per_batch'] / today:.2f}x",
                        f"{run['tokens_per_s']:.0f}",
                        f"{run['tool_wait_per_batch']:.2f}",
                    ]
                    for run in spread["runs"]
                ],
            ),
        ]
    lines += [
        "",
        f"## Learning: the shipped task, {learn['iterations']} iterations, reward as a moving mean of {SMOOTH}",
        "",
        *_table(
            ["seed", "K = 0: seconds", "final reward", "K = 1: seconds", "final reward", "K = 1 reached K = 0's"],
            [
                [
                    str(run["seed"]),
                    f"{run['curves']['0'][-1][0]:.1f}",
                    f"{run['target']:.3f}",
                    f"{run['curves']['1'][-1][0]:.1f}",
                    f"{run['curves']['1'][-1][1]:.3f}",
                    "never"
                    if run["k1_reached_at"] is None
                    else f"after {run['k1_reached_at']:.1f} s, {run['k1_reached_at'] / run['curves']['0'][-1][0]:.2f}x",
                ]
                for run in learn["runs"]
            ],
        ),
        "",
    ]
    return "\n".join(lines)
