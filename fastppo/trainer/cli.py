"""``fastppo train``: every config field is an option; ``--config FILE`` sets many at once."""

import argparse

from .config import add_arguments, from_arguments
from .ppo import PPOTrainer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastppo train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    config = from_arguments(parser.parse_args(argv))
    history = PPOTrainer(config).train()
    first = sum(h["reward_mean"] for h in history[:5]) / len(history[:5])
    last = sum(h["reward_mean"] for h in history[-5:]) / len(history[-5:])
    print(f"mean reward: first 5 iterations {first:.3f}, last 5 {last:.3f} ({len(history)} iterations); "
          f"metrics in {config.run.out}/metrics.jsonl")
    return 0
