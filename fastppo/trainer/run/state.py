"""The trainer's mutable state: what the next iteration depends on besides the weights and the
optimizers. One dataclass, so a checkpoint saves and loads it whole and nothing else in the
trainer changes between iterations.

The random states are not kept here: they live in the global generators a reward function may
draw from, and are read out at each save (:func:`random_states`) and put back on resume.
"""

import random
from dataclasses import dataclass

import numpy
import torch

from ...errors import TrainingFailed


@dataclass
class TrainerState:
    kl_coef: float  # the KL coefficient the next iteration uses (adapted with kl_target)
    steps: int = 0  # optimizer steps attempted, skipped ones included
    skipped_steps: int = 0  # steps skipped for a non-finite gradient
    prompts_drawn: int = 0  # the position in the epoch order, the same on every rank
    warned_truncated: bool = False  # most of a batch masked out by mask_truncated, said once per run

    def check_trained(self) -> None:
        """Raise :class:`TrainingFailed` when every optimizer step so far was skipped."""
        if self.steps and self.skipped_steps == self.steps:
            raise TrainingFailed(
                f"all {self.steps} optimizer steps were skipped for non-finite gradients: the policy "
                "never changed (look at the rewards, the learning rate and the loss coefficients)"
            )

    def adapt_kl(self, kl: float, rows: int, target, horizon: int) -> None:
        """Ziegler et al.'s adaptive KL ("Fine-Tuning Language Models from Human Preferences", 2019):
        after each rollout of ``rows`` sequences with mean per-token KL ``kl``, ``coef *= 1 +
        clip(kl / target - 1, -0.2, 0.2) * rows / horizon``; fixed when ``target`` is None."""
        if target is None:
            return
        error = min(max(kl / target - 1.0, -0.2), 0.2)
        self.kl_coef *= 1.0 + error * rows / horizon


def random_states(device: torch.device) -> dict:
    """The global generators' states (Python's, NumPy's, torch's, and CUDA's on a CUDA ``device``)."""
    cuda = device.type == "cuda"
    return {
        "python_global": random.getstate(),
        "numpy": numpy.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if cuda else None,
    }


def restore_random_states(states: dict, device: torch.device) -> None:
    random.setstate(states["python_global"])
    numpy.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
