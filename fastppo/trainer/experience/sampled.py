"""What a rollout hands to the update: rows sampled (``Sampled``), then scored (``Scored``)."""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from torch import Tensor


@dataclass
class Scored:
    """A rollout and its scores: ``raw`` the rewards' weighted sum, ``scores`` with the no-stop and
    overlong penalties added (what the advantages see); ``each_reward`` each function's scores,
    and ``stats`` what dynamic sampling did."""

    rollout: object
    scores: Tensor  # (B,) fp32
    raw: Tensor  # (B,)
    no_stop: Tensor  # (B,) bool: the response hit max_new_tokens
    each_reward: dict  # name -> (B,)
    stats: dict = dataclasses.field(default_factory=dict)
    episodes: Optional[list] = None  # each row's Episode (fastppo.agents) when there are tools


@dataclass
class Sampled:
    """Rows of some prompts, sampled: the rollout, each row's prompt as the sampler saw it and, with
    tools, its episode."""

    rollout: object
    texts: list
    episodes: Optional[list] = None
    tool_wait: float = 0.0  # seconds the rollout waited for tools
