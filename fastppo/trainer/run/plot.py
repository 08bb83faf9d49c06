"""``fastppo plot RUN_DIR``: a PNG of a run's curves (reward, held-out scores, entropy, response
length, KL or stop rate).

Uses matplotlib when it is installed (``pip install 'fastppo[plot]'``); the trainer writes
``plot.png`` at the end of a run when it can.
"""

import argparse
import importlib.util
import sys
from pathlib import Path

PANELS = (("reward_mean", "mean reward"), ("entropy", "entropy"), ("response_length", "response length"))
LAST_PANEL = (("rollout_kl", "KL to the reference"), ("stop_rate", "stop rate"))  # the first the run logged


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot_run(run_dir: Path, out: Path = None) -> Path:
    """Write the curves of ``run_dir/metrics.jsonl`` to ``out`` (default ``run_dir/plot.png``)."""
    if not available():
        raise ImportError("fastppo plot needs matplotlib: pip install 'fastppo[plot]'")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .directory import read_metrics

    metrics = Path(run_dir) / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: not a fastppo run directory")
    rows = [row for _, row in read_metrics(metrics)]
    logged = {key for row in rows for key in row}
    held_out = sorted(key for key in logged if key.startswith("eval/"))  # greedy, mean@K, pass@K
    panels = [((key,), title) for key, title in PANELS]
    if held_out:
        panels.insert(1, (tuple(held_out), "held-out score (before each iteration)"))
    panels += [((key,), title) for key, title in LAST_PANEL if key in logged][:1]
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for axis, (keys, title) in zip(axes, panels):
        for key in keys:
            axis.plot(
                [r["iteration"] for r in rows if key in r],
                [r[key] for r in rows if key in r],
                marker="o" if len(keys) > 1 else None,
                label=key.removeprefix("eval/"),
            )
        if len(keys) > 1:
            axis.legend()
        axis.set_title(title)
        axis.set_xlabel("iteration")
    figure.tight_layout()
    out = Path(out) if out is not None else Path(run_dir) / "plot.png"
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastppo plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="the PNG to write (default: RUN_DIR/plot.png)")
    args = parser.parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except (ImportError, FileNotFoundError) as error:  # what the user can fix: one line, as argparse does
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    return 0
