"""The decoder contract: what the sampler's batching loop (``batching.py``) asks of a model.

A decoder holds the model's cache for a decode batch of *slots*, ``0 .. B-1``, each holding one
row (a sample of a prompt) or nothing. The loop prefills prompts into free slots, feeds every
slot one token per step, and now and then packs the rows still going into the lowest slots so
that the batch shrinks as rows finish. In a multi-turn rollout a row paused between turns gets
the tokens that follow its turn prefilled onto its cache at its position (``extend``). A decoder
whose cache is paged (``paged.py``) gives rows memory as they grow: the loop *claims* a group's
blocks before its prefill, has every row *hold* the positions it will write before each stretch
of steps, and *releases* a row's blocks when it ends; elsewhere each slot has all of its positions
from the start, and the defaults below grant everything. Two implementations: ``cached.py``'s
decoders over fastppo's preallocated cache (a hand-written forward, ``lean.py``, or the model's own
modules, ``interface.py``) and the generic one of ``generic.py`` (any causal LM, through its own
forward and cache); ``decoders.py`` chooses.
"""

from abc import ABC, abstractmethod

from torch import Tensor


class Decoder(ABC):
    #: Whether prompts can be prefilled into free slots while other slots are decoding; when not,
    #: the loop waits for every slot to be free (the next wave of rows starts a fresh cache).
    refills = True
    #: Tokens fed through the model by ``prefill`` and ``extend`` (a prompt once per prompt where the
    #: decoder shares it among its samples); the sampler zeroes it for each ``generate``.
    prefilled = 0

    @abstractmethod
    def prefill(self, slots: list, prompts: list) -> Tensor:
        """Prefill each prompt (a token-id list) into every slot of its entry of ``slots`` (one slot
        per sample) and return each prompt's next-token logits ``(len(prompts), V)``."""

    @abstractmethod
    def decode(self, tokens: Tensor, positions: Tensor, span: int, live: Tensor) -> Tensor:
        """One step of slots ``0 .. B-1``: token ``tokens[i]`` ``(B,)`` sits at position
        ``positions[i]`` ``(B,)`` of slot i, every position below ``span``. Returns the next-token
        logits ``(B, V)``. A slot attends to its own positions ``0 .. positions[i]`` only.
        ``live`` ``(B,)`` bool: the slots whose token is real; what the others write at their
        position may be anything, and is rewritten before a row reads it."""

    @abstractmethod
    def extend(self, slots: list, tokens: list, starts: list) -> Tensor:
        """Prefill ``tokens[i]`` (a token-id list) onto slot ``slots[i]``'s cache at positions
        ``starts[i] ..``, after the positions it holds, and return each slot's next-token logits
        ``(len(slots), V)``: a continuation of a row, its earlier tokens never computed again."""

    @abstractmethod
    def pack(self, order: list, length: int) -> bool:
        """Make slot ``i`` hold what slot ``order[i]`` held (its first ``length`` positions), for
        ``i < len(order)``; every ``order[i]`` is ``i`` or a slot not in ``order``'s range. The batch
        is then ``len(order)`` slots. Returns False (and changes nothing) if this cache cannot."""

    def claim(self, slots: list, prompt_len: int, cap: int, positions: int) -> bool:
        """Memory for a new group in ``slots`` (one row each, prompts of ``prompt_len`` tokens, rows
        reaching at most ``cap`` positions), enough for their first ``positions``. False, with
        nothing taken, when it cannot be had without risking the rows running."""
        return True

    def hold(self, slots: list, positions: list) -> list:
        """Memory for the first ``positions[i]`` positions of slot ``slots[i]``'s row; which slots
        have it (a slot refused stalls: it keeps what it holds and decodes nothing)."""
        return [True] * len(slots)

    def release(self, slots: list) -> None:
        """The rows of ``slots`` ended: their memory may go to others."""
        return None
