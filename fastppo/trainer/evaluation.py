"""Held-out evaluation: is the policy getting better at prompts it never trains on?

Three numbers, from the same rewards as training (their weighted sum):

* ``eval/greedy``: the mean score of one greedy response (temperature 0) per prompt; with a 0/1
  verifier, the greedy accuracy;
* ``eval/mean@K``: the mean score of ``K`` responses per prompt at the rollout temperature;
* ``eval/pass@K``: the mean over prompts of the best of those ``K`` scores; with a 0/1 verifier,
  the share of prompts at least one of ``K`` samples solves.

The prompts are dealt round-robin to the ranks and the sums all-reduced, and the samples are
seeded from the run's seed and the iteration, so an evaluation neither depends on the world
size's batching nor moves any generator the training draws from.
"""

import torch

from . import rollouts


def evaluate(trainer, prompts, samples: int, iteration: int) -> dict:
    """The three metrics of the current policy over ``prompts`` (:class:`~fastppo.trainer.data.Prompts`)."""
    ranks, r = trainer.ranks, trainer.config.rollout
    mine = list(range(ranks.rank, len(prompts), ranks.world))
    seed = (trainer.config.run.seed * 100_003 + iteration) * ranks.world + ranks.rank + 7_919
    totals = torch.zeros(3, dtype=torch.float64)  # greedy, mean of K, best of K; summed over prompts
    trainer.rollout_weights.refresh()
    for temperature, n in ((0.0, 1), (r.temperature, samples)):
        if mine:  # the sampler takes all of them, through as many of its slots as it has
            rollout = trainer.sample([prompts.ids[i] for i in mine], temperature, n, seed + n)
            scores, _ = rollouts.score(trainer, prompts, mine, rollout, n)
            per_prompt = torch.tensor(scores, dtype=torch.float64).view(len(mine), n)
            if temperature == 0:
                totals[0] += per_prompt.sum()
            else:
                totals[1] += per_prompt.mean(dim=1).sum()
                totals[2] += per_prompt.max(dim=1).values.sum()
    trainer.rollout_weights.release()
    totals = ranks.sum(totals.to(ranks.device())).cpu() / len(prompts)
    return {"eval/greedy": float(totals[0]), f"eval/mean@{samples}": float(totals[1]),
            f"eval/pass@{samples}": float(totals[2])}
