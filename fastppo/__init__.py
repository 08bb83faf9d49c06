"""fastppo: PPO for language models, made fast with fused Triton kernels.

The ops work on CUDA (Triton kernels) and on CPU (their PyTorch twins) and are safe to drop into
any trainer: exact documented semantics, fp32 results, no host syncs, clear errors on bad input.
"""

from .ops import (
    IGNORE_INDEX,
    decode_attention,
    gae,
    group_advantages,
    kl_penalty,
    masked_whiten,
    ppo_loss_from_hidden,
    ppo_loss_from_logits,
    ppo_policy_loss,
    rollout_is_weights,
    sample_tokens,
    sequence_ppo_loss,
    token_logprobs,
    token_logprobs_from_hidden,
    token_rewards,
    value_loss,
)
from .ops import __all__ as _ops
from .rollout import Rollout, Sampler

__version__ = "0.2.0"

__all__ = [*_ops, "Sampler", "Rollout", "__version__"]
