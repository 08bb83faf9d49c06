"""fastppo's public ops: validation, backend dispatch, autograd, and the PyTorch twin of each kernel."""

from .advantages import group_advantages, masked_whiten, token_rewards
from .gae import gae
from .kl import kl_penalty
from .linear_token_logprobs import linear_token_logprobs
from .token_logprobs import token_logprobs

__all__ = [
    "token_logprobs", "linear_token_logprobs",
    "gae", "masked_whiten", "group_advantages", "token_rewards", "kl_penalty",
]
