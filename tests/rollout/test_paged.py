"""The paged KV cache: rollouts equal the static cache's token for token and in log-probs, for blocks
of 1, 16 and a size that divides no prompt, on every lean family (the generic path keeps its own
cache and is unchanged by the options); in a cache too small for every row at once rows wait and
stall rather than fail, filling it to its last block without deadlock; the sharing, reference
counts and the safety of admission in the block bookkeeping itself; a budget too small is named."""

import pytest
import torch

import fastppo
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
    for row, prompt in enumerate(RAGGED_PROMPTS):
        response, mask, logprobs, _ = reference(model, prompt, row, max_new, max_len)
        n = int(rollout.response_lens[row])
        assert rollout.response_ids[row, :n].tolist() == response, f"row {row}"
        assert rollout.response_mask[row, :n].tolist() == mask
        torch.testing.assert_close(
            rollout.logprobs[row, :n].double(), torch.tensor(logprobs, dtype=torch.float64), rtol=0, atol=1e-5
        )


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
    fits = fastppo.Sampler(model, max_batch_size=4, max_seq_len=56, kv_block_size=2, kv_memory=group.value.smallest)
    assert (
        fits.generate([[1] * 40], max_new_tokens=16, num_samples_per_prompt=4, temperature=0).response_lens.tolist()
        == [16] * 4
    )


@pytest.mark.parametrize("bad", [dict(kv_cache="dense"), dict(kv_block_size=0), dict(kv_memory=-1)])
def test_bad_kv_options_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        fastppo.Sampler(tiny("llama"), max_batch_size=2, max_seq_len=16, **bad)
