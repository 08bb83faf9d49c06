"""Continuous batching: rows that finish leave the batch, waiting prompts take their slots, and none
of it changes a rollout. Greedy rows equal generate() on every lean family and the generic path
with packing and refilling mid-rollout (checks forced every 2 steps), log-probs equal a recomputed
forward, seeds reproduce, more prompts than slots come back in order, and the decode work is
bounded by the tokens generated."""

from pathlib import Path

import pytest
import torch

import fastppo
from fastppo.rollout import batching, lean
from tests.rollout.models import BUDGETS, FAMILIES, GENERIC, RAGGED_PROMPTS, hf_greedy, recomputed_logprobs, tiny


@pytest.fixture
def often(monkeypatch):
    """Check for ended rows every 2 steps (as on an accelerator, every 16), so ended rows linger a step."""
    monkeypatch.setattr(batching, "CPU_SYNC_EVERY", 2)


class Spy:
    """Counts what the loop asks of a decoder: rows decoded, rows moved by packing, late prefills
    and those of them beside rows still live (a refill, not a new wave)."""

    def __init__(self, monkeypatch, sampler):
        self.decoded = self.moved = self.late_prefills = self.refills = 0
        loop_init = batching.RolloutLoop.__init__
        spy = self

        def init(loop, settings, *args, **kwargs):
            loop_init(loop, settings, *args, **kwargs)
            decoder, decode = settings.decoder, settings.decode
            prefill, pack = decoder.prefill, decoder.pack

            def counted_decode(tokens, positions, span, live):
                spy.decoded += tokens.shape[0]
                return decode(tokens, positions, span, live)

            def counted_prefill(slots, prompts):
                spy.late_prefills += loop.steps_run > 0
                spy.refills += loop.steps_run > 0 and bool(loop.active[: loop.b].any())
                return prefill(slots, prompts)

            def counted_pack(order, length):
                spy.moved += sum(src != dst for dst, src in enumerate(order))
                return pack(order, length)

            loop.decode = counted_decode
            decoder.prefill, decoder.pack = counted_prefill, counted_pack

        monkeypatch.setattr(batching.RolloutLoop, "__init__", init)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_with_packing_and_refilling_equals_generate(family, often, monkeypatch):
    model = tiny(family)
    sampler = fastppo.Sampler(model, max_batch_size=3, max_seq_len=24)  # 6 prompts through 3 slots
    spy = Spy(monkeypatch, sampler)
    rollout = sampler.generate(RAGGED_PROMPTS, max_new_tokens=BUDGETS, temperature=0, stop_token_ids=())
    for row, (prompt, budget) in enumerate(zip(RAGGED_PROMPTS, BUDGETS)):
        assert rollout.response_ids[row, :budget].tolist() == hf_greedy(model, prompt, budget), f"row {row}"
    assert rollout.response_lens.tolist() == BUDGETS and rollout.prompt_ids == RAGGED_PROMPTS
    if sampler.fast_path:
        assert spy.moved > 0 and spy.refills > 0  # both happened mid-rollout, beside live rows
    else:
        assert spy.late_prefills > 0  # a second wave


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2", "gpt_neox", GENERIC])
def test_sampled_rows_with_packing_and_refilling(family, often, monkeypatch):
    """Log-probs equal a recomputed forward, a seed reproduces, and stopping is exact."""
    model = tiny(family)
    sampler = fastppo.Sampler(model, max_batch_size=4, max_seq_len=24)
    spy = Spy(monkeypatch, sampler)
    stops = (11, 23, 50, 77)  # some rows stop early, some run to their budget
    runs = [
        sampler.generate(
            RAGGED_PROMPTS,
            max_new_tokens=BUDGETS,
            temperature=0.9,
            stop_token_ids=stops,
            seed=3,
            num_samples_per_prompt=2,
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0].response_ids, runs[1].response_ids)
    assert torch.equal(runs[0].logprobs, runs[1].logprobs)
    rollout = runs[0]
    assert rollout.prompt_ids == [p for p in RAGGED_PROMPTS for _ in range(2)]
    for row in range(len(rollout.prompt_ids)):
        n = int(rollout.response_lens[row])
        torch.testing.assert_close(
            rollout.logprobs[row, :n], recomputed_logprobs(model, rollout, row, 0.9), rtol=0, atol=1e-4
        )
        tokens = rollout.response_ids[row, :n].tolist()
        stopped = rollout.finish_reason[row] == "stop"
        assert n <= BUDGETS[row // 2] and (n == BUDGETS[row // 2] or stopped)
        assert not any(t in stops for t in tokens[:-1]) and (tokens[-1] in stops) == stopped
        assert not rollout.response_mask[row, n:].any() and (rollout.logprobs[row, n:] == 0).all()
    assert spy.late_prefills > 0


def test_more_prompts_than_slots_equal_one_big_batch(often):
    """Greedy through 2 slots (3 samples of a prompt through 3) equals all rows at once, in order."""
    model = tiny("qwen3")
    prompts = RAGGED_PROMPTS * 3
    one_batch = fastppo.Sampler(model, max_batch_size=64, max_seq_len=24).generate(
        prompts, max_new_tokens=BUDGETS * 3, temperature=0, stop_token_ids=(), num_samples_per_prompt=3
    )
    for slots in (3, 4, 7):
        small = fastppo.Sampler(model, max_batch_size=slots, max_seq_len=24).generate(
            prompts, max_new_tokens=BUDGETS * 3, temperature=0, stop_token_ids=(), num_samples_per_prompt=3
        )
        assert small.prompt_ids == one_batch.prompt_ids == [p for p in prompts for _ in range(3)]
        assert torch.equal(small.response_ids, one_batch.response_ids), slots
        torch.testing.assert_close(small.logprobs, one_batch.logprobs, rtol=0, atol=1e-5)


def test_packing_never_and_always_agree(often):
    model = tiny("llama")
    rollouts = [
        fastppo.Sampler(model, max_batch_size=6, max_seq_len=24, compact_below=c).generate(
            RAGGED_PROMPTS, max_new_tokens=BUDGETS, temperature=0, stop_token_ids=()
        )
        for c in (0.0, 1.0)
    ]
    assert torch.equal(rollouts[0].response_ids, rollouts[1].response_ids)
    torch.testing.assert_close(rollouts[0].logprobs, rollouts[1].logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("compact_below", [1.0, 0.0])
def test_finished_rows_cost_at_most_one_check_interval(compact_below, monkeypatch):
    """Checked every 4 steps, each row is decoded at most 3 steps past its end with packing; without
    it, rows stay put and only free slots past the last live one leave."""
    monkeypatch.setattr(batching, "CPU_SYNC_EVERY", 4)
    budgets = [2, 30, 3, 4, 30, 5, 2, 3]
    prompts = [[i + 1, i + 2] for i in range(len(budgets))]
    sampler = fastppo.Sampler(tiny("llama"), max_batch_size=8, max_seq_len=40, compact_below=compact_below)
    spy = Spy(monkeypatch, sampler)
    rollout = sampler.generate(prompts, max_new_tokens=budgets, temperature=0, stop_token_ids=())
    assert rollout.response_lens.tolist() == budgets
    assert sampler.rows_decoded == spy.decoded
    if compact_below == 1.0:
        # A row of n tokens is decoded n - 1 times (its first token comes from the prefill), plus
        # up to 3 steps before the check that sees it has ended.
        assert spy.decoded <= sum(n - 1 + 3 for n in budgets)
        assert spy.decoded < len(budgets) * (max(budgets) - 1) / 2
    else:
        assert spy.moved == 0 and spy.decoded > sum(n - 1 + 3 for n in budgets)


def test_prompts_of_length_one_and_of_the_longest_that_fits(often):
    model = tiny("llama")
    max_seq_len, new = 20, 6
    prompts = [[9], list(range(1, max_seq_len - new + 1)), [4, 4], [17]]
    rollout = fastppo.Sampler(model, max_batch_size=2, max_seq_len=max_seq_len).generate(
        prompts, max_new_tokens=new, temperature=0, stop_token_ids=()
    )
    for row, prompt in enumerate(prompts):
        assert rollout.response_ids[row].tolist() == hf_greedy(model, prompt, new), f"row {row}"


def test_the_lean_families_are_one_registry():
    """The sampler's paths, its errors and these tests read ``lean.FAMILIES``; its page names them.
    (The tests pin ``decoder="auto"`` to a hand-written forward where one serves: conftest.py.)"""
    paths = {f: fastppo.Sampler(tiny(f), max_batch_size=1, max_seq_len=8).path for f in FAMILIES}
    assert {f for f, path in paths.items() if "hand-written" in path} == set(lean.FAMILIES)
    assert paths["gpt_neox"] == "fast: gpt_neox's own modules, attending over fastppo's KV cache"
    assert paths[GENERIC].startswith("generic: the model's own forward and cache, as xglm: 0 of its 2 layers attend")
    with pytest.raises(ValueError, match="the sampler's path is generic"):
        fastppo.Sampler(tiny(GENERIC), max_batch_size=1, max_seq_len=8, attention="sdpa")
    section = (Path(__file__).resolve().parents[2] / "docs" / "sampler.md").read_text()
    assert "Lean families: " + ", ".join(f"`{f}`" for f in lean.FAMILIES) + "." in " ".join(section.split())


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(compact_below=1.5), "compact_below must be"), (dict(compact_below=True), "compact_below must be")],
)
def test_bad_sampler_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fastppo.Sampler(tiny("llama"), max_batch_size=2, max_seq_len=8, **kwargs)


def test_a_generic_cache_that_cannot_select_rows_keeps_its_batch(monkeypatch):
    """Without ``batch_select_indices`` the generic path neither packs nor shrinks; rows still come
    out right, through waves of the slots."""
    from transformers import cache_utils

    monkeypatch.delattr(cache_utils.Cache, "batch_select_indices")
    model = tiny(GENERIC)
    sampler = fastppo.Sampler(model, max_batch_size=3, max_seq_len=24)
    spy = Spy(monkeypatch, sampler)
    rollout = sampler.generate(RAGGED_PROMPTS, max_new_tokens=BUDGETS, temperature=0, stop_token_ids=())
    for row, (prompt, budget) in enumerate(zip(RAGGED_PROMPTS, BUDGETS)):
        assert rollout.response_ids[row, :budget].tolist() == hf_greedy(model, prompt, budget), f"row {row}"
    waves = (max(BUDGETS[:3]) - 1) + (max(BUDGETS[3:]) - 1)  # two waves of 3 rows, each to its longest
    assert spy.decoded == 3 * waves and spy.late_prefills == 1
