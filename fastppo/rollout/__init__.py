"""The sampler: a KV-cached batched sampler that runs on the live training weights."""

from .rollout import Rollout
from .sampler import Sampler

__all__ = ["Sampler", "Rollout"]
