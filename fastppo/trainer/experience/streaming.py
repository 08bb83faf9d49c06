"""Rollouts that never drain (``--max-staleness K``): the iterations' batches through one
:class:`~fastppo.rollout.stream.RolloutStream`, up to ``K`` of them ahead of the one being trained on.

Iteration ``i`` takes batch ``i`` from the stream once every row of it has ended; before that, the
batches of iterations ``i + 1 .. i + K`` have been added, so their rows enter the slots that batch
``i``'s finished rows leave, and after the update they go on decoding with the new weights. A token
drawn by the weights of version ``v`` (the policy after ``v`` updates) and trained on at iteration
``i`` is ``i - v`` versions stale, at most ``K``; the update corrects for it (``update/loss.py``:
decoupled PPO, with the importance weights of ``config.rollout_is_cap``). Near the end no batch is
added past the run's last iteration, so the run drains once, at its end.

The schedule depends on step counts only, as the sampler's does, so a seed reproduces a run. A
checkpoint holds the stream (its rows in flight with their cache and the draw's generator) and the
prompts of each batch in flight, so a resume continues bitwise. Where the stream cannot be saved
(episodes: a tool's thread and an environment's object live outside it; a model on the generic
path) or ``K`` changed, the checkpoint's batches in flight are sampled again from their prompts:
the run continues, not exactly, and says so.
"""

import warnings
from collections import deque

import torch

from ...rollout.paged import KVMemoryError
from . import responses
from .sampled import Sampled


def decode_metrics(steps: int, live_rows: int, sparse_steps: int) -> dict:
    """A rollout's decode occupancy: rows decoding per step, and the share of steps with under a
    quarter of the slots decoding."""
    return {"decode_rows_per_step": live_rows / max(steps, 1), "decode_sparse_steps": sparse_steps / max(steps, 1)}


def staleness_metrics(versions: torch.Tensor, mask: torch.Tensor, iteration: int, ahead: int) -> dict:
    """How many versions old the sampled tokens of ``mask`` were at ``iteration``: the mean, the
    most, and the share of tokens at each staleness ``0 .. ahead``."""
    lag = (iteration - versions)[mask]  # (tokens,)
    count = max(lag.numel(), 1)
    return {
        "staleness_mean": float(lag.float().sum()) / count,
        "staleness_max": int(lag.max()) if lag.numel() else 0,
        **{f"staleness/share_{k}": float((lag == k).sum()) / count for k in range(ahead + 1)},
    }


class Streaming:
    """The stream of ``rollouts``' sampler, ``ahead`` batches past the one being trained on."""

    def __init__(self, rollouts, ahead: int):
        self.rollouts, self.ahead = rollouts, ahead
        self.stream = None  # made at the first batch, over the sampler's cache
        self.batches = deque()  # (the prompts chosen, the turns, each row's prompt text) of each batch, oldest first
        self.added = 0  # batches added to the stream by this process
        self.saved = None  # a checkpoint's stream, loaded at the first batch

    def next_batch(self, iteration: int, state):
        """Iteration ``iteration``'s batch, sampled and scored; the stream topped up to ``ahead``
        batches past it (not past the run's last iteration) first."""
        c, rollouts = self.rollouts.config, self.rollouts
        r = c.rollout
        if self.stream is None:
            self._start()
        per_iteration = r.prompts_per_iteration * rollouts.ranks.world
        while len(self.batches) <= self.ahead and (
            rollouts.waiting or state.prompts_drawn // per_iteration < c.run.iterations
        ):
            self._add(rollouts.draw(state))
        stream = self.stream
        rollout = stream.next(version=iteration)
        chosen, turns, texts = self.batches.popleft()
        rollout = responses.cut_at_stop_strings(rollout, rollouts.tokenizer, r.stop)
        sampled = Sampled(rollout, texts, None if turns is None else turns.rows, stream.tool_wait_seconds)
        stats = {
            **decode_metrics(stream.steps, stream.live_rows, stream.sparse_steps),
            **staleness_metrics(rollout.versions, rollout.response_mask, iteration, self.ahead),
        }
        return rollouts.scored(chosen, sampled, stats)

    def _start(self) -> None:
        """The stream, over the sampler, with a checkpoint's rows in flight where it holds them."""
        c, rollouts = self.rollouts.config, self.rollouts
        r, ranks = c.rollout, rollouts.ranks
        self.stream = rollouts.sampler.stream(
            prompts_per_batch=r.prompts_per_iteration,
            ahead=self.ahead,
            temperature=r.temperature,
            num_samples_per_prompt=r.samples_per_prompt,
            seed=(c.run.seed * 100_003 - 1) * ranks.world + ranks.rank,  # no iteration's seed
            episodes=c.episodes,
            **rollouts.sampling_options(),
        )
        if self.saved is not None:
            self.stream.load_state_dict(self.saved["stream"])
            n = c.rollout.samples_per_prompt
            self.batches.extend(
                (chosen, None, rollouts.prompts.row_texts(chosen, n)) for chosen in self.saved["batches"]
            )
            self.saved = None

    def _add(self, chosen: list) -> None:
        """A batch of the prompts ``chosen`` into the stream; with tools, as episodes, whose
        environments are reset from a pool of the batch's own (pool 0 stays the held-out
        evaluation's): the ``ahead + 1`` batches in flight never share an instance."""
        rollouts, n = self.rollouts, self.rollouts.config.rollout.samples_per_prompt
        pool = 1 + self.added % (self.ahead + 1)
        turns, texts, ids, per_prompt = rollouts.prompted(rollouts.prompts, chosen, n, pool)
        try:
            self.stream.add(ids, turns, per_row=per_prompt < n)
        except KVMemoryError as error:  # a prompt whose samples the cache could never hold at once
            raise rollouts.refused(error) from None
        self.batches.append((chosen, turns, texts))
        self.added += 1

    def state_dict(self) -> dict:
        """The batches in flight: their prompts, and the stream where it can be saved."""
        stream = self.stream
        return {
            "ahead": self.ahead,
            "batches": [list(chosen) for chosen, _, _ in self.batches],
            "stream": stream.state_dict() if stream is not None and stream.saveable else None,
        }


def resume_in_flight(saved, rollouts) -> None:
    """Continue a checkpoint's batches in flight (``Streaming.state_dict``'s, or None): in the
    stream of ``rollouts`` where it holds them at the same ``max_staleness``, else sampled again
    from their prompts, said in a warning."""
    if saved is None or not saved["batches"]:
        return
    streaming = rollouts.streaming
    if streaming is not None and saved["stream"] is not None and saved["ahead"] == streaming.ahead:
        streaming.saved = saved
        return
    rollouts.waiting.extend(saved["batches"])
    why = "the stream could not be saved" if saved["stream"] is None else "max_staleness changed"
    warnings.warn(
        f"the checkpoint's {len(saved['batches'])} batch(es) in flight are sampled again from their "
        f"prompts ({why}): the run continues, not exactly"
    )
