"""fastppo's public ops: validation, backend dispatch, autograd, and the PyTorch twin of each kernel."""

from .linear_token_logprobs import linear_token_logprobs
from .token_logprobs import token_logprobs

__all__ = ["token_logprobs", "linear_token_logprobs"]
