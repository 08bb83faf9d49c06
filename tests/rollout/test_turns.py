"""Multi-turn rollouts in the sampler: a row paused between turns keeps its slot and cache and gets
its continuation prefilled at its position. Greedy episodes equal, token for token and in their
log-probs, a reference that prefills the whole conversation again for every token, on either tool
schedule; the fixed schedule does not depend on how long a continuation took, and the eager one
resumes a row as soon as its tools are done and never waits for them while another row can decode."""

import random
import time

import pytest
import torch

import fastppo
from fastppo.rollout.turns import Turns
from tests.rollout.models import FAMILIES, GENERIC, RAGGED_PROMPTS, V, tiny
from tests.trainer.runs import ops_on_triton

STOP = tuple(range(2, V, 4))  # many stop ids: a tiny random model's turns end often


class Scripted(Turns):
    """Episodes of up to ``turns`` turns; the continuation after turn t of row r is made-up tokens
    of a length that varies with both. Records every call."""

    def __init__(self, turns=3, delay=0.0):
        self.turns, self.delay, self.calls, self.ended, self.cut, self.given = turns, delay, {}, [], [], []

    @staticmethod
    def tokens(row, turn):
        return [(row * 7 + turn * 3 + i) % V for i in range(1 + (row + 2 * turn) % 4)]

    def turn_ended(self, row, turn, may_continue):
        self.ended.append((row, list(turn), may_continue))
        done = self.calls.get(row, 0)
        if not may_continue or done + 1 >= self.turns:
            return False
        self.calls[row] = done + 1
        return True

    def continuation(self, row, room):
        if self.delay:
            time.sleep(random.random() * self.delay)
        self.given.append((row, self.tokens(row, self.calls[row] - 1)))
        return self.given[-1][1]

    def truncated(self, row):
        self.cut.append(row)


@torch.no_grad()
def reference(model, prompt, row, max_new, max_len, turns=3):
    """The episode by a full forward per token (no cache), the conversation re-read every time."""
    seq, response, mask, logprobs, generated = list(prompt), [], [], [], 0
    for turn in range(turns):
        while True:
            logits = model(torch.tensor([seq])).logits[0, -1].double()
            token = int(logits.argmax())
            seq.append(token)
            response.append(token)
            mask.append(True)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            generated += 1
            if token in STOP or generated >= max_new or len(seq) >= max_len:
                break
        if not (token in STOP and generated < max_new and len(seq) < max_len) or turn + 1 >= turns:
            return response, mask, logprobs, token in STOP
        more = Scripted.tokens(row, turn)
        if len(seq) + len(more) >= max_len:
            return response, mask, logprobs, False
        seq += more
        response += more
        mask += [False] * len(more)
        logprobs += [0.0] * len(more)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("slots", [2, 16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_episodes_equal_a_re_prefilling_reference(family, slots):
    check_greedy_episodes(family, slots)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", GENERIC])
def test_greedy_episodes_on_the_triton_sampling_kernel(family, monkeypatch):
    """The same with each step's draw on its Triton kernel (the interpreter, without a GPU)."""
    pytest.importorskip("triton")
    launched = ops_on_triton(monkeypatch)
    check_greedy_episodes(family, 4)
    assert launched


@pytest.mark.parametrize("schedule", [{"tool_schedule": "eager"}, {"tool_window": 0}, {"tool_window": 3}])
def test_greedy_episodes_are_the_reference_s_on_every_tool_schedule(schedule):
    check_greedy_episodes("llama", 2, **schedule)


def check_greedy_episodes(family, slots, sampler_options=(), **schedule):
    """``family``: a name of ``models.FAMILIES``, or a model."""
    model = tiny(family) if isinstance(family, str) else family
    max_new, max_len = 20, 48
    sampler = fastppo.Sampler(model, max_batch_size=slots, max_seq_len=max_len, **dict(sampler_options))
    turns = Scripted()
    rollout = sampler.generate(
        RAGGED_PROMPTS, max_new_tokens=max_new, temperature=0, stop_token_ids=STOP, turns=turns, **schedule
    )
    assert max(turns.calls.values()) == 2, "the episodes must reach their third turn"
    for row, prompt in enumerate(RAGGED_PROMPTS):
        response, mask, logprobs, stopped = reference(model, prompt, row, max_new, max_len)
        n = int(rollout.response_lens[row])
        assert rollout.response_ids[row, :n].tolist() == response, f"row {row}"
        assert rollout.response_mask[row, :n].tolist() == mask
        assert not rollout.response_mask[row, n:].any()
        torch.testing.assert_close(
            rollout.logprobs[row, :n].double(), torch.tensor(logprobs, dtype=torch.float64), rtol=0, atol=1e-5
        )
        assert rollout.finish_reason[row] == ("stop" if stopped else "length")
        assert int(rollout.response_mask[row].sum()) <= max_new
    # every prompt once, and each continuation with the turn's last token fed again: nothing re-prefilled
    prompts = sum(map(len, RAGGED_PROMPTS))
    assert sampler.prefill_tokens == prompts + sum(len(tokens) + 1 for _, tokens in turns.given)


# (family, context, budget) where some continuation does not fit the context of these prompts
@pytest.mark.parametrize("schedule", ["fixed", "eager"])
@pytest.mark.parametrize(
    "family, max_len, max_new", [("llama", 16, 9), ("gpt2", 20, 10), ("gpt_neox", 14, 6), (GENERIC, 14, 6)]
)
def test_a_continuation_past_the_context_ends_the_episode_truncated(family, max_len, max_new, schedule):
    """Rows whose continuations all end their episodes while none decodes end at one look, on
    either schedule: a look that only ends rows is no stuck loop."""
    model = tiny(family)
    turns = Scripted(turns=5)
    rollout = fastppo.Sampler(model, max_batch_size=4, max_seq_len=max_len).generate(
        RAGGED_PROMPTS, max_new_tokens=max_new, temperature=0, stop_token_ids=STOP, turns=turns, tool_schedule=schedule
    )
    for row, prompt in enumerate(RAGGED_PROMPTS):
        response, mask, _, stopped = reference(model, prompt, row, max_new, max_len, turns=5)
        n = int(rollout.response_lens[row])
        assert rollout.response_ids[row, :n].tolist() == response
        assert rollout.response_mask[row, :n].tolist() == mask
        assert len(prompt) + n <= max_len
    assert turns.cut, "some continuation must not have fitted"
    assert all(rollout.finish_reason[r] == "length" for r in turns.cut)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", GENERIC])
def test_sampled_episodes_do_not_depend_on_how_long_tools_take(family):
    model = tiny(family)
    runs = []
    for delay in (0.0, 0.01):
        sampler = fastppo.Sampler(model, max_batch_size=3, max_seq_len=40)
        runs.append(
            sampler.generate(
                RAGGED_PROMPTS,
                max_new_tokens=12,
                temperature=1.0,
                stop_token_ids=STOP,
                seed=5,
                num_samples_per_prompt=2,
                turns=Scripted(delay=delay),
            )
        )
    a, b = runs
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.logprobs, b.logprobs)


def test_turns_see_each_turn_once_with_its_stop_token():
    model = tiny("llama")
    turns = Scripted()
    rollout = fastppo.Sampler(model, max_batch_size=2, max_seq_len=40).generate(
        RAGGED_PROMPTS, max_new_tokens=14, temperature=0, stop_token_ids=STOP, turns=turns
    )
    for row in range(len(RAGGED_PROMPTS)):
        seen = [turn for r, turn, _ in turns.ended if r == row]
        n = int(rollout.response_lens[row])
        ids, mask = rollout.response_ids[row, :n].tolist(), rollout.response_mask[row, :n].tolist()
        sampled, current = [], []
        for token, m in zip(ids, mask):
            if m:
                current.append(token)
            elif current:
                sampled.append(current)
                current = []
        sampled.append(current)
        assert seen == sampled
        assert all(turn[-1] in STOP for turn in seen[:-1])


class Timed(Scripted):
    """Scripted turns whose tools take ``seconds(row)`` of wall time from the turn's end, as a
    :class:`~fastppo.agents.calls.ToolRunner`'s do: ``continuation`` blocks until they are done.
    Records, per continuation, the decode steps since the row's turn ended and whether its tools
    were done when it was asked for."""

    def __init__(self, seconds, steps):
        super().__init__()
        self.seconds, self.steps, self.done_at, self.paused_at, self.taken = seconds, steps, {}, {}, []

    def turn_ended(self, row, turn, may_continue):
        going_on = super().turn_ended(row, turn, may_continue)
        if going_on:
            self.done_at[row], self.paused_at[row] = time.monotonic() + self.seconds(row), self.steps[0]
        return going_on

    def ready(self, row):
        return time.monotonic() >= self.done_at[row]

    def continuation(self, row, room):
        self.taken.append((row, self.steps[0] - self.paused_at[row], self.ready(row)))
        time.sleep(max(0.0, self.done_at[row] - time.monotonic()))
        return super().continuation(row, room)


def timed_rollout(seconds, **schedule):
    """Greedy episodes of 4 prompts in 4 slots whose tools take ``seconds(row)``; the turns, the
    sampler and the rollout."""
    sampler = fastppo.Sampler(tiny("llama"), max_batch_size=4, max_seq_len=48)
    steps = [0]
    decode = sampler.cached.decode

    def counted(*args):
        steps[0] += 1
        return decode(*args)

    sampler.cached.decode = counted
    turns = Timed(seconds, steps)
    rollout = sampler.generate(
        RAGGED_PROMPTS[:4], max_new_tokens=20, temperature=0, stop_token_ids=STOP, turns=turns, **schedule
    )
    return turns, sampler, rollout


def test_eager_takes_a_continuation_at_the_look_its_tools_are_done_and_never_waits_while_a_row_decodes():
    slow = 0.5  # row 0's tool: longer than 16 decode steps of the tiny model take
    turns, sampler, eager = timed_rollout(lambda row: slow * (row == 0), tool_schedule="eager")
    assert turns.taken and all(done for _, _, done in turns.taken), "a continuation is taken once its tools are done"
    assert any(steps == 0 for row, steps, _ in turns.taken if row != 0), "instant tools: resumed at the same look"
    assert any(steps > 0 for row, steps, _ in turns.taken if row == 0), "row 0's slow tool: others decoded meanwhile"
    fixed_turns, _, fixed = timed_rollout(lambda row: slow * (row == 0))
    assert max(steps for _, steps, _ in fixed_turns.taken) == 16, "fixed: 16 steps, then the loop waits"
    assert torch.equal(eager.response_ids, fixed.response_ids), "greedy episodes whatever the schedule"


@pytest.mark.parametrize("schedule", ["fixed", "eager"])
def test_a_wait_for_a_tool_with_nothing_else_to_decode_is_counted(schedule):
    """One row: while its tool runs nothing can decode, so each of its tool turns is waited for."""
    sampler = fastppo.Sampler(tiny("llama"), max_batch_size=1, max_seq_len=48)
    turns = Timed(lambda row: 0.2, [0])
    start = time.monotonic()
    sampler.generate(
        RAGGED_PROMPTS[:1], max_new_tokens=20, temperature=0, stop_token_ids=STOP, turns=turns, tool_schedule=schedule
    )
    assert turns.taken and all(done for *_, done in turns.taken)  # each continuation asked once its tools were done
    assert 0 < sampler.tool_wait_seconds <= time.monotonic() - start


def test_the_fixed_window_is_the_steps_a_row_waits_while_others_decode():
    turns, _, _ = timed_rollout(lambda row: 0.0, tool_window=3)
    assert {steps for _, steps, _ in turns.taken} <= {0, 1, 2, 3} and any(steps == 3 for _, steps, _ in turns.taken)


@pytest.mark.parametrize(
    "options", [{"tool_schedule": "later"}, {"tool_window": -1}, {"tool_window": 1.5}, {"tool_window": True}]
)
def test_a_tool_schedule_it_does_not_know_is_refused_by_name(options):
    sampler = fastppo.Sampler(tiny("llama"), max_batch_size=2, max_seq_len=32)
    with pytest.raises(ValueError, match=next(iter(options))):
        sampler.generate(RAGGED_PROMPTS[:1], max_new_tokens=4, turns=Scripted(), **options)
