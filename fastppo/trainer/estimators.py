"""The advantage estimators the trainer knows, in one table: config validation and the trainer
both read it, so what an estimator needs is said once.

Two shapes of estimator:

* **group baselines** (``baseline`` set): one advantage per sequence from its score against the
  other samples of its prompt (:func:`fastppo.group_advantages`), spread over its tokens; the KL
  to the reference, when weighted, is a term of the loss.
* **token rewards** (``baseline`` None): the KL penalty is in each token's reward and the score
  at the last token (:func:`fastppo.token_rewards`); the advantages are GAE over the critic's
  values (``gae``) or, without a critic, the discounted reward-to-go (REINFORCE++: GAE with zero
  values and lambda 1); both whitened over the global batch.

``agg`` is each estimator's default aggregation of the per-token loss (``--agg`` overrides it).
Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training") removes both of GRPO's length
and difficulty biases: no division by the group's std, and a constant normaliser (rows x the
generation budget) instead of each response's length. REINFORCE++ (Hu, 2025) is the token-level
KL in the reward with global batch whitening and no critic.
"""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Estimator:
    critic: bool  # needs a value model
    baseline: Optional[str]  # group_advantages' estimator; None: advantages from token rewards
    whiten: bool  # advantages whitened over the global batch
    agg: str  # the default aggregation
    min_samples: int = 1  # the fewest samples per prompt it can compare (RLOO leaves one out)

    @property
    def kl_in_reward(self) -> bool:
        """Whether the KL to the reference shapes the token rewards (else it is a loss term)."""
        return self.baseline is None


ESTIMATORS = {
    "gae": Estimator(critic=True, baseline=None, whiten=True, agg="token-mean"),
    "grpo": Estimator(critic=False, baseline="grpo", whiten=False, agg="token-mean"),
    "dr_grpo": Estimator(critic=False, baseline="dr_grpo", whiten=False, agg="seq-mean-token-sum-norm"),
    "rloo": Estimator(critic=False, baseline="rloo", whiten=False, agg="token-mean", min_samples=2),
    "reinforce_baseline": Estimator(critic=False, baseline="reinforce_baseline", whiten=True, agg="token-mean"),
    "reinforce_pp": Estimator(critic=False, baseline=None, whiten=True, agg="token-mean"),
}
