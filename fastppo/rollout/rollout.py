"""``Rollout``: what one call of :meth:`fastppo.Sampler.generate` returns."""

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Rollout:
    """Sampled responses, right-padded, with their log-probs; samples of one prompt are consecutive.

    Attributes:
        prompt_ids: the prompt of each row, as token-id lists (``B`` of them).
        response_ids: ``(B, R)`` int64, right-padded with the pad id; ``R`` is the longest response.
        response_mask: ``(B, R)`` bool, true on generated tokens, the stop token included (false on
            an episode's continuations, the tokens between its turns that the model did not sample).
        response_lens: ``(B,)`` int64, each row's length: the number of true entries of its mask, and
            in an episode its continuations too.
        logprobs: ``(B, R)`` fp32, ``log_softmax(logits / temperature)[token]`` over the full
            vocabulary (temperature 1 for greedy decoding), 0 where masked.
        finish_reason: ``"stop"`` (a stop token was sampled) or ``"length"`` per row.
        versions: ``(B, R)`` int64 from a :class:`~fastppo.rollout.stream.RolloutStream`: the version of
            the weights that drew each token (the stream's count of weight changes), 0 where masked;
            None from ``generate``, whose tokens are all drawn by the weights of the call.
    """

    prompt_ids: list
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    response_lens: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: list
    versions: Optional[torch.Tensor] = None
