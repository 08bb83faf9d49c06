"""The advantage estimators, one registered entry each: the config's checks, ``--help`` and the
documentation's table all read this registry, so adding an estimator is one :func:`register` call.

An entry is a function from the sequence scores and the prepared batch to ``(advantages,
returns)``, both (B, R) (returns None without a critic), and the properties the trainer needs:

* ``critic``: it reads the critic's values (``batch.values``);
* ``kl_in_reward``: the KL to the reference is in each token's reward (:func:`fastppo.token_rewards`),
  so the old log-probs are needed before the update; otherwise it is a term of the loss;
* ``whiten``: the trainer whitens its advantages over the global batch;
* ``grouped``: it compares the samples of one prompt, so dynamic sampling and GSPO can use it;
* ``agg``: its default aggregation of the per-token loss (``--agg`` overrides it);
* ``min_samples``: the fewest samples per prompt it can work with.

Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training") removes both of GRPO's length
and difficulty biases: no division by the group's std, and a constant normaliser (rows x the
generation budget) instead of each response's length. REINFORCE++ (Hu, 2025) is the token-level
KL in the reward with global batch whitening and no critic: GAE with zero values and lambda 1.
"""

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ...ops import gae, group_advantages, token_rewards

# (scores (B,), batch, algo config, samples per prompt, KL coefficient) -> (advantages, returns or None)
Advantages = Callable[..., tuple]


@dataclass(frozen=True)
class Estimator:
    name: str
    advantages: Advantages
    summary: str  # one line for --help and the documentation's table
    critic: bool = False
    kl_in_reward: bool = False
    whiten: bool = False
    grouped: bool = False
    agg: str = "token-mean"
    min_samples: int = 1


ESTIMATORS: dict = {}


def register(estimator: Estimator) -> Estimator:
    """Make ``estimator`` known to the config, the CLI and the trainer under its name."""
    ESTIMATORS[estimator.name] = estimator
    return estimator


def group_baseline(baseline: str) -> Advantages:
    """Advantages of one :func:`fastppo.group_advantages` baseline, each sequence's over its tokens."""

    def advantages(scores: Tensor, batch, algo, samples_per_prompt: int, kl_coef: float) -> tuple:
        per_row = group_advantages(scores, samples_per_prompt, estimator=baseline)  # (B,)
        return per_row.unsqueeze(1).expand_as(batch.mask).float() * batch.mask, None

    return advantages


def kl_shaped_rewards(scores: Tensor, batch, kl_coef: float) -> Tensor:
    """Each token's reward: minus the weighted KL of the old policy to the reference, plus the
    score at the last token. (B, R) fp32."""
    # Without old log-probs here the KL weight is 0 (old_logprobs_from_update): any will do.
    behaviour = batch.old_logprobs if batch.old_logprobs is not None else batch.sampler_logprobs
    ref = batch.ref_logprobs if batch.ref_logprobs is not None else behaviour
    return token_rewards(scores, behaviour, ref, batch.mask, kl_coef=kl_coef, kl_estimator="k1")


def gae_advantages(scores: Tensor, batch, algo, samples_per_prompt: int, kl_coef: float) -> tuple:
    return gae(kl_shaped_rewards(scores, batch, kl_coef), batch.values, batch.mask, gamma=algo.gamma, lam=algo.lam)


def reward_to_go(scores: Tensor, batch, algo, samples_per_prompt: int, kl_coef: float) -> tuple:
    rewards = kl_shaped_rewards(scores, batch, kl_coef)
    return gae(rewards, torch.zeros_like(rewards), batch.mask, gamma=algo.gamma, lam=1.0)


register(
    Estimator(
        "gae",
        gae_advantages,
        "GAE over a critic's values, KL in the token rewards (PPO)",
        critic=True,
        kl_in_reward=True,
        whiten=True,
    )
)
register(Estimator("grpo", group_baseline("grpo"), "score minus its group's mean, over the group's std", grouped=True))
register(
    Estimator(
        "dr_grpo",
        group_baseline("dr_grpo"),
        "score minus its group's mean, a constant normaliser",
        grouped=True,
        agg="seq-mean-token-sum-norm",
    )
)
register(
    Estimator(
        "rloo", group_baseline("rloo"), "score minus the mean of the group's other samples", grouped=True, min_samples=2
    )
)
register(
    Estimator(
        "reinforce_baseline",
        group_baseline("reinforce_baseline"),
        "score minus its group's mean, whitened over the batch",
        whiten=True,
        grouped=True,
    )
)
register(
    Estimator(
        "reinforce_pp",
        reward_to_go,
        "REINFORCE++: the discounted KL-shaped reward-to-go, whitened",
        kl_in_reward=True,
        whiten=True,
    )
)


def help_text() -> str:
    return "advantages: " + "; ".join(f"{e.name} ({e.summary})" for e in ESTIMATORS.values())


def markdown_table() -> str:
    """The registry as the documentation's table (a test keeps docs/training.md equal to it)."""
    lines = ["| estimator | advantages | critic | KL | whitened | default agg |", "|---|---|---|---|---|---|"]
    for e in ESTIMATORS.values():
        lines.append(
            f"| `{e.name}` | {e.summary} | {'yes' if e.critic else 'no'} | "
            f"{'reward' if e.kl_in_reward else 'loss'} | {'yes' if e.whiten else 'no'} | `{e.agg}` |"
        )
    return "\n".join(lines)
