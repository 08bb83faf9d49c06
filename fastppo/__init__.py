"""fastppo: PPO for language models, made fast with fused Triton kernels.

The ops work on CUDA (Triton kernels) and on CPU (their PyTorch twins) and are safe to drop into
any trainer: exact documented semantics, fp32 results, no host syncs, clear errors on bad input.
"""

from .ops import (gae, group_advantages, kl_penalty, linear_token_logprobs, masked_whiten, token_logprobs,
                  token_rewards)

__version__ = "0.1.0"

__all__ = [
    "token_logprobs", "linear_token_logprobs",
    "gae", "masked_whiten", "group_advantages", "token_rewards", "kl_penalty",
    "__version__",
]
