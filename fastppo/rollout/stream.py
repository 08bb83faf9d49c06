"""``RolloutStream``: rollouts that never drain, the sampler's batch kept full across iterations.

An RL iteration waits for its slowest row, and a decode step costs about as much for 2 rows as for
16 (it reads every weight either way). A stream lets the prompts of the next batches enter the
slots that the current batch's finished rows leave, so the tail of one batch decodes beside the
start of the next. Batches are *added* (the prompts of an iteration, up to ``ahead`` batches before
they are needed) and *taken* in order: :meth:`RolloutStream.next` decodes until every row of the
oldest batch has ended and returns its ``Rollout``. The rows of later batches stay in flight, in
their slots with their KV cache, and go on decoding at the next call, with whatever weights the
model has then: the caller refreshes them between calls and names their ``version``, and every
token records the version that drew it (``Rollout.versions``), so an update can correct for it.

The schedule is the loop's (``batching.py``): prompts enter in the order they were added, whole
groups at once, and when a call stops depends on step counts only. A stream is therefore exact:
the same seed and the same calls give the same tokens, and :meth:`RolloutStream.state_dict` holds
everything the next call depends on (the rows in flight, their cache, the draw's generator), so a
run that stops and loads it continues bitwise. Episodes (``Turns``) are supported but cannot be
saved: a tool's thread and an environment's object live outside the stream.

A stream at ``ahead=0`` is :meth:`Sampler.generate` called once per batch.
"""

import copy
from collections import deque
from typing import Optional

import torch

from .batching import LoopSettings, RolloutLoop, sampling_mode
from .rollout import Rollout
from .turns import Turns

STATE_TENSORS = ("row", "prompt_len", "drawn", "generated", "limit", "token", "active")
STATE_OUTPUTS = ("tokens_out", "logprobs_out", "mask_out", "stopped_out", "versions_out")
STATE_HOST = (
    "offset",
    "turn_start",
    "b",
    "steps_run",
    "prompts",
    "max_new",
    "unfinished",
    "added",
    "taken",
    "started",
    "version",
    "sizes",
)


class RingTurns(Turns):
    """The turns of the batches in flight, each batch's own ``Turns`` asked about its rows: output
    row ``r`` is row ``r % rows`` of the batch in block ``r // rows`` of the ring."""

    def __init__(self, rows: int, blocks: int):
        self.rows, self.blocks = rows, [None] * blocks

    def _of(self, row: int) -> tuple:
        return self.blocks[row // self.rows], row % self.rows

    def turn_ended(self, row: int, turn: list, may_continue: bool) -> bool:
        turns, own = self._of(row)
        return turns.turn_ended(own, turn, may_continue)

    def continuation(self, row: int, room: int) -> list:
        turns, own = self._of(row)
        return turns.continuation(own, room)

    def ready(self, row: int) -> bool:
        turns, own = self._of(row)
        return turns.ready(own)

    def truncated(self, row: int) -> None:
        turns, own = self._of(row)
        turns.truncated(own)


class StreamLoop(RolloutLoop):
    """The rollout loop over batches of ``prompts_per_batch`` prompts x ``n`` samples (or, a batch
    whose every row is its own prompt, ``prompts_per_batch * n`` prompts x 1): their output rows in a
    ring of ``ahead + 1`` blocks (batch ``k`` in block ``k % (ahead + 1)``). A prompt is known by its
    first row's number across batches, ``k * rows + r`` (``rows`` a batch's)."""

    def __init__(
        self, settings: LoopSettings, n: int, prompts_per_batch: int, ahead: int, max_new: int, episodes: bool
    ):
        self.per_batch, self.ring = prompts_per_batch * n, ahead + 1
        super().__init__(settings, [], n, [], turns=RingTurns(self.per_batch, self.ring) if episodes else None)
        self.prompts, self.max_new = {}, {}  # by global prompt and global row, for the batches in flight
        self.sizes = {}  # batch -> the rows each of its prompts is decoded in: n, or 1
        self.budget = max_new
        self._allocate(self.ring * self.per_batch, self.max_len if episodes else max_new)
        self.row.fill_(self.trash)
        self.versions_out = torch.zeros_like(self.tokens_out)
        self.unfinished = {}  # batch -> its rows that have not ended
        self.added = self.taken = 0  # batches added, and taken
        self.started = False

    def _out_row(self, prompt: int, sample: int) -> int:
        batch, r = divmod(prompt, self.per_batch)
        return (batch % self.ring) * self.per_batch + r + sample

    def _samples(self, prompt: int) -> int:
        return self.sizes[prompt // self.per_batch]

    def _budget(self, prompt: int, sample: int) -> int:
        return self.max_new[prompt + sample]

    def add(self, prompts: list, max_new: list, turns: Optional[Turns], per_row: bool = False) -> int:
        """Queue a batch: its prompts, each row's budget (``n`` per prompt; ``per_row``: every row its
        own prompt, one each) and, for episodes, its turns (asked about rows ``0 .. len(max_new) - 1``).
        Returns the batch's number."""
        if self.added - self.taken == self.ring:
            raise ValueError(f"a stream holds {self.ring} batches at once: take one before adding another")
        batch, first = self.added, self.added * self.per_batch
        size = self.sizes[batch] = 1 if per_row else self.n
        for j, prompt in enumerate(prompts):
            self.prompts[first + j * size] = list(prompt)
            self.pending.append(first + j * size)
        for r, budget in enumerate(max_new):
            self.max_new[first + r] = budget
        if self.turns is not None:
            self.turns.blocks[batch % self.ring] = turns
        self.unfinished[batch] = self.per_batch
        self.added += 1
        return batch

    def _end(self, slots: list) -> None:
        if slots:
            for row in self.row[torch.tensor(slots, device=self.row.device)].tolist():
                block = row // self.per_batch
                self.unfinished[self.taken + (block - self.taken) % self.ring] -= 1
        super()._end(slots)

    def run_until_taken(self) -> Rollout:
        """Decode until every row of the oldest batch has ended; its ``Rollout``, its block of the
        outputs then cleared for the batch ``ahead + 1`` later."""
        batch = self.taken
        if batch == self.added:
            raise ValueError("the stream has no batch to take: add one first")
        if self.unfinished[batch]:
            looked = self.started
            if not self.started:
                self._admit(list(range(self.settings.slots)))
                self.started = True
            elif not self.stalled:
                self._refill()  # the batches added since the last look, into the slots free then
            self._advance(lambda: self.unfinished[batch] > 0, looked)
        return self._take(batch)

    def _take(self, batch: int) -> Rollout:
        block, size = batch % self.ring, self.sizes.pop(batch)
        rows = slice(block * self.per_batch, (block + 1) * self.per_batch)
        first = batch * self.per_batch
        prompt_ids = [self.prompts[first + r - r % size] for r in range(self.per_batch)]
        out = self._rows_out(rows, prompt_ids)  # copies: the block is cleared below
        self.tokens_out[rows] = self.pad
        for output in (self.logprobs_out, self.mask_out, self.stopped_out, self.versions_out):
            output[rows] = 0
        for r in range(0, self.per_batch, size):
            del self.prompts[first + r]
        for r in range(self.per_batch):
            del self.max_new[first + r]
            self.turn_start.pop(rows.start + r, None)
        del self.unfinished[batch]
        self.taken += 1
        return out

    def state_dict(self) -> dict:
        """What the next call depends on, the cache aside (the stream adds it)."""
        if self.paused or self.continued:
            raise ValueError("a stream with rows between tool turns cannot be saved")
        tensors = {k: getattr(self, k).clone() for k in STATE_TENSORS + STATE_OUTPUTS}
        host = copy.deepcopy({k: getattr(self, k) for k in STATE_HOST})
        return {**tensors, **host, "pending": list(self.pending), "stalled": sorted(self.stalled)}

    def load_state_dict(self, state: dict) -> None:
        for k in STATE_TENSORS + STATE_OUTPUTS:
            getattr(self, k).copy_(state[k])
        for k, value in copy.deepcopy({k: state[k] for k in STATE_HOST}).items():
            setattr(self, k, value)
        self.pending = deque(state["pending"])
        self.stalled = set(state["stalled"])


class RolloutStream:
    """Batches in, rollouts out, the batch never drained (see the module's docstring). Made by
    :meth:`fastppo.Sampler.stream`; not thread-safe."""

    def __init__(self, sampler, loop: StreamLoop, draw):
        self.sampler, self.loop, self.draw = sampler, loop, draw
        #: Decode steps, slots run, and rows decoding (summed over steps) by the last :meth:`next`,
        #: steps with under a quarter of the slots decoding, and seconds it waited for tools.
        self.steps = self.rows_decoded = self.live_rows = self.sparse_steps = 0
        self.tool_wait_seconds = 0.0

    @property
    def in_flight(self) -> int:
        """Batches added and not yet taken."""
        return self.loop.added - self.loop.taken

    @property
    def saveable(self) -> bool:
        """Whether :meth:`state_dict` can hold the stream: fastppo's cache, no episodes."""
        return self.sampler.cached is not None and self.loop.turns is None

    def add(self, prompts, turns: Optional[Turns] = None, max_new_tokens=None, per_row: bool = False) -> int:
        """Queue a batch of ``prompts_per_batch`` prompts (token-id lists; ``turns`` for episodes, one
        row per sample); returns its number. Its rows enter as slots free up, after the earlier
        batches' prompts. ``max_new_tokens``: as ``generate`` takes it (an int, one per prompt or
        one per row), each at most the stream's; default: the stream's. ``per_row``: every row has
        a prompt of its own (an environment's observation made each sample's prompt its own), so
        ``prompts`` holds ``prompts_per_batch * num_samples_per_prompt`` of them, one sample each,
        in the batch's row order."""
        loop = self.loop
        size = 1 if per_row else loop.n
        if len(prompts) * size != loop.per_batch:
            raise ValueError(f"a batch of this stream holds {loop.per_batch // size} prompts, got {len(prompts)}")
        if (turns is None) != (loop.turns is None):
            raise ValueError("turns go with a stream made with episodes=True, and only there")
        max_new = self.sampler._check_prompts(prompts, loop.budget if max_new_tokens is None else max_new_tokens, size)
        if max(max_new) > loop.budget:
            raise ValueError(f"max_new_tokens of a batch is at most the stream's, {loop.budget}, got {max(max_new)}")
        cache = self.sampler.kv_cache
        if cache is not None and cache.paged:
            self.sampler._check_kv_memory(prompts, size, max_new, turns is not None)
        return loop.add(prompts, max_new, turns, per_row)

    def next(self, version: int) -> Rollout:
        """The oldest batch's rollout, once all its rows have ended. ``version`` names the weights the
        model has now (the packed copy is refreshed from them): the tokens drawn from here on record
        it. Rows of later batches stay in flight."""
        loop, sampler = self.loop, self.sampler
        sampler.refresh()
        loop.version = version
        before = (loop.steps_run, loop.rows_decoded, loop.live_steps, loop.sparse_steps, loop.tool_wait)
        with sampling_mode(sampler.model):
            rollout = loop.run_until_taken()
        after = (loop.steps_run, loop.rows_decoded, loop.live_steps, loop.sparse_steps, loop.tool_wait)
        self.steps, self.rows_decoded, self.live_rows, self.sparse_steps, self.tool_wait_seconds = (
            a - b for a, b in zip(after, before)
        )
        return rollout

    def state_dict(self) -> dict:
        """The rows in flight (their tokens, log-probs, versions and slots), the schedule, the draw's
        generator and the cache's contents: a stream that loads it continues bitwise."""
        if not self.saveable:
            raise ValueError("only a stream over fastppo's cache (not the generic path) without episodes can be saved")
        loop = self.loop
        generator = self.draw.generator
        return {
            "loop": loop.state_dict(),
            "cache": self.sampler.kv_cache.state_dict(loop._span() if loop.offset else 0),
            "generator": None if generator is None else generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s ``state``, taken from a stream made with the same options."""
        self.loop.load_state_dict(state["loop"])
        self.sampler.kv_cache.load_state_dict(state["cache"])
        if state["generator"] is not None:
            self.draw.generator.set_state(state["generator"])
