"""The weights the sampler decodes with: the policy itself, or a copy in the rollout dtype.

Decoding is bound by reading the weights, so on CUDA the sampler reads a bf16 copy of the fp32
master weights: half the bytes per step, and flash-attn's kernels apply. The copy is device-local
and refreshed in place (one fused copy of every tensor, a few milliseconds) before each rollout,
so the sampler's KV cache, its CUDA graphs and its modules keep their addresses, and nothing is
serialised or sent to a second engine. Refreshing before the rollout rather than after each
optimizer step copies once per iteration however many steps it took, and also picks up weights
loaded by a resume. When the dtypes agree there is no copy: the sampler reads the policy's own
parameters.
"""

from typing import Optional

import torch
from torch import nn

from .models import copy_in_dtype


class RolloutWeights:
    """``model`` is what the sampler runs; :meth:`refresh` brings it up to date with the policy."""

    def __init__(self, policy: nn.Module, dtype: Optional[torch.dtype]):
        """``dtype`` None: the policy itself whatever its dtypes (LoRA, whose frozen base is already
        held in the rollout dtype)."""
        self.policy = policy
        if dtype is None or all(p.dtype == dtype for p in policy.parameters()):
            self.model, self._targets, self._sources = policy, [], []
            return
        self.model, pairs = copy_in_dtype(policy, dtype)
        self._targets, self._sources = [list(side) for side in zip(*pairs)]

    @property
    def shared(self) -> bool:
        """True when the sampler reads the policy's own parameters (nothing to refresh)."""
        return self.model is self.policy

    @torch.no_grad()
    def refresh(self) -> None:
        if self._targets:
            torch._foreach_copy_(self._targets, self._sources)
