"""Per-token estimators of KL(policy || reference) from log-probs of the sampled tokens.

With ``d = logp - ref_logp`` (the log-ratio of the policy to the reference at the sampled token):

* ``k1 = d``: unbiased, high variance, can be negative per token;
* ``k2 = d**2 / 2``: low variance, biased;
* ``k3 = exp(-d) + d - 1``: unbiased and never negative; ``d`` is clamped to [-20, 20] first so a
  single far-off token cannot overflow it.

(The three estimators are from J. Schulman, "Approximating KL Divergence", 2020.)
"""

import torch
from torch import Tensor

from . import checks

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL estimate, fp32, the shape of ``logprobs``; differentiable w.r.t. both inputs."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    checks.check_floating(logprobs, "logprobs")
    checks.check_floating(ref_logprobs, "ref_logprobs")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"ref_logprobs has shape {tuple(ref_logprobs.shape)} but logprobs has {tuple(logprobs.shape)}")
    d = logprobs.float() - ref_logprobs.float()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    d = d.clamp(-20.0, 20.0)
    return torch.exp(-d) + d - 1.0
