"""The KL coefficient: fixed, or adapted to hold the policy near a target KL to the reference.

The adaptive rule is Ziegler et al.'s ("Fine-Tuning Language Models from Human Preferences",
2019): after each rollout, ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * rows / horizon``.
"""

from typing import Optional


class KLController:
    def __init__(self, coef: float, target: Optional[float] = None, horizon: int = 10_000):
        self.coef, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, rows: int) -> None:
        """Feed the mean per-token KL of the last rollout over ``rows`` sequences."""
        if self.target is None:
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * rows / self.horizon
