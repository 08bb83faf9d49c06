"""The sampler's flash-attn decode path: on the CPU through a float64 model of flash_attn_with_kvcache's
contract (greedy still equals generate(), log-probs still equal a recomputed forward, sliding
windows and GQA included); on a GPU with flash-attn, the real kernel against that model; and the
choice between flash and SDPA, with its errors."""

import importlib.util

import pytest
import torch

import fastppo
from fastppo.rollout import flash
from tests.rollout import flash_reference
from tests.rollout.models import GENERIC, PROMPTS, hf_greedy, recomputed_logprobs, tiny

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """Make ``attention="flash"`` take the contract model, whatever the device and dtype."""
    monkeypatch.setattr(flash, "_why_not_flash", lambda *args: None)
    monkeypatch.setattr(flash, "_load_flash", lambda: flash_reference.flash_attn_with_kvcache)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gpt2"])
def test_flash_path_decodes_greedily_like_generate(flash_on_cpu, family):
    model = tiny(family)
    sampler = fastppo.Sampler(model, max_batch_size=8, max_seq_len=64, attention="flash", kv_cache="paged")
    assert sampler.attention == "flash" and sampler.kv_cache.block_size == 256  # flash-attn's page
    rollout = sampler.generate(PROMPTS, max_new_tokens=10, temperature=0, stop_token_ids=())
    for row, prompt in enumerate(PROMPTS):
        assert rollout.response_ids[row].tolist() == hf_greedy(model, prompt, 10), f"row {row}"


def test_flash_path_over_the_static_cache(flash_on_cpu):
    model = tiny("mistral")  # a window shorter than the rows
    sampler = fastppo.Sampler(model, max_batch_size=8, max_seq_len=64, attention="flash", kv_cache="static")
    rollout = sampler.generate(PROMPTS, max_new_tokens=10, temperature=0, stop_token_ids=())
    for row, prompt in enumerate(PROMPTS):
        assert rollout.response_ids[row].tolist() == hf_greedy(model, prompt, 10), f"row {row}"


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_flash_path_logprobs_equal_a_recomputed_forward(flash_on_cpu, family):
    model = tiny(family)
    rollout = fastppo.Sampler(model, max_batch_size=8, max_seq_len=64, attention="flash").generate(
        PROMPTS, max_new_tokens=9, temperature=0.7, stop_token_ids=(), seed=1, num_samples_per_prompt=2
    )
    for row in range(len(rollout.prompt_ids)):
        n = int(rollout.response_lens[row])
        torch.testing.assert_close(
            rollout.logprobs[row, :n], recomputed_logprobs(model, rollout, row, 0.7), rtol=0, atol=1e-4
        )


def test_auto_takes_sdpa_here_and_the_generic_path_its_own():
    # An fp32 model never takes flash-attn, on any device.
    assert fastppo.Sampler(tiny("llama"), max_batch_size=2, max_seq_len=16).attention == "sdpa"
    assert fastppo.Sampler(tiny(GENERIC), max_batch_size=2, max_seq_len=16).attention == "model"


@pytest.mark.parametrize(
    "args,reason",
    [
        ((torch.device("cpu"), torch.bfloat16, torch.bfloat16, 64), "CUDA only"),
        ((torch.device("cuda"), torch.float32, torch.float32, 64), "float16 or bfloat16"),
        ((torch.device("cuda"), torch.bfloat16, torch.float32, 64), "same dtype"),
        ((torch.device("cuda"), torch.float16, torch.float16, 260), "head size"),
        ((torch.device("cuda"), torch.float16, torch.float16, 12), "head size"),
        ((torch.device("cuda"), torch.float16, torch.float16, 64, 16), "multiple of 256 positions"),
    ],
)
def test_why_flash_cannot_run(monkeypatch, args, reason):
    monkeypatch.setattr(flash.importlib.util, "find_spec", lambda name: object())
    assert reason in flash._why_not_flash(*args)
    assert flash._why_not_flash(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128) is None
    assert flash._why_not_flash(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128, 512) is None
    assert "no attention sinks" in flash._why_not_flash(
        torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128, None, True
    )


def test_bad_attention_choices_are_named():
    with pytest.raises(ValueError, match="attention must be one of"):
        fastppo.Sampler(tiny("llama"), max_batch_size=2, max_seq_len=16, attention="xformers")
    with pytest.raises(ValueError, match="cannot be used: the sampler's path is generic"):
        fastppo.Sampler(tiny(GENERIC), max_batch_size=2, max_seq_len=16, attention="flash")
    with pytest.raises(ValueError, match="attention='flash' cannot be used"):
        fastppo.Sampler(tiny("llama"), max_batch_size=2, max_seq_len=16, attention="flash")  # fp32


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn is not installed")
@pytest.mark.parametrize("window", [None, 5])
def test_real_flash_attn_keeps_the_contract(window):
    from flash_attn import flash_attn_with_kvcache

    torch.manual_seed(0)
    B, S, H, KVH, D = 6, 40, 8, 2, 64
    q = torch.randn(B, 1, H, D, dtype=torch.bfloat16)
    caches = [torch.randn(B, S, KVH, D, dtype=torch.bfloat16) for _ in range(2)]
    new = [torch.randn(B, 1, KVH, D, dtype=torch.bfloat16) for _ in range(2)]
    seqlens = torch.tensor([0, 3, 17, 38, 9, 21], dtype=torch.int32)
    window_size = (-1, -1) if window is None else (window - 1, 0)
    ours = [c.clone() for c in caches]
    expected = flash_reference.flash_attn_with_kvcache(
        q, *ours, *new, cache_seqlens=seqlens, softmax_scale=D**-0.5, causal=True, window_size=window_size
    )
    theirs = [c.clone() for c in caches]
    out = flash_attn_with_kvcache(
        q,
        *theirs,
        k=new[0],
        v=new[1],
        cache_seqlens=seqlens,
        softmax_scale=D**-0.5,
        causal=True,
        window_size=window_size,
    )
    assert torch.equal(theirs[0], ours[0]) and torch.equal(theirs[1], ours[1])
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn is not installed")
def test_real_flash_attn_keeps_the_paged_contract():
    from flash_attn import flash_attn_with_kvcache

    torch.manual_seed(0)
    B, page, H, KVH, D = 6, 256, 8, 2, 64
    table = (torch.randperm(2 * B) + 1).view(B, 2).to(torch.int32)  # 2 blocks a row, block 0 unused
    q = torch.randn(B, 1, H, D, dtype=torch.bfloat16)
    pools = [torch.randn(1 + 2 * B, page, KVH, D, dtype=torch.bfloat16) for _ in range(2)]
    new = [torch.randn(B, 1, KVH, D, dtype=torch.bfloat16) for _ in range(2)]
    seqlens = torch.tensor([0, 3, 255, 256, 300, 510], dtype=torch.int32)  # across a block's end too
    ours, theirs = [p.clone() for p in pools], [p.clone() for p in pools]
    common = dict(cache_seqlens=seqlens, softmax_scale=D**-0.5, causal=True, block_table=table)
    expected = flash_reference.flash_attn_with_kvcache(q, *ours, *new, **common)
    out = flash_attn_with_kvcache(q, *theirs, k=new[0], v=new[1], **common)
    assert torch.equal(theirs[0], ours[0]) and torch.equal(theirs[1], ours[1])
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn is not installed")
def test_flash_rollout_in_bf16_matches_a_recomputed_forward():
    model = tiny("llama").to(torch.bfloat16)
    sampler = fastppo.Sampler(model, max_batch_size=8, max_seq_len=64)
    assert sampler.attention == "flash"
    rollout = sampler.generate(PROMPTS, max_new_tokens=12, temperature=1.0, stop_token_ids=(), seed=0)
    for row in range(len(PROMPTS)):
        n = int(rollout.response_lens[row])
        torch.testing.assert_close(
            rollout.logprobs[row, :n], recomputed_logprobs(model, rollout, row, 1.0), rtol=0, atol=5e-2
        )


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_flash_path_with_packing_refilling_and_graph_sized_batches(flash_on_cpu, family, monkeypatch):
    """The CUDA-graph path's batches (rows rounded up to a power of two, the extra slots free) with
    rows ending, moving and joining every 2 steps: every key flash writes fits its cache row, and
    greedy still equals generate()."""
    from types import SimpleNamespace

    from fastppo.rollout import batching
    from tests.rollout.models import BUDGETS
    from tests.rollout.models import RAGGED_PROMPTS as RAGGED

    monkeypatch.setattr(batching, "CPU_SYNC_EVERY", 2)
    model = tiny(family)
    sampler = fastppo.Sampler(model, max_batch_size=5, max_seq_len=24, attention="flash")
    sampler.graphs = SimpleNamespace(decode=sampler.cached.decode)  # graph-sized batches, replayed eagerly
    rollout = sampler.generate(RAGGED, max_new_tokens=BUDGETS, temperature=0, stop_token_ids=())
    for row, (prompt, budget) in enumerate(zip(RAGGED, BUDGETS)):
        assert rollout.response_ids[row, :budget].tolist() == hf_greedy(model, prompt, budget), f"row {row}"
