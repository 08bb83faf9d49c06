"""``fastppo train``: every config field is an option; ``--config FILE`` sets many at once;
``--resume RUN_DIR`` continues a run exactly.

What the user gave being wrong (a config, a data file, a model, a run directory) is one line,
``fastppo train: error: ...``, and exit code 2, as argparse does for its own errors; a run
that trained nothing (every step skipped) is one line and exit code 1; anything else is a bug
and keeps its traceback. ``--debug`` shows the traceback of every error.
"""

import argparse
import sys

from .config import add_arguments, from_arguments, given_fields
from .errors import UsageError
from .ppo import PPOTrainer, TrainingFailed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastppo train", description=__doc__.splitlines()[0])
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint; "
                        "--config and options may change only how long it runs and how it saves")
    parser.add_argument("--debug", action="store_true", help="show the traceback of every error")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return _train(args)
    except UsageError as error:
        if args.debug:
            raise
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except TrainingFailed as error:
        if args.debug:
            raise
        print(f"{parser.prog}: failed: {error}", file=sys.stderr)
        return 1


def _train(args) -> int:
    if args.resume:
        trainer, start = PPOTrainer.resume(args.resume, given_fields(args))
    else:
        trainer, start = PPOTrainer(from_arguments(args)), 0
    try:
        history = trainer.train(start)
    finally:
        trainer.ranks.close()
    if trainer.ranks.main and history:
        first = sum(h["reward_mean"] for h in history[:5]) / len(history[:5])
        last = sum(h["reward_mean"] for h in history[-5:]) / len(history[-5:])
        print(f"mean reward: first 5 iterations {first:.3f}, last 5 {last:.3f} ({len(history)} iterations); "
              f"metrics in {trainer.config.run.out}/metrics.jsonl")
    return 0
