"""fastppo's public ops: validation, backend dispatch, autograd, and the PyTorch twin of each kernel."""

from .advantages import group_advantages, masked_whiten, token_rewards
from .checks import IGNORE_INDEX
from .decode_attention import decode_attention
from .gae import gae
from .kl import kl_penalty
from .ppo_loss_from_hidden import ppo_loss_from_hidden
from .ppo_loss_from_logits import ppo_loss_from_logits
from .ppo_policy_loss import ppo_policy_loss
from .rollout_is_weights import rollout_is_weights
from .sample_tokens import sample_tokens
from .sequence_ppo_loss import sequence_ppo_loss
from .token_logprobs import token_logprobs
from .token_logprobs_from_hidden import token_logprobs_from_hidden
from .value_loss import value_loss

__all__ = [
    "token_logprobs",
    "token_logprobs_from_hidden",
    "ppo_policy_loss",
    "ppo_loss_from_logits",
    "ppo_loss_from_hidden",
    "sequence_ppo_loss",
    "value_loss",
    "kl_penalty",
    "gae",
    "masked_whiten",
    "group_advantages",
    "token_rewards",
    "sample_tokens",
    "decode_attention",
    "rollout_is_weights",
    "IGNORE_INDEX",
]
