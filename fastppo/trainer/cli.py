"""``fastppo train``: every config field is an option; ``--config FILE`` sets many at once;
``--resume RUN_DIR`` continues a run exactly."""

import argparse

from .config import add_arguments, from_arguments
from .ppo import PPOTrainer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastppo train", description=__doc__.splitlines()[0])
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.resume:
        overrides = {k: v for k, v in vars(args).items() if k not in ("resume", "config")}
        trainer, start = PPOTrainer.resume(args.resume, overrides)
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
