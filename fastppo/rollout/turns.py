"""The turns contract: what a multi-turn rollout asks of whoever runs its episodes.

A row of a multi-turn rollout is an *episode*: the model's turns, each ended by a stop token, and
between them tokens the model did not sample (a tool's result in the chat template's scaffolding,
up to the next assistant turn's header). The sampler (``batching.py``) owns the rows and their
KV cache; a :class:`Turns` owns what happens between turns (parsing tool calls, running tools,
rendering results: ``fastppo.agents``). When a row's turn ends the sampler calls
:meth:`Turns.turn_ended`; if the episode goes on, the row keeps its slot and cache, paused, until
the sampler asks for its :meth:`Turns.continuation`, prefills those tokens onto the row's cache at
its position, and lets it decode again. Nothing is prefilled twice.
"""

from abc import ABC, abstractmethod


class Turns(ABC):
    @abstractmethod
    def turn_ended(self, row: int, turn: list, may_continue: bool) -> bool:
        """Output row ``row``'s turn ended; ``turn`` is its tokens (the stop token last when it
        stopped). ``may_continue`` is False when the episode ends whatever the turn says (it hit
        the generation budget or the context). True when the episode goes on: the row's calls are
        under way and :meth:`continuation` will give what follows."""

    @abstractmethod
    def continuation(self, row: int, room: int) -> list:
        """The token ids that follow row ``row``'s last turn, up to and including the next
        assistant turn's header; waits for the row's calls (each bounded by its timeout). ``room``
        is how many tokens the row's context has left: a continuation of ``room`` tokens or more is
        truncated (:meth:`truncated`) whatever it holds, so it may be cut short of the rest."""

    def ready(self, row: int) -> bool:
        """Whether :meth:`continuation` would return at once for row ``row`` (its calls are done, or
        past their timeout): must become true within the row's tool timeout. The sampler looks at it
        to resume a row as soon as it can (the eager tool schedule) and to count the time it waits.
        The default, True, says nothing: the wait then happens inside :meth:`continuation`."""
        return True

    @abstractmethod
    def truncated(self, row: int) -> None:
        """Row ``row``'s continuation did not fit its context: the episode ends after its last turn,
        without the results it was given."""
