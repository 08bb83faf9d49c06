"""What a run writes as it goes, beside its checkpoints: ``config.json`` and ``inputs.json`` at the
start, one ``metrics.jsonl`` row per iteration and evaluation, ``completions.jsonl`` rows to read
what the policy writes, TensorBoard scalars and text when tensorboard is installed, and a plot at
the end. Rank 0 alone writes; a resumed run first drops the rows past its checkpoint."""

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from . import directory as run_directory
from . import inputs, plot

if TYPE_CHECKING:  # for the annotations only
    from ..configuration.config import TrainConfig


def start_run_directory(out: Path, config: "TrainConfig", start: int) -> None:
    """``out`` ready for iteration ``start``: created (cleared first for an ``overwrite`` run from
    0), the config and, for a new run, its pinned inputs written, and for a resumed run the log
    rows from past its checkpoint dropped (a run that went on after it)."""
    if start == 0 and config.run.overwrite and out.is_dir():
        run_directory.check_run_directory(out, overwrite=True)  # still a run directory, as at start-up
        run_directory.clear_run_directory(out)
    out.mkdir(parents=True, exist_ok=True)
    run_directory.write_text_atomically(out / "config.json", json.dumps(config.flat(), indent=1))
    if start == 0:
        run_directory.write_text_atomically(out / inputs.INPUTS_FILE, inputs.pinned(config.flat()))
    if start:
        for log in ("metrics.jsonl", "completions.jsonl"):
            if log == "metrics.jsonl" or (out / log).is_file():
                kept = run_directory.metrics_before(out / log, start)
                run_directory.write_text_atomically(out / log, "".join(line + "\n" for line in kept))


def progress(start: int, iterations: int, main: bool):
    """The iterations from ``start``, as rank 0's progress bar."""
    from tqdm import tqdm

    return tqdm(range(start, iterations), desc="ppo", initial=start, total=iterations, disable=not main)


def postfix(metrics: dict) -> str:
    """The progress bar's summary of an iteration's metrics."""
    return (
        f"reward={metrics['reward_mean']:.3f}, kl={metrics['approx_kl']:.4f}, "
        f"tok_s={metrics['tokens_per_s_generated']:.0f}"
    )


def iteration_metrics(iteration: int, scored, batch, stats: dict, lr: float, clock: list, state, world: int) -> dict:
    """This rank's metrics row of an iteration: the rewards and what the sampler did (``scored``),
    the update's ``stats``, the trainer ``state``'s counts, and the phases' times from ``clock``
    (the start, rollout, prepare and end times)."""
    start, rolled, prepared, done = clock
    raw, tokens = scored.raw, int(batch.mask.sum())
    mismatch = ((batch.sampler_logprobs - batch.old_logprobs).abs() * batch.mask).sum() / max(tokens, 1)
    generated = float(scored.rollout.response_mask.sum())  # sampled: an episode's tool tokens aside
    return {
        "iteration": iteration,
        "reward_mean": float(raw.mean()),
        "reward_std": float(raw.std()),
        # of the rows each function scored (an environment's reward scores its own rows only)
        **{f"reward/{name}": float(v.nanmean()) for name, v in scored.each_reward.items() if not v.isnan().all()},
        **scored.stats,
        "score_mean": float(scored.scores.mean()),
        "response_length": float(scored.rollout.response_lens.float().mean()),
        # an episode's length holds its tool results; what the policy sampled of it:
        **({} if scored.episodes is None else {"sampled_length": generated / len(scored.rollout.response_lens)}),
        "stop_rate": float(1 - scored.no_stop.float().mean()),
        "logprob_mismatch": float(mismatch),
        **stats,
        "skipped_steps": state.skipped_steps,
        "lr": lr,
        "time_rollout": rolled - start,
        "time_forward": prepared - rolled,
        "time_update": done - prepared,
        # per second of the whole iteration: every token sampled, and those the loss kept
        "tokens_per_s_generated": generated * world / (done - start),
        "tokens_per_s_trained": tokens * world / (done - start),
    }


class RunLog:
    """The appending writers of a run directory; on ranks other than 0 every method does nothing."""

    def __init__(self, out: Path, main: bool):
        self.out, self.main = out, main
        self.metrics = open(out / "metrics.jsonl", "a") if main else None
        self.board = None
        if main and importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(out / "tensorboard"))

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.board is not None:
            self.board.close()

    def write(self, metrics: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(metrics) + "\n")
            self.metrics.flush()
        if self.board is not None:
            for key, value in metrics.items():
                self.board.add_scalar(key, value, metrics["iteration"])

    def write_examples(self, iteration: int, examples: list) -> None:
        if not self.main or not examples:
            return
        with open(self.out / "completions.jsonl", "a") as f:
            f.writelines(json.dumps({"iteration": iteration, **row}) + "\n" for row in examples)
        if self.board is not None:
            self.board.add_text(
                "completions",
                "\n\n".join(
                    f"**score {row['score']:.3f}** {row['prompt']!r} -> {row['completion']!r}" for row in examples
                ),
                iteration,
            )

    def plot(self) -> None:
        if self.main and plot.available():
            plot.plot_run(self.out)
