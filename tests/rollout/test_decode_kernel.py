"""The sampler's decode attention through fastppo's own Triton kernel (in the interpreter here): greedy
rollouts equal generate() over the paged cache (a group's prompt read once, by the cascade) and the
static one, log-probs equal the twin's, multi-turn episodes (their continuations through the kernel
too) equal a re-prefilling reference; the paged cache keeps the cascade's tensors in place as rows
come and go; and the choice of the kernel, which a fake CUDA device pins."""

import pytest
import torch

import fastppo
from fastppo.ops.dispatch import TRITON_INSTALLED
from fastppo.rollout import flash
from fastppo.rollout.paged import CASCADE_MEMBERS, PagedKVCache
from tests.rollout.models import PROMPTS, hf_greedy, tiny
from tests.rollout.test_turns import check_greedy_episodes

needs_triton = pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")


# The interpreter runs every program of every layer: one family by default (GQA, the cascade), the rest slow.
@needs_triton
@pytest.mark.parametrize(
    "family, kv_cache",
    [
        ("llama", "paged"),
        pytest.param("mistral", "paged", marks=pytest.mark.slow),  # a window shorter than the rows
        pytest.param("gpt2", "paged", marks=pytest.mark.slow),  # one query head per KV head
        pytest.param("qwen3", "static", marks=pytest.mark.slow),
    ],
)
def test_the_kernel_decodes_greedily_like_generate(family, kv_cache):
    model = tiny(family)
    # Blocks of 4: the 7-token prompt's first block is shared by its 3 samples, so the cascade reads it.
    sampler = fastppo.Sampler(
        model, max_batch_size=9, max_seq_len=40, attention="triton", kv_cache=kv_cache, kv_block_size=4
    )
    assert sampler.attention == "triton"
    rollout = sampler.generate(PROMPTS, max_new_tokens=8, temperature=0, stop_token_ids=(), num_samples_per_prompt=3)
    for row in range(len(rollout.prompt_ids)):
        expected = hf_greedy(model, rollout.prompt_ids[row], 8)
        assert rollout.response_ids[row].tolist() == expected, f"row {row}"


@needs_triton
@pytest.mark.slow  # the interpreter: ~10 s
def test_the_kernel_s_logprobs_equal_the_twin_s():
    """Blocks of 4 positions: the 7-token prompt's first block is shared by its three samples, so the
    cascade reads it once for them while the twin gathers it for each."""
    model = tiny("llama")
    rollouts = []
    for attention in ("triton", "sdpa"):
        sampler = fastppo.Sampler(
            model, max_batch_size=9, max_seq_len=40, attention=attention, kv_cache="paged", kv_block_size=4
        )
        rollouts.append(
            sampler.generate(
                PROMPTS, max_new_tokens=8, temperature=0.8, seed=3, stop_token_ids=(), num_samples_per_prompt=3
            )
        )
    kernel, twin = rollouts
    assert torch.equal(kernel.response_ids, twin.response_ids)
    torch.testing.assert_close(kernel.logprobs, twin.logprobs, rtol=0, atol=1e-5)


@needs_triton
@pytest.mark.slow  # the interpreter: ~15 s each (the op's own test of queries naming their rows is quick)
@pytest.mark.parametrize("kv_cache", ["paged", "static"])
def test_greedy_episodes_on_the_kernel_equal_a_re_prefilling_reference(kv_cache):
    """Multi-turn episodes: each continuation's tokens attend over their row's keys through the kernel
    too, each as a query of its row up to its own position."""
    check_greedy_episodes("llama", 4, sampler_options=dict(attention="triton", kv_cache=kv_cache, kv_block_size=4))


def test_the_paged_cache_keeps_its_cascade_in_place():
    cache = PagedKVCache(1, 13, 2, 40, 8, torch.float32, torch.device("cpu"), block_size=4, num_blocks=130)
    tensors = [t.data_ptr() for t in (cache._members, cache._shared, cache._starts)]
    assert cache.cascade(13) is None  # nothing shared yet
    assert cache.claim([0, 1, 2], prompt_len=9, cap=20, positions=10)  # 2 full blocks shared
    assert cache.claim(list(range(3, 3 + CASCADE_MEMBERS + 1)), prompt_len=5, cap=20, positions=6)  # 1 shared
    assert cache.claim([12], prompt_len=3, cap=20, positions=4)  # no full block: nothing to share
    cascade = cache.cascade(13)
    assert cascade.members[0].tolist() == [0, 1, 2] + [-1] * (CASCADE_MEMBERS - 3)
    assert cascade.members[1].tolist() == list(range(3, 3 + CASCADE_MEMBERS))  # a group over two entries
    assert cascade.members[2].tolist() == [3 + CASCADE_MEMBERS] + [-1] * (CASCADE_MEMBERS - 1)
    assert cascade.shared[:4].tolist() == [8, 4, 4, 0] and cascade.longest == 40
    assert cascade.starts.tolist() == [8, 8, 8] + [4] * (CASCADE_MEMBERS + 1) + [0]
    cache.release([1, 2] + list(range(4, 3 + CASCADE_MEMBERS + 1)))  # every group down to one row
    assert cache.cascade(13) is None
    cache.move([0, 3, 12], length=10)
    assert cache.table[1, 0] == cache.held[1][0]
    assert cache.claim([3, 4], prompt_len=4, cap=20, positions=5)
    cascade = cache.cascade(5)
    assert cascade.starts.tolist() == [8, 4, 0, 4, 4] and cascade.members[2, :2].tolist() == [3, 4]
    assert [t.data_ptr() for t in (cache._members, cache._shared, cache._starts)] == tensors  # graphs replay over them


def test_auto_takes_the_kernel_on_cuda_without_flash_attn(monkeypatch):
    monkeypatch.setattr(flash, "TRITON_INSTALLED", True)
    cuda = torch.device("cuda")  # a fake device: only the choice is made, nothing runs on it
    assert flash.kernel_backend("auto", cuda) == "triton"
    assert flash.kernel_backend("sdpa", cuda) == "torch"
    assert flash.kernel_backend("auto", torch.device("cpu")) == "torch"
    monkeypatch.setattr(flash.importlib.util, "find_spec", lambda name: None)  # no flash-attn
    assert flash.flash_decode("auto", cuda, torch.bfloat16, torch.bfloat16, 128, 16) is None
    monkeypatch.setattr(flash, "TRITON_INSTALLED", False)
    assert flash.kernel_backend("auto", cuda) == "torch"


def test_attention_triton_names_why_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention='triton' cannot be used"):
        fastppo.Sampler(tiny("llama"), max_batch_size=2, max_seq_len=16, attention="triton")
