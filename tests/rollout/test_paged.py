"""The paged KV cache: rollouts equal the static cache's token for token and in log-probs, for blocks
of 1, 16 and a size that divides no prompt, on every lean family (the generic path keeps its own
cache and is unchanged by the options); in a cache too small for every row at once rows wait and
stall rather than fail, filling it to its last block without deadlock; the sharing, reference
counts and the safety of admission in the block bookkeeping itself; a budget too small is named."""

import pytest
import torch

import fastppo
from fastppo.rollout.batching import STUCK_LOOKS, RolloutLoop, RolloutStuck
from fastppo.rollout.paged import TRASH, KVMemoryError, PagedKVCache
from tests.rollout.models import FAMILIES, RAGGED_PROMPTS, recomputed_logprobs, tiny
from tests.rollout.test_turns import STOP, Scripted, reference

# A prompt several blocks long, one of one token; 3 + 7 and 1 + 4 end on a boundary of 5-blocks,
# 37 + 11 on one of 16-blocks (and every row on one of 1-blocks).
PROMPTS = [[1, 2, 3], [(7 * i) % 90 + 3 for i in range(37)], [42], [5, 6, 7, 8, 9, 10, 11]]
BUDGETS = [7, 11, 4, 9]


def _rollouts(model, n, **kv):
    sampler = fastppo.Sampler(model, max_batch_size=5, max_seq_len=56, **kv)
    common = dict(max_new_tokens=BUDGETS, stop_token_ids=(), num_samples_per_prompt=n)
    greedy = sampler.generate(PROMPTS, temperature=0, **common)
    sampled = sampler.generate(PROMPTS, temperature=0.9, top_k=20, seed=7, **common)
    return greedy, sampled


def _assert_same(a, b):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_paged_rollouts_equal_the_static_cache(family):
    model = tiny(family)
    static = _rollouts(model, 2, kv_cache="static")
    for block_size in (1, 16, 5):
        for a, b in zip(static, _rollouts(model, 2, kv_block_size=block_size)):
            _assert_same(a, b)
    # a group of one sample: nothing shared, the partial block its own
    for a, b in zip(_rollouts(model, 1, kv_cache="static"), _rollouts(model, 1, kv_block_size=5)):
        _assert_same(a, b)


def _block_bytes(model, block_size):
    config = model.config
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * 8 * 4  # fp32, head 8


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_cache_filled_to_its_last_block_never_deadlocks(family):
    """Rows of every length through a cache that holds a fraction of them: greedy rows equal the
    static cache's, sampled log-probs equal a recomputed forward, the cache is used to its last
    block, and rows waited for memory (fewer in flight than slots)."""
    model = tiny(family)
    prompts = RAGGED_PROMPTS + PROMPTS
    budgets = [9, 3, 12, 5, 2, 7] + BUDGETS
    static = fastppo.Sampler(model, max_batch_size=8, max_seq_len=56, kv_cache="static").generate(
        prompts, max_new_tokens=budgets, temperature=0, stop_token_ids=(), num_samples_per_prompt=2
    )
    # one row at the cap (28 blocks), the trash block, and a few more: far from 8 rows at once
    sampler = fastppo.Sampler(
        model, max_batch_size=8, max_seq_len=56, kv_block_size=2, kv_memory=34 * _block_bytes(model, 2)
    )
    cache = sampler.kv_cache
    greedy = sampler.generate(
        prompts, max_new_tokens=budgets, temperature=0, stop_token_ids=(), num_samples_per_prompt=2
    )
    _assert_same(static, greedy)
    assert cache.peak_blocks == cache.num_blocks - 1, "the cache must fill to its last block"
    assert sampler.memory_waits > 0, "rows must have waited for memory"
    assert cache.used_blocks == 0 and all(r == 0 for r in cache.refs), "every block comes back"
    sampled = sampler.generate(
        prompts, max_new_tokens=budgets, temperature=0.8, stop_token_ids=(), num_samples_per_prompt=2, seed=3
    )
    assert sampled.response_lens.tolist() == [b for b in budgets for _ in range(2)]
    for row in range(len(sampled.prompt_ids)):
        n = int(sampled.response_lens[row])
        torch.testing.assert_close(
            sampled.logprobs[row, :n], recomputed_logprobs(model, sampled, row, 0.8), rtol=0, atol=1e-5
        )


def test_paused_episodes_keep_their_blocks_in_a_small_cache():
    """Multi-turn rows continue onto their blocks at their positions while others wait for memory."""
    model = tiny("llama")
    max_new, max_len = 20, 48
    sampler = fastppo.Sampler(
        model, max_batch_size=6, max_seq_len=max_len, kv_block_size=4, kv_memory=16 * _block_bytes(model, 4)
    )
    turns = Scripted()
    rollout = sampler.generate(RAGGED_PROMPTS, max_new_tokens=max_new, temperature=0, stop_token_ids=STOP, turns=turns)
    assert max(turns.calls.values()) == 2 and sampler.memory_waits > 0
    # a continuation refused memory waits with its tokens: each pause asked the turns once
    assert len(turns.given) == sum(turns.calls.values())
    for row, prompt in enumerate(RAGGED_PROMPTS):
        response, mask, logprobs, _ = reference(model, prompt, row, max_new, max_len)
        n = int(rollout.response_lens[row])
        assert rollout.response_ids[row, :n].tolist() == response, f"row {row}"
        assert rollout.response_mask[row, :n].tolist() == mask
        torch.testing.assert_close(
            rollout.logprobs[row, :n].double(), torch.tensor(logprobs, dtype=torch.float64), rtol=0, atol=1e-5
        )


def test_no_prompt_is_admitted_while_a_row_stalls(monkeypatch):
    """Memory that comes back goes to the stalled rows first: a prompt waits, even with free slots,
    until no row is stalled (else new groups could keep a stalled row waiting)."""
    stalled_with_room, admitted_past_a_stall = [], []
    admit, hold = RolloutLoop._admit, RolloutLoop._hold

    def watched_admit(loop, free):
        waiting = len(loop.pending)
        admit(loop, free)
        if loop.stalled and len(loop.pending) < waiting:
            admitted_past_a_stall.append(loop.steps_run)

    def watched_hold(loop, active, positions):
        hold(loop, active, positions)
        if loop.stalled and loop.pending and len(loop.offset) + loop.n <= loop.settings.slots:
            stalled_with_room.append(loop.steps_run)

    monkeypatch.setattr(RolloutLoop, "_admit", watched_admit)
    monkeypatch.setattr(RolloutLoop, "_hold", watched_hold)
    model = tiny("llama")
    # 17 blocks of 1, the smallest these take: the last prompt's one token would fit beside a stall
    sampler = fastppo.Sampler(
        model, max_batch_size=5, max_seq_len=16, kv_block_size=1, kv_memory=17 * _block_bytes(model, 1)
    )
    prompts = [[23, 86, 40, 25, 57, 72], [77, 15, 15, 85], [83], [71, 58]]
    rollout = sampler.generate(prompts, max_new_tokens=[5, 12, 3, 1], temperature=0, stop_token_ids=())
    assert rollout.response_lens.tolist() == [5, 12, 3, 1]
    assert stalled_with_room, "rows must have stalled while prompts waited and slots were free"
    assert not admitted_past_a_stall


def test_episodes_are_refused_a_budget_their_context_does_not_fit():
    """An episode's tool tokens count too: its rows claim the context (48 positions, 12 blocks of
    4), not prompt + budget (10). Two samples of a 4-token prompt need 14 blocks; 13 are refused
    before any row runs, not left waiting for blocks that never come."""
    model = tiny("llama")
    sampler = fastppo.Sampler(
        model, max_batch_size=2, max_seq_len=48, kv_block_size=4, kv_memory=13 * _block_bytes(model, 4)
    )
    common = dict(max_new_tokens=6, num_samples_per_prompt=2, stop_token_ids=STOP, temperature=0)
    with pytest.raises(KVMemoryError, match="cannot admit 2 samples") as error:
        sampler.generate([[1, 2, 3, 4]], turns=Scripted(), **common)
    assert error.value.smallest == 14 * _block_bytes(model, 4)
    assert sampler.generate([[1, 2, 3, 4]], **common).response_lens.max() <= 6  # single turns fit


@pytest.mark.parametrize("refused", ["claim", "hold"])
def test_a_loop_that_cannot_go_on_raises_instead_of_spinning(monkeypatch, refused):
    """A cache that refuses every admission (a scheduling bug: the sampler checks that an empty cache
    admits every prompt) or every block after the first: the loop says it cannot go on, at once or
    after drawing nothing for STUCK_LOOKS looks, rather than spin forever or decode no rows."""
    if refused == "claim":
        monkeypatch.setattr(PagedKVCache, "claim", lambda cache, *args: False)
    else:
        monkeypatch.setattr(PagedKVCache, "hold", lambda cache, slots, positions: [False] * len(slots))
    sampler = fastppo.Sampler(tiny("llama"), max_batch_size=2, max_seq_len=16, kv_block_size=4)
    why = "an empty cache refused the next prompt" if refused == "claim" else f"no progress in {STUCK_LOOKS} looks"
    with pytest.raises(RolloutStuck, match=f"cannot go on \\({why}\\)") as stuck:
        sampler.generate([[1, 2, 3], [4]], max_new_tokens=8, stop_token_ids=())
    assert ("2 prompts waiting" if refused == "claim" else "2 waiting for KV memory") in str(stuck.value)


def _cache(num_blocks, block_size=4, slots=4, max_len=32):
    return PagedKVCache(
        1, slots, 1, max_len, 2, torch.float32, torch.device("cpu"), block_size=block_size, num_blocks=num_blocks
    )


def test_a_group_shares_its_full_prompt_blocks_and_copies_the_partial_one():
    cache = _cache(20)
    assert cache.claim([0, 1, 2], prompt_len=10, cap=20, positions=11)  # 2 full blocks, then 8 .. 10
    full = cache.held[0][:2]
    assert all(cache.held[s][:2] == full for s in (1, 2)) and all(cache.refs[b] == 3 for b in full)
    partial = [cache.held[s][2] for s in range(3)]
    assert len(set(partial)) == 3, "each sample its own partial block"
    assert cache.used_blocks == 2 + 3
    cache.k[0][partial[0]] = 7.0  # what the prefill wrote in the first sample's partial block
    cache.share([0, 0], [1, 2], [10, 10])
    assert all(bool((cache.k[0][b] == 7.0).all()) for b in partial)
    assert cache.table[0, :3].tolist() == cache.held[0] and cache.table[0, 3:].eq(TRASH).all()
    cache.release([0, 1])
    assert all(cache.refs[b] == 1 for b in full) and cache.used_blocks == 3  # the prompt stays for slot 2
    cache.release([2])
    assert cache.used_blocks == 0 and cache.table.eq(TRASH).all()


def test_admission_and_growth_keep_a_row_able_to_finish():
    """8 blocks of 4 (one trash) and rows capped at 16 positions (4 blocks): after one row of 2
    blocks, a second is admitted only while the first can still reach its cap."""
    cache = _cache(8)
    assert cache.claim([0], prompt_len=5, cap=16, positions=6)  # 2 blocks, 2 to go
    assert cache.claim([1], prompt_len=5, cap=16, positions=6)  # 3 free after: row 0 or 1 can finish
    assert not cache.claim([2], prompt_len=5, cap=16, positions=6)  # 1 free after: neither could
    assert cache.used_blocks == 4
    assert cache.hold([0, 1], [12, 12]) == [True, True]  # a block each: one can still finish
    assert cache.hold([1, 0], [16, 16]) == [True, False]  # one reaches its cap, the other stalls
    assert cache.used_blocks == 7 and cache.hold([0], [16]) == [False]
    cache.release([1])
    assert cache.hold([0], [16]) == [True] and cache.used_blocks == 4


def test_a_group_s_shared_prompt_comes_back_once_with_its_last_holder():
    """21 blocks of 1 (one trash): a row of a 4-token prompt at 8 positions, 5 blocks short of its
    cap of 13; a group of two 1-token prompts at their cap of 2 (a shared block, one each); then a
    group of two 6-token prompts capped at 14 asks for 8 blocks, leaving 1. The pair ending gives
    back 3 blocks (its shared one once): 4 free, short of the first row's 5, and the new rows need
    7 each, so it is refused. (Counted once per holder, the shared block made 5 and a deadlock.)"""
    cache = _cache(21, block_size=1, slots=5, max_len=14)
    assert cache.claim([0], prompt_len=4, cap=13, positions=5) and cache.hold([0], [8]) == [True]
    assert cache.claim([1, 2], prompt_len=1, cap=2, positions=2)
    assert not cache.claim([3, 4], prompt_len=6, cap=14, positions=7)
    assert cache.used_blocks == 11
    cache.release([0])
    assert cache.claim([3, 4], prompt_len=6, cap=14, positions=7)


def test_a_row_holds_no_block_past_its_cap():
    cache = _cache(12)
    assert cache.claim([0], prompt_len=3, cap=6, positions=4)  # blocks of 4: 2 reach the cap
    assert cache.hold([0], [40]) == [True]  # the loop asks a few positions ahead, past the cap near its end
    assert len(cache.held[0]) == 2 and cache.used_blocks == 2


def test_packing_moves_table_rows_not_data():
    cache = _cache(12)
    assert cache.claim([2], prompt_len=6, cap=12, positions=7)
    blocks, before = list(cache.held[2]), cache.k[0].clone()
    cache.move([2, 1], length=7)
    assert cache.held[0] == blocks and cache.table[0, :2].tolist() == blocks and cache.table[2].eq(TRASH).all()
    assert torch.equal(cache.k[0], before)


def test_a_budget_too_small_is_named_with_the_smallest_that_works():
    model = tiny("llama")
    row = 28 * _block_bytes(model, 2)  # 56 positions in blocks of 2
    with pytest.raises(KVMemoryError, match="kv_memory=.*smallest that works") as error:
        fastppo.Sampler(model, max_batch_size=4, max_seq_len=56, kv_block_size=2, kv_memory=row)
    assert error.value.smallest == row + _block_bytes(model, 2)
    sampler = fastppo.Sampler(model, max_batch_size=4, max_seq_len=56, kv_block_size=2, kv_memory=error.value.smallest)
    with pytest.raises(KVMemoryError, match="cannot admit 4 samples") as group:
        sampler.generate([[1] * 40], max_new_tokens=16, num_samples_per_prompt=4)
    short = fastppo.Sampler(
        model,
        max_batch_size=4,
        max_seq_len=56,
        kv_block_size=2,
        kv_memory=group.value.smallest - _block_bytes(model, 2),
    )
    with pytest.raises(KVMemoryError, match="cannot admit 4 samples") as one_block_short:
        short.generate([[1] * 40], max_new_tokens=16, num_samples_per_prompt=4)
    assert one_block_short.value.smallest == group.value.smallest
    fits = fastppo.Sampler(model, max_batch_size=4, max_seq_len=56, kv_block_size=2, kv_memory=group.value.smallest)
    assert (
        fits.generate([[1] * 40], max_new_tokens=16, num_samples_per_prompt=4, temperature=0).response_lens.tolist()
        == [16] * 4
    )


@pytest.mark.parametrize("bad", [dict(kv_cache="dense"), dict(kv_block_size=0), dict(kv_memory=-1)])
def test_bad_kv_options_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        fastppo.Sampler(tiny("llama"), max_batch_size=2, max_seq_len=16, **bad)


def test_a_block_longer_than_the_context_is_cut_to_it():
    from fastppo.rollout.paged import block_within

    assert [block_within(b, 16, 1) for b in (8, 16, 100, 256, 65536)] == [8, 16, 16, 16, 16]
    # where flash-attn decodes, a multiple of its page stays one
    assert [block_within(b, 300, 256) for b in (100, 768, 65536)] == [100, 512, 512]
    model = tiny("llama")
    prompts, common = [[1, 2, 3], [4]], dict(max_new_tokens=[9, 12], stop_token_ids=(), temperature=0)
    static = fastppo.Sampler(model, max_batch_size=4, max_seq_len=16, kv_cache="static")
    huge = fastppo.Sampler(model, max_batch_size=4, max_seq_len=16, kv_block_size=65536)
    cache = huge.cached.cache
    assert cache.block_size == 16 and cache.k[0].numel() <= static.cached.cache.k[0].numel() * 5 // 4  # + trash
    _assert_same(static.generate(prompts, **common), huge.generate(prompts, **common))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_the_smallest_budget_named_works(block_size):
    """The budget a KVMemoryError names as the smallest that works runs groups of every length to
    the end (one row in flight at a time), tokens equal to the static cache's."""
    model = tiny("llama")
    prompts, n = [[5], [(3 * i) % 90 + 1 for i in range(10)], [7, 8, 9]], 2
    common = dict(max_new_tokens=[9, 9, 3, 3, 6, 1], stop_token_ids=(), temperature=0, num_samples_per_prompt=n)
    static = fastppo.Sampler(model, max_batch_size=4, max_seq_len=19, kv_cache="static").generate(prompts, **common)
    kv = dict(max_batch_size=4, max_seq_len=19, kv_block_size=block_size)
    with pytest.raises(KVMemoryError) as too_small:
        fastppo.Sampler(model, **kv, kv_memory=1)
    sampler = fastppo.Sampler(model, **kv, kv_memory=too_small.value.smallest)
    try:
        paged = sampler.generate(prompts, **common)
    except KVMemoryError as group:  # a group's shared prompt needs more than one row
        sampler = fastppo.Sampler(model, **kv, kv_memory=group.smallest)
        paged = sampler.generate(prompts, **common)
    _assert_same(static, paged)
