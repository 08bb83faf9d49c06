"""The rollout loop: continuous batching over a decoder's slots, so finished rows cost nothing.

The decode batch is slots ``0 .. b-1`` of the decoder (``decoder.py``). Once every ``SYNC_EVERY``
steps (the loop's one host sync; on the CPU every step) it looks at the rows: ended ones leave,
prompts still waiting are prefilled into free slots (*refill*; a generic decoder runs waves), and
below ``compact_below`` live rows move into the holes (*pack*). A row whose turn ends with a stop
token in an episode (``turns.py``) pauses in its slot and resumes by the tool schedule
(``TOOL_SCHEDULES``), its continuation prefilled onto its cache (``Decoder.extend``). Over a paged
cache prompts are admitted as the decoder *claims* their memory and rows *hold* what the next steps
write; a refused row stalls, and a loop that draws nothing for ``STUCK_LOOKS`` looks raises
:class:`RolloutStuck`. Every row writes its own output row, and the schedule depends on step counts
only (but for ``"eager"`` tools, on when they finish): a seed reproduces a rollout. docs/sampler.md
says it at length (continuous batching, multi-turn episodes, the paged cache); a stream
(``stream.py``) runs this loop over batches queued one after another."""

import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .decoder import Decoder
from .rollout import Rollout
from .turns import Turns

SYNC_EVERY = 16  # decode steps between the host's looks at which rows have ended, on an accelerator
CPU_SYNC_EVERY = 1  # and on the CPU, where ops are synchronous anyway and a look costs microseconds
TOOL_WINDOW = 16  # decode steps a paused row's tools have before the fixed schedule waits for them
TOOL_SCHEDULES = ("fixed", "eager")
TOOL_POLL = 0.001  # seconds between looks at whether a tool waited for has finished
STUCK_LOOKS = 4  # looks in a row that draw no token and leave no row decoding: the loop cannot go on


class RolloutStuck(RuntimeError):
    """The rollout loop cannot go on (no progress for ``STUCK_LOOKS`` looks, or an empty cache that
    refuses a prompt): a scheduling bug, not bad input."""


@contextlib.contextmanager
def sampling_mode(model):
    """No autograd and no dropout while sampling; the model's training flag is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def row_cap(prompt_len: int, budgets: list, max_len: int, episodes: bool) -> int:
    """The most positions a row of a prompt of ``prompt_len`` tokens reaches: the prompt and its
    samples' largest budget, or (an episode, whose tool tokens count too) the context."""
    return max_len if episodes else min(prompt_len + max(budgets), max_len)


def sync_every(device: torch.device) -> int:
    """Decode steps between the host's looks at the rows, on ``device``."""
    return CPU_SYNC_EVERY if device.type == "cpu" else SYNC_EVERY


@dataclass(frozen=True)
class LoopSettings:
    """What a rollout loop decodes with, whatever it is given to decode: one sampler call's."""

    decoder: Decoder
    decode: Callable  # the decoder's step, or its CUDA graphs'
    slots: int
    max_len: int
    draw: Callable  # logits (b, V) -> (tokens, logprobs): a step's sampling
    stop: tuple  # the token ids that end a row
    pad: int
    compact_below: float  # under this fraction of the decoded slots live, the live rows move into the holes
    bucket: Optional[Callable] = None  # b -> the slots a decode call runs, more than b for CUDA graphs of fixed sizes
    tool_schedule: str = "fixed"  # one of TOOL_SCHEDULES
    tool_window: int = TOOL_WINDOW


class RolloutLoop:
    """One ``generate`` call: ``prompts`` x ``n`` rows through the ``settings``' decoder's slots, row
    ``j * n + k`` (sample k of prompt j) drawing at most ``max_new[j * n + k]`` tokens; ``turns``
    makes the rows episodes (see the module's docstring). A decode call's slots past the rows
    decoding (``settings.bucket``) are free and harmless to run.
    """

    def __init__(
        self,
        settings: LoopSettings,
        prompts: list,
        n: int,
        max_new: list,
        on_rows_ended: Optional[Callable] = None,
        turns: Optional[Turns] = None,
    ):
        self.settings, slots = settings, settings.slots
        self.decoder, self.decode, self.draw, self.pad = settings.decoder, settings.decode, settings.draw, settings.pad
        self.max_len, self.eager = settings.max_len, settings.tool_schedule == "eager"
        self.prompts, self.n, self.max_new, self.on_rows_ended, self.turns = prompts, n, max_new, on_rows_ended, turns
        device = self.decoder.device
        # an episode's columns hold its tool tokens too: as many as its context allows
        self._allocate(len(prompts) * n, (max(max_new) if max_new else 0) if turns is None else self.max_len)
        self.stop_ids = torch.tensor(settings.stop, dtype=torch.long, device=device)
        # Per slot, on the device: its output row, prompt length, ``drawn`` the response columns
        # written (its drawn tokens, and an episode's continuations too), ``generated`` the tokens
        # it drew, its budget of those, its last token, live.
        self.row = torch.full((slots,), self.trash, dtype=torch.long, device=device)
        self.prompt_len = torch.ones(slots, dtype=torch.long, device=device)
        self.drawn = torch.zeros(slots, dtype=torch.long, device=device)
        self.generated = torch.zeros(slots, dtype=torch.long, device=device)
        self.limit = torch.zeros(slots, dtype=torch.long, device=device)
        self.token = torch.full((slots,), self.pad, dtype=torch.long, device=device)
        self.active = torch.zeros(slots, dtype=torch.bool, device=device)
        # On the host: each occupied slot's prompt length minus the decode steps run before it
        # joined, which bounds its position at every later step (for the attention span).
        self.offset = {}
        self.paused = {}  # slot -> (the step it is due at: fixed, resume; eager, its pause), its output row
        self.stalled = set()  # slots waiting for memory
        self.continued = {}  # output row -> a continuation taken but waiting for memory
        self.turn_start = {}  # output row -> the column its current turn starts at
        self.pending = deque(range(len(prompts)))
        self.b = 0  # slots 0 .. b-1 are decoded
        self.steps_run = 0
        self.rows_decoded = 0  # slots run, summed over the decode steps
        self.peak_rows = 0  # the most rows in flight (decoding, paused or stalled) at a check
        self.memory_waits = 0  # looks at which a row stalled, a resume or a prompt with free slots waited
        self.barren_looks = 0  # looks in a row that drew nothing, after which no row was decoding
        self.drew = False  # whether this look drew a token (a prefill's or a continuation's)
        self.tool_wait = 0.0  # seconds spent waiting for tools
        self.live_steps = 0  # rows decoding, summed over the decode steps (as the last look left them)
        self.sparse_steps = 0  # decode steps with under a quarter of the slots decoding
        self.sync_every = sync_every(device)
        self.version = 0  # the weights' version, recorded per token where ``versions_out`` is kept
        self.versions_out = None

    def _allocate(self, B: int, steps: int) -> None:
        """Outputs for ``B`` rows of ``steps`` columns, with one spare row (free slots write there,
        the *trash* row) and one spare column (an ended row writes pad, 0 and False at its length,
        which may be the budget)."""
        device = self.decoder.device
        self.trash = B
        self.tokens_out = torch.full((B + 1, steps + 1), self.pad, dtype=torch.long, device=device)
        self.logprobs_out = torch.zeros(B + 1, steps + 1, dtype=torch.float32, device=device)
        self.mask_out = torch.zeros(B + 1, steps + 1, dtype=torch.bool, device=device)
        self.stopped_out = torch.zeros(B + 1, dtype=torch.bool, device=device)

    def run(self) -> Rollout:
        self._admit(list(range(self.settings.slots)))
        self._advance(lambda: True)
        return self._rollout()

    def _advance(self, going: Callable, looked: bool = False) -> None:
        """Decode steps until every row has ended, or until ``going()`` is false at a look;
        ``looked``: the loop has just looked (it stopped at a look), so the first step goes at once."""
        while True:
            if self.steps_run % self.sync_every == 0 and not looked:
                if not self._check():
                    break
                self._count_progress()
                if not going():
                    break
            looked = False
            decoding = len(self.offset) - len(self.paused) - len(self.stalled)  # as of the last look
            self.live_steps += decoding
            self.sparse_steps += 4 * decoding < self.settings.slots
            rows = min(self.settings.bucket(self.b), self.settings.slots) if self.settings.bucket else self.b
            positions = self.prompt_len[:rows] + self.drawn[:rows] - 1  # where each slot's last token goes
            logits = self.decode(self.token[:rows], positions, self._span(), self.active[:rows])
            self._record(slice(0, self.b), logits[: self.b])
            self.steps_run += 1
            self.rows_decoded += rows

    def _span(self) -> int:
        """One past the largest position any slot of the batch feeds at this step."""
        return min(max(self.offset.values(), default=0) + self.steps_run + 1, self.max_len)

    def _record(self, slots, logits: Tensor) -> None:
        """Draw the next token of ``slots`` (a slice or index tensor) from ``logits`` and write it
        to their rows; rows that stop or reach their budget end."""
        tokens, logprobs = self.draw(logits)
        live, row, drawn = self.active[slots], self.row[slots], self.drawn[slots]
        tokens = torch.where(live, tokens, self.pad)
        self.tokens_out[row, drawn] = tokens
        self.logprobs_out[row, drawn] = torch.where(live, logprobs, 0.0)
        self.mask_out[row, drawn] = live
        if self.versions_out is not None:
            self.versions_out[row, drawn] = self.version
        hit = live & torch.isin(tokens, self.stop_ids)
        self.stopped_out[row] |= hit
        drawn, generated = drawn + live, self.generated[slots] + live
        self.drawn[slots], self.generated[slots], self.token[slots] = drawn, generated, tokens
        room = self.prompt_len[slots] + drawn < self.max_len  # the drawn token can be fed
        self.active[slots] = live & ~hit & (generated < self.limit[slots]) & room

    def _check(self) -> bool:
        """The host sync: pause or free the slots of rows whose turn ended, give the rows going on
        their memory, refill, resume, pack. False when all is done."""
        state = torch.stack([self.active[: self.b], self.prompt_len[: self.b] + self.drawn[: self.b] - 1])
        live, positions = state.tolist() if self.b else ([], [])  # one host copy
        active = [s for s, a in enumerate(live) if a]
        waiting = len(self.paused) + len(self.stalled)
        if self.offset and len(active) + waiting == len(self.offset) and not self._any_due(active):
            self._hold(active, positions)
            return True  # no row has ended since the last look, and none is to resume
        decoding = set(active)
        ended = [s for s in self.offset if s not in self.paused and s not in self.stalled and s not in decoding]
        if self.turns is not None:
            ended = self._end_turns(ended)
        self._end(ended)
        self._hold(active, positions)
        if not self.stalled:
            self._refill()
        self._resume_due()
        if not self.offset:  # every row resumed was truncated
            self._refill()
        live = sorted(self.offset)  # slots holding a row, decoding, paused or stalled
        if not live:
            if self.pending:  # nothing in flight will ever free what the next prompt needs
                raise self._stuck("an empty cache refused the next prompt")
            return False
        self.peak_rows = max(self.peak_rows, len(live))
        if len(live) < self.settings.compact_below * self.b or live[-1] + 1 < self.b:
            self._pack(live)
        return True

    def _count_progress(self) -> None:
        """Raise :class:`RolloutStuck` after ``STUCK_LOOKS`` looks in a row that drew no token (in a
        prefill or a continuation) and after which no row decodes."""
        if self.drew or bool(self.active[: self.b].any()):
            self.barren_looks, self.drew = 0, False
            return
        self.barren_looks += 1
        if self.barren_looks >= STUCK_LOOKS:
            raise self._stuck(f"no progress in {STUCK_LOOKS} looks")

    def _stuck(self, why: str) -> RolloutStuck:
        return RolloutStuck(
            f"the rollout cannot go on ({why}): {len(self.offset)} rows in flight ({len(self.stalled)} "
            f"waiting for KV memory, {len(self.paused)} between turns), {len(self.pending)} prompts waiting, "
            "none decoding"
        )

    def _hold(self, active: list, positions: list) -> None:
        """Memory for the positions the decoding and stalled rows write before the next check:
        rows refused stall, stalled rows granted decode again (their last token fed anew)."""
        slots = [s for s in active if s in self.offset] + sorted(self.stalled)
        if not slots:
            return
        granted = self.decoder.hold(slots, [positions[s] + self.sync_every for s in slots])
        stall = [s for s, ok in zip(slots, granted) if not ok and s not in self.stalled]
        go = [s for s, ok in zip(slots, granted) if ok and s in self.stalled]
        self.stalled.update(stall)
        self.stalled.difference_update(go)
        self.memory_waits += len(stall)
        if stall:
            self.active[torch.tensor(stall, device=self.row.device)] = False
        if go:
            index = torch.tensor(go, device=self.row.device)
            self.active[index] = True
            self.token[index] = self.tokens_out[self.row[index], self.drawn[index] - 1]

    def _refill(self) -> None:
        """Waiting prompts into the free slots (for a decoder that cannot refill, once all are free)."""
        if not self.offset:
            self.b = 0
        if self.pending and (self.decoder.refills or not self.offset):
            self._admit(sorted(set(range(self.settings.slots)) - set(self.offset)))

    def _end(self, slots: list) -> None:
        """The rows of ``slots`` are done: counted, and their slots freed."""
        if not slots:
            return
        if self.on_rows_ended is not None:
            self.on_rows_ended(len(slots))
        self._free(torch.tensor(slots, device=self.row.device, dtype=torch.long))
        self.decoder.release(slots)
        for s in slots:
            del self.offset[s]

    def _any_due(self, active: list) -> bool:
        """Whether a paused row is to resume at this look (with the decoding slots ``active``)."""
        return bool(self.paused) and (not active or any(map(self._due, self.paused)))

    def _due(self, slot: int) -> bool:
        """Whether paused ``slot`` resumes at this look while other rows decode: its tools' steps
        have passed (fixed), or its tools are done (eager; a continuation waiting for memory is)."""
        step, row = self.paused[slot]
        if self.eager:
            return row in self.continued or self.turns.ready(row)
        return step <= self.steps_run

    def _resume_due(self) -> None:
        """Resume the paused rows that are due. When no row is decoding, the paused rows instead,
        until one decodes (a row refused memory must not keep the others' turns from coming):
        fixed, group by group in the order they are due; eager, as their tools finish, waiting
        for the first when none has (a row's tools are done by their timeout)."""
        if not self.paused:
            return
        if self.active[: self.b].any():
            self._resume([s for s in self.paused if self._due(s)])
            return
        if self.eager:  # each row once: one refused memory must not be asked again at this look
            tried = set()
            while self.paused.keys() - tried and not self.active[: self.b].any():
                due = self._wait(lambda: [s for s in self.paused if s not in tried and self._due(s)])
                tried.update(due)
                self._resume(due)
            return
        for step in sorted({step for step, _ in self.paused.values()}):
            self._resume([s for s, (due, _) in self.paused.items() if due == step])
            if self.active[: self.b].any():
                return

    def _continuation(self, row: int, room: int) -> list:
        """Output row ``row``'s continuation, once its tools are done; ``room``: its context's tokens left."""
        self._wait(lambda: self.turns.ready(row))
        return list(self.turns.continuation(row, room))

    def _wait(self, found: Callable):
        """What ``found()`` gives once it is true, asked every ``TOOL_POLL`` seconds; the wait counted
        in ``tool_wait``."""
        start = time.monotonic()
        while not (value := found()):
            time.sleep(TOOL_POLL)
        self.tool_wait += time.monotonic() - start
        return value

    def _end_turns(self, ended: list) -> list:
        """Tell the turns of each row in ``ended`` whose turn is over; those whose episode goes on
        pause. Returns the slots whose episode ended."""
        if not ended:
            return []
        index = torch.tensor(ended, device=self.row.device, dtype=torch.long)
        rows = self.row[index]
        state = [rows, self.prompt_len[index], self.drawn[index], self.generated[index], self.limit[index]]
        state = torch.stack([*state, self.stopped_out[rows].long()]).t().tolist()  # one host copy
        over = []
        for s, (row, P, drawn, generated, limit, stopped) in zip(ended, state):
            start = self.turn_start.get(row, 0)
            turn = self.tokens_out[row, start:drawn].tolist()
            may_continue = bool(stopped) and generated < limit and P + drawn < self.max_len
            if self.turns.turn_ended(row, turn, may_continue) and may_continue:
                self.paused[s] = (self.steps_run + (0 if self.eager else self.settings.tool_window), row)
            else:
                over.append(s)
        return over

    def _resume(self, slots: list) -> None:
        """Prefill the continuations of the paused ``slots`` onto their caches at their positions
        and draw each row's first token of its next turn; a continuation that leaves no room for
        one drawn token ends its episode as truncated."""
        if not slots:
            return
        index = torch.tensor(slots, device=self.row.device, dtype=torch.long)
        rows, drawn = self.row[index], self.drawn[index]
        # each row's last token is fed again: a paused slot rewrote its position
        state = torch.stack([rows, drawn, self.prompt_len[index], self.tokens_out[rows, drawn - 1]]).t().tolist()
        fed, feeding, starts, truncated = [], [], [], []
        for s, (row, d, P, last) in zip(slots, state):
            tokens = self.continued.pop(row, None)
            if tokens is None:
                tokens = self._continuation(row, self.max_len - P - d)
            if P + d + len(tokens) >= self.max_len:
                del self.paused[s]
                self.turns.truncated(row)
                truncated.append(s)
                continue
            if not self.decoder.hold([s], [P + d + len(tokens) + self.sync_every])[0]:
                self.paused[s], self.continued[row] = (self.steps_run, row), tokens  # no memory yet: at the next look
                self.memory_waits += 1
                continue
            del self.paused[s]
            self.tokens_out[row, d : d + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            self.turn_start[row] = d + len(tokens)
            fed.append(s)
            feeding.append([last] + tokens)
            starts.append(P + d - 1)
        if truncated:  # ends as "length", its last turn's stop kept in the mask
            self.stopped_out[self.row[torch.tensor(truncated, device=self.row.device)]] = False
            self._end(truncated)
        if not fed:
            return
        logits = self.decoder.extend(fed, feeding, starts)  # (len(fed), V)
        self.drew = True
        index = torch.tensor(fed, device=self.row.device, dtype=torch.long)
        self.stopped_out[self.row[index]] = False
        self.drawn[index] += torch.tensor([len(t) - 1 for t in feeding], device=self.row.device)
        self.active[index] = True
        self._record(index, logits)
        for s, start, tokens in zip(fed, starts, feeding):
            self.offset[s] = start + len(tokens) - self.steps_run  # the next decode's position, less the step

    def _free(self, slots) -> None:
        """Slots hold no row: their output goes to the trash row, and they feed pad at position 0.
        (Left as they were, a graph-sized batch would decode them at positions the span may no
        longer cover once the rows that set it have ended.)"""
        self.row[: self.b][slots] = self.trash
        self.prompt_len[: self.b][slots] = 1
        self.drawn[: self.b][slots] = 0
        self.generated[: self.b][slots] = 0
        self.token[: self.b][slots] = self.pad
        self.active[: self.b][slots] = False

    def _admit(self, free: list) -> None:
        """Prefill as many waiting prompts as ``free`` slots hold (all samples of a prompt together)
        and draw their first tokens."""
        chosen = []
        while self.pending:
            j = self.pending[0]
            P, size = len(self.prompts[j]), self._samples(j)
            if len(free) < size:
                break
            if not self.decoder.claim(free[:size], P, self.cap(j), P + self.sync_every):
                self.memory_waits += 1
                break
            chosen.append((self.pending.popleft(), free[:size]))
            free = free[size:]
        if not chosen:
            return
        logits = self.decoder.prefill([s for _, s in chosen], [self.prompts[j] for j, _ in chosen])  # (G, V)
        self.drew = True
        device = logits.device
        slots = torch.tensor([s for _, ss in chosen for s in ss], device=device)
        self.row[slots] = torch.tensor([self._out_row(j, k) for j, ss in chosen for k in range(len(ss))], device=device)
        self.prompt_len[slots] = torch.tensor([len(self.prompts[j]) for j, ss in chosen for _ in ss], device=device)
        self.limit[slots] = torch.tensor(
            [self._budget(j, k) for j, ss in chosen for k in range(len(ss))], device=device
        )
        self.drawn[slots] = 0
        self.generated[slots] = 0
        self.active[slots] = True
        sizes = torch.tensor([len(ss) for _, ss in chosen], device=device)
        self._record(slots, logits.repeat_interleave(sizes, dim=0, output_size=len(slots)))  # (rows, V)
        for j, ss in chosen:
            for s in ss:
                self.offset[s] = len(self.prompts[j]) - self.steps_run
        self.b = max(self.b, max(s for _, ss in chosen for s in ss) + 1)

    def _out_row(self, prompt: int, sample: int) -> int:
        """The output row of sample ``sample`` of prompt ``prompt``."""
        return prompt * self.n + sample

    def _samples(self, prompt: int) -> int:
        """How many rows prompt ``prompt`` is decoded in: its samples, prefilled together."""
        return self.n

    def _budget(self, prompt: int, sample: int) -> int:
        """The most tokens sample ``sample`` of prompt ``prompt`` may draw."""
        return self.max_new[prompt * self.n + sample]

    def cap(self, prompt: int) -> int:
        """The most positions a row of prompt ``prompt`` reaches (``row_cap``)."""
        budgets = [self._budget(prompt, k) for k in range(self._samples(prompt))]
        return row_cap(len(self.prompts[prompt]), budgets, self.max_len, self.turns is not None)

    def _pack(self, live: list) -> None:
        """Shrink the batch to the live rows: all of them moved into the holes below ``len(live)``
        when fewer than ``compact_below`` of the batch are live, else only the free slots past the
        last live one dropped."""
        k = len(live) if len(live) < self.settings.compact_below * self.b else live[-1] + 1
        order = list(range(k))
        holes = (s for s in range(k) if s not in self.offset)
        for hole, src in zip(holes, (s for s in live if s >= k)):
            order[hole] = src
        if not self.decoder.pack(order, self._span()):
            return
        index = torch.tensor(order, device=self.row.device)
        for state in (self.row, self.prompt_len, self.drawn, self.generated, self.limit, self.token, self.active):
            state[:k] = state[index]
        self._free(slice(k, self.b))
        self.offset = {new: self.offset[old] for new, old in enumerate(order) if old in self.offset}
        self.paused = {new: self.paused[old] for new, old in enumerate(order) if old in self.paused}
        self.stalled = {new for new, old in enumerate(order) if old in self.stalled}
        self.b = k

    def _rollout(self) -> Rollout:
        return self._rows_out(slice(0, self.trash), [self.prompts[r // self.n] for r in range(self.trash)])

    def _rows_out(self, rows: slice, prompt_ids: list) -> Rollout:
        """The ``Rollout`` of output rows ``rows``, in tensors of its own (the outputs may be reused)."""
        mask = self.mask_out[rows]
        lens = mask.sum(dim=1)
        if self.turns is not None:  # an episode's length is its last drawn token's column, plus one
            columns = torch.arange(mask.shape[1], device=lens.device)
            lens = torch.where(mask, columns + 1, 0).amax(dim=1)
        R = int(lens.max())
        return Rollout(
            prompt_ids=prompt_ids,
            response_ids=self.tokens_out[rows, :R].clone(),
            response_mask=mask[:, :R].clone(),
            response_lens=lens,
            logprobs=self.logprobs_out[rows, :R].clone(),
            finish_reason=["stop" if s else "length" for s in self.stopped_out[rows].tolist()],
            versions=None if self.versions_out is None else self.versions_out[rows, :R].clone(),
        )
