"""The rollout stream: batches whose rows enter while earlier batches finish. A stream that runs no
batch ahead is ``generate``; one that runs ahead draws the same greedy tokens with the right
log-probs, records the weights' version of every token, keeps its rows in flight across weight
changes, and continues bitwise from its saved state, on both caches, through a hand-written forward
and through a model's own modules (Qwen3-MoE)."""

import pytest
import torch

import fastppo
from fastppo.rollout.stream import RingTurns
from tests.rollout.models import RAGGED_PROMPTS, hf_greedy, interface_model, recomputed_logprobs, tiny

CACHES = ["static", "paged"]
FAMILIES = ["llama", "qwen3_moe"]  # a hand-written forward; the model's own modules


def model_of(family):
    return tiny(family) if family == "llama" else interface_model(family, initializer_range=0.2)


OPTIONS = dict(temperature=1.0, num_samples_per_prompt=2, seed=11, stop_token_ids=(5,))


def sampler(model, cache, slots=4):
    return fastppo.Sampler(model, max_batch_size=slots, max_seq_len=40, kv_cache=cache, kv_block_size=None)


def batches():
    """Three batches of two prompts each."""
    return [RAGGED_PROMPTS[i : i + 2] for i in range(0, 6, 2)]


def nudge(model, seed):
    """A weight change between batches, as an update makes."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)


def run(stream, model, prompts, ahead, *, change=True, stop_at=None):
    """The stream's rollouts of ``prompts`` (batches), ``ahead`` batches added before they are
    taken, the weights nudged before each take after the first; stops before taking ``stop_at``."""
    out, added = [], 0
    for k in range(len(prompts)):
        while added < len(prompts) and added <= k + ahead:
            stream.add(prompts[added])
            added += 1
        if k == stop_at:
            return out
        if change and k:
            nudge(model, k)
        out.append(stream.next(version=k))
    return out


@pytest.mark.parametrize("cache", CACHES)
def test_a_stream_running_nothing_ahead_is_generate(cache):
    model = tiny("llama")
    s = sampler(model, cache)
    expected = s.generate(batches()[0], max_new_tokens=12, **OPTIONS)
    stream = s.stream(prompts_per_batch=2, ahead=0, max_new_tokens=12, **OPTIONS)
    stream.add(batches()[0])
    got = stream.next(version=0)
    for name in ("response_ids", "response_mask", "response_lens", "logprobs"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert got.finish_reason == expected.finish_reason and got.prompt_ids == expected.prompt_ids
    assert (got.versions == 0).all()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("ahead", [1, 2])
def test_greedy_rows_ahead_equal_generate_and_log_probs_a_forward(cache, ahead, family):
    model = model_of(family)
    s = sampler(model, cache, slots=3)  # 2 samples a prompt, 3 slots: a batch always waits for slots
    options = {**OPTIONS, "temperature": 0.0, "stop_token_ids": ()}
    stream = s.stream(prompts_per_batch=2, ahead=ahead, max_new_tokens=9, **options)
    rollouts = run(stream, model, batches(), ahead, change=False)
    for rollout, prompts in zip(rollouts, batches()):
        assert rollout.prompt_ids == [p for p in prompts for _ in range(2)]
        for row, prompt in enumerate(rollout.prompt_ids):
            assert rollout.response_ids[row].tolist() == hf_greedy(model, prompt, 9), row
            torch.testing.assert_close(
                rollout.logprobs[row], recomputed_logprobs(model, rollout, row, 1.0), rtol=0, atol=1e-5
            )
    assert stream.in_flight == 0


@pytest.mark.parametrize("cache", CACHES)
def test_rows_in_flight_record_the_version_that_drew_each_token(cache):
    model = tiny("llama")
    s = sampler(model, cache)
    stream = s.stream(prompts_per_batch=2, ahead=1, max_new_tokens=16, **{**OPTIONS, "stop_token_ids": ()})
    rollouts = run(stream, model, batches(), 1)
    first, second, third = rollouts
    assert (first.versions[first.response_mask] == 0).all()
    drawn = second.versions[second.response_mask]
    assert set(drawn.tolist()) == {0, 1}  # begun during the first batch's tail, finished after the change
    for rollout, k in zip(rollouts, range(3)):
        rows = rollout.versions.masked_fill(~rollout.response_mask, k)
        assert (rows[:, 1:] >= rows[:, :-1]).all() and (rows <= k).all()  # a row's versions only grow
    assert (third.versions[third.response_mask] >= 1).all()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("ahead", [1, 2])
def test_a_stream_loaded_from_its_state_continues_bitwise(cache, ahead, family):
    """Stop after the first batch with rows of the next in flight, save, load into a fresh sampler
    on the same weights: the rest of the run is bitwise the uninterrupted one's."""
    options = {**OPTIONS, "stop_token_ids": (5, 9)}
    straight_model = model_of(family)
    straight = sampler(straight_model, cache).stream(prompts_per_batch=2, ahead=ahead, max_new_tokens=14, **options)
    expected = run(straight, straight_model, batches(), ahead)

    model = model_of(family)
    stream = sampler(model, cache).stream(prompts_per_batch=2, ahead=ahead, max_new_tokens=14, **options)
    before = run(stream, model, batches(), ahead, stop_at=1)
    state = stream.state_dict()
    assert stream.loop.offset  # rows in flight at the save

    fresh = sampler(model, cache).stream(prompts_per_batch=2, ahead=ahead, max_new_tokens=14, **options)
    fresh.load_state_dict(state)
    after = []
    for k in (1, 2):
        if k + ahead < 3 and k + ahead >= fresh.loop.added:
            fresh.add(batches()[k + ahead])
        nudge(model, k)
        after.append(fresh.next(version=k))
    for got, want in zip(before + after, expected):
        for name in ("response_ids", "response_mask", "logprobs", "versions"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_a_row_stalled_for_memory_at_the_save_is_stalled_after_the_load():
    """A row waiting for KV memory when the stream is saved waits after the load too (it is fed its
    last token again when memory comes), and both go on alike."""
    options = {**OPTIONS, "stop_token_ids": (5, 9)}
    streams, models = [], []
    for _ in range(2):
        models.append(tiny("llama"))
        streams.append(sampler(models[-1], "paged").stream(prompts_per_batch=2, ahead=1, max_new_tokens=14, **options))
    run(streams[0], models[0], batches(), 1, stop_at=1)
    stalled = {min(streams[0].loop.offset)}  # a row in flight, as a refused grant leaves it
    streams[0].loop.stalled = set(stalled)
    streams[1].load_state_dict(streams[0].state_dict())
    models[1].load_state_dict(models[0].state_dict())
    assert streams[1].loop.stalled == stalled
    assert streams[0].loop.added == 3  # every batch is in: what is left is taking them
    for k in (1, 2):
        outs = []
        for model, stream in zip(models, streams):
            nudge(model, k)
            outs.append(stream.next(version=k))
        for name in ("response_ids", "response_mask", "logprobs", "versions"):
            assert torch.equal(getattr(outs[0], name), getattr(outs[1], name)), name


@pytest.mark.parametrize("cache", CACHES)
def test_a_batch_whose_rows_have_prompts_of_their_own_is_generate_of_one_sample_each(cache):
    model = tiny("llama")
    s = sampler(model, cache)
    prompts = RAGGED_PROMPTS[:4]
    expected = s.generate(prompts, max_new_tokens=12, **{**OPTIONS, "num_samples_per_prompt": 1})
    stream = s.stream(prompts_per_batch=2, ahead=0, max_new_tokens=12, **OPTIONS)
    stream.add(prompts, per_row=True)
    got = stream.next(version=0)
    for name in ("response_ids", "response_mask", "response_lens", "logprobs"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert got.prompt_ids == [list(p) for p in prompts] and got.finish_reason == expected.finish_reason


@pytest.mark.parametrize("cache", CACHES)
def test_batches_of_shared_and_own_prompts_mix_in_one_stream(cache):
    """Greedy rows of a stream whose middle batch gives each row its own prompt, run one batch
    ahead on 3 slots (so batches overlap): each row is HF's greedy continuation of its own prompt."""
    model = tiny("llama")
    stream = sampler(model, cache, slots=3).stream(
        prompts_per_batch=2, ahead=1, max_new_tokens=9, **{**OPTIONS, "temperature": 0.0, "stop_token_ids": ()}
    )
    own = RAGGED_PROMPTS[2:6]
    added = [(batches()[0], False), (own, True), (batches()[2], False)]
    rollouts = []
    for k in range(3):
        while stream.loop.added < min(k + 2, 3):
            prompts, per_row = added[stream.loop.added]
            stream.add(prompts, per_row=per_row)
        rollouts.append(stream.next(version=k))
    expected_prompts = [[p for p in batches()[0] for _ in range(2)], own, [p for p in batches()[2] for _ in range(2)]]
    for rollout, prompts in zip(rollouts, expected_prompts):
        assert rollout.prompt_ids == [list(p) for p in prompts]
        for row, prompt in enumerate(prompts):
            assert rollout.response_ids[row].tolist() == hf_greedy(model, prompt, 9), row
    assert stream.in_flight == 0 and not stream.loop.prompts and not stream.loop.max_new


class Scripted(RingTurns.__mro__[1]):
    """Turns that end each row's episode after its first turn, recording who asked."""

    def __init__(self):
        self.asked = []

    def turn_ended(self, row, turn, may_continue):
        self.asked.append(row)
        return False

    def continuation(self, row, room):
        raise AssertionError("no episode goes on")

    def truncated(self, row):
        raise AssertionError("no episode goes on")


def test_each_batch_s_turns_are_asked_about_their_own_rows():
    model = tiny("llama")
    stream = sampler(model, "static").stream(
        prompts_per_batch=2, ahead=1, max_new_tokens=6, episodes=True, **{**OPTIONS, "stop_token_ids": ()}
    )
    turns = [Scripted() for _ in range(3)]
    for k in range(2):
        stream.add(batches()[k], turns[k])
    stream.next(version=0)
    stream.add(batches()[2], turns[2])
    stream.next(version=1)
    stream.next(version=2)
    assert [sorted(t.asked) for t in turns] == [[0, 1, 2, 3]] * 3


def test_bad_use_is_refused_naming_what():
    model = tiny("llama")
    s = sampler(model, "static")
    with pytest.raises(ValueError, match="ahead must be an int >= 0"):
        s.stream(prompts_per_batch=2, ahead=-1, max_new_tokens=4)
    stream = s.stream(prompts_per_batch=2, ahead=1, max_new_tokens=4)
    with pytest.raises(ValueError, match="holds 2 prompts, got 1"):
        stream.add(batches()[0][:1])
    with pytest.raises(ValueError, match="holds 4 prompts, got 2"):  # 2 prompts x 2 samples: 4 rows of their own
        s.stream(prompts_per_batch=2, ahead=0, max_new_tokens=4, **OPTIONS).add(batches()[0], per_row=True)
    with pytest.raises(ValueError, match="no batch to take"):
        stream.next(version=0)
    with pytest.raises(ValueError, match="at most the stream's, 4, got 5"):
        stream.add(batches()[0], max_new_tokens=[4, 5])
    with pytest.raises(ValueError, match="turns go with a stream made with episodes=True"):
        stream.add(batches()[0], Scripted())
    stream.add(batches()[0])
    stream.add(batches()[1])
    with pytest.raises(ValueError, match="holds 2 batches at once"):
        stream.add(batches()[2])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        s.stream(prompts_per_batch=1, ahead=0, max_new_tokens=4).add([[]])
