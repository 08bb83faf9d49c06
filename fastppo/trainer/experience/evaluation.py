"""Held-out evaluation: is the policy getting better at prompts it never trains on?

Three numbers, from the same rewards as training (their weighted sum, and with several reward
functions each one's too, as ``eval/<name>/greedy`` and so on: a verifier's accuracy is not its
sum with a format bonus):

* ``eval/greedy``: the mean score of one greedy response (temperature 0) per prompt; with a 0/1
  verifier, the greedy accuracy;
* ``eval/mean@K``: the mean score of ``K`` responses per prompt at the rollout temperature;
* ``eval/pass@K``: the mean over prompts of the best of those ``K`` scores; with a 0/1 verifier,
  the share of prompts at least one of ``K`` samples solves.

With tools each response is an episode, and ``eval/tools/calling`` is the share of the sampled
episodes that called a tool, ``eval/tools/calls`` their calls per episode.

The prompts are dealt round-robin to the rollout groups (each rank, or with ``--rollout-tp`` each
group of ranks decoding together, whose first rank alone counts them) and the sums all-reduced,
and the samples are seeded from the run's seed and the iteration, so an evaluation neither
depends on the world size's batching nor moves any generator the training draws from.
"""

import torch
from tqdm import tqdm


def due(options, iteration: int, prompts) -> bool:
    """Whether held-out ``prompts`` are evaluated before ``iteration``: at the start, and every
    ``eval_every`` iterations of ``options`` (the end is the trainer's own row)."""
    every = options.eval_every
    return prompts is not None and (iteration == 0 or bool(every and iteration % every == 0))


def evaluate(rollouts, prompts, samples: int, iteration: int) -> dict:
    """The three metrics of the current policy over ``prompts`` (:class:`~fastppo.trainer.prompts.dataset.Prompts`),
    of the rewards' weighted sum and, with several rewards, of each (``eval/<name>/greedy``...,
    over the prompts it scores), sampled and scored by ``rollouts``
    (:class:`~fastppo.trainer.experience.rollouts.Rollouts`)."""
    ranks, config, group = rollouts.ranks, rollouts.config, rollouts.group
    mine = list(range(group.index, len(prompts), group.count))
    seed = (config.run.seed * 100_003 + iteration) * ranks.world + group.first + 7_919
    names = [name for name, _ in rollouts.rewards.named]
    totals = torch.zeros(1 + len(names), 3, dtype=torch.float64)  # (sum, each reward) x (greedy, mean@K, best of K)
    counted = torch.zeros_like(totals)  # the prompts each total is of: a reward may leave some unscored (NaN)
    tools = torch.zeros(2, dtype=torch.float64)  # sampled episodes that called a tool, and their calls
    rollouts.weights.refresh()
    with tqdm(
        total=len(mine) * (1 + samples),
        desc=f"held-out before iteration {iteration}",
        unit="row",
        leave=False,
        disable=not ranks.main,
    ) as bar:
        for temperature, n in ((0.0, 1), (config.rollout.temperature, samples)):
            if mine:  # the sampler takes all of them, through as many of its slots as it has
                rolled = rollouts.roll(prompts, mine, temperature, n, seed + n, bar.update, held_out=True)
                if group.member:  # the group's first rank scores and counts what the group sampled together
                    continue
                scores, each = rollouts.score(prompts, mine, rolled, n)
                if rolled.episodes is not None and temperature != 0:
                    tools += torch.tensor(
                        [sum(e.calls > 0 for e in rolled.episodes), sum(e.calls for e in rolled.episodes)]
                    )
                per_prompt = torch.tensor([scores] + [each[name] for name in names], dtype=torch.float64)
                per_prompt = per_prompt.view(1 + len(names), len(mine), n)
                scored = ~per_prompt.isnan()  # (1 + rewards, prompts, n)
                some = scored.any(dim=2)  # (1 + rewards, prompts): a prompt with a score of that reward
                if temperature == 0:
                    totals[:, 0] += per_prompt.nansum(dim=(1, 2))
                    counted[:, 0] += scored.sum(dim=(1, 2))
                else:
                    best = per_prompt.masked_fill(~scored, -torch.inf).max(dim=2).values
                    totals[:, 1] += per_prompt.nanmean(dim=2).nan_to_num().sum(dim=1)
                    totals[:, 2] += best.masked_fill(~some, 0).sum(dim=1)
                    counted[:, 1:] += some.sum(dim=1, keepdim=True)
    rollouts.rest()
    totals = ranks.sum(totals.to(ranks.device())).cpu() / ranks.sum(counted.to(ranks.device())).cpu()
    metrics = {}
    if rollouts.agent is not None:
        tools = ranks.sum(tools.to(ranks.device())).cpu() / (len(prompts) * samples)
        metrics.update({"eval/tools/calling": float(tools[0]), "eval/tools/calls": float(tools[1])})
    for prefix, row in zip(["eval/"] + [f"eval/{name}/" for name in names], totals):
        metrics.update(  # of the prompts the reward scored (0 / 0: none, no metric)
            {
                name: float(value)
                for name, value in zip((f"{prefix}greedy", f"{prefix}mean@{samples}", f"{prefix}pass@{samples}"), row)
                if not value.isnan()
            }
        )
        if len(names) == 1:  # the sum is that reward's
            break
    return metrics
