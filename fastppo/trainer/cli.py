"""``fastppo train``: a run, or its resume, from the command line; errors as one line.

Every config field is an option; ``--config FILE`` sets many at once; ``--resume RUN_DIR``
continues a run exactly; ``--plan`` prints the memory plan instead (``memory/printout.py``).

What the user gave being wrong (a config, a data file, a model, a run directory) is one line,
``fastppo train: error: ...``, and exit code 2, argparse's own errors too; a reward
function that raised (or called ``sys.exit``), a run that trained nothing (every step skipped) or
reached non-finite weights is one line, ``fastppo train: failed: ...``, and exit code 1; anything
else is a bug and keeps its traceback. ``--debug`` shows the traceback of every error.
"""

import argparse
import sys
from pathlib import Path

from ..errors import RewardFailed, TrainingFailed, UsageError
from .configuration.arguments import add_arguments, from_arguments, given_fields
from .memory.printout import print_plan
from .ppo import PPOTrainer
from .run.signals import StoppedAtOnce
from .run.summaries import end_summary


class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (an unknown option, a value of the wrong type) as one line too, without
    the usage block of every option."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (the options: {self.prog} --help)\n")


def main(argv=None) -> int:
    parser = OneLineParser(prog="fastppo train", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest checkpoint; "
        "--config and options may change only how long it runs and how it saves",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of every error")
    plan = parser.add_argument_group("memory plan")
    plan.add_argument(
        "--plan",
        action="store_true",
        help="print the memory this run needs on one device, from "
        "the model's config alone (no weights read), and exit without training",
    )
    plan.add_argument(
        "--plan-prompt-tokens",
        type=int,
        metavar="N",
        help="the longest prompt, in tokens (default: measured from the prompts with the model's tokenizer)",
    )
    plan.add_argument("--plan-world-size", type=int, metavar="N", help="ranks of the run (default: $WORLD_SIZE or 1)")
    plan.add_argument(
        "--plan-mean-response-tokens",
        type=int,
        metavar="N",
        help="the responses' mean length, for the rows in flight the KV cache allows "
        "(default: a quarter of the budget)",
    )
    plan.add_argument(
        "--plan-device-memory",
        type=float,
        metavar="GIB",
        help="memory of the device to compare with (default: this machine's GPU, else its RAM)",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        if args.plan:
            return print_plan(args)
        return _train(args)
    except UsageError as error:
        if args.debug:
            raise
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except (TrainingFailed, RewardFailed) as error:
        if args.debug:
            raise
        print(f"{parser.prog}: failed: {error}", file=sys.stderr)
        return 1
    except StoppedAtOnce as error:
        if args.debug:
            raise
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 130  # as a shell reports a process stopped by SIGINT


def exit_after_sharding(code: int) -> None:
    """Exit now, without the interpreter's teardown. After ``fully_shard`` (or a model split with
    DTensor, ``rollout/tensor_parallel.py``) something inside torch keeps the gloo process group
    alive past ``destroy_process_group``, and its threads, still joinable when the interpreter
    destroys them at exit, abort the process ("terminate called without an active exception"): a
    run that wrote everything would report a crash. Everything is on disk and closed by then (each
    save atomic, the logs flushed)."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _train(args) -> int:
    if args.resume:
        trainer, start = PPOTrainer.resume(args.resume, given_fields(args))
        if trainer.ranks.main:
            print(
                f"resuming {args.resume} from checkpoint-{start}: iterations {start} to "
                f"{trainer.config.run.iterations - 1}",
                flush=True,
            )
    else:
        trainer, start = PPOTrainer(from_arguments(args)), 0
    try:
        history = trainer.train(start)
    finally:
        trainer.ranks.close()
    if trainer.ranks.main and history:
        for line in end_summary(
            Path(trainer.config.run.out), len(trainer.eval_prompts or ()), trainer.config.eval.eval_samples
        ):
            print(line)
    if trainer.models.sharded:
        exit_after_sharding(0)
    return 0
