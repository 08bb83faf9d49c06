"""Every decoder family whose attention goes through transformers' attention interface decodes over
fastppo's cache (``rollout/interface.py``): its own modules, each layer's keys and values stored in the
sampler's cache and attended there. On tiny random models of each family: greedy rows equal
``generate()`` with more rows than slots (rows joining mid-batch); over a paged cache of small blocks
(a group's prompt blocks shared) greedy rows equal it too and sampled log-probs equal the model's own
forward on prompt + response; episodes equal a reference that re-reads the conversation; the Triton
decode kernel (the interpreter) serves the families that pass sinks, a soft cap and windows. What the
attention cannot honour is refused by name, and the families that stay generic say why."""

import pytest
import torch

import fastppo
from fastppo.rollout import decoders
from tests.rollout.models import PROMPTS, RAGGED_PROMPTS, hf_greedy, interface_model, recomputed_logprobs
from tests.rollout.test_turns import check_greedy_episodes
from tests.trainer.runs import ops_on_triton

# The families RL users train most after Llama and dense Qwen, each with what its attention brings:
# experts (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral), sinks and alternating windows (GPT-OSS), a soft
# cap (Gemma 2), local and global layers with their own scale (Gemma 3), QK norms (OLMo 2), layers
# without rotary embedding (SmolLM3), attention and logit multipliers (Granite), ...
FAMILIES = [
    "qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3",
    "glm4", "granite", "cohere2", "starcoder2",
]  # fmt: skip
MEASURED = decoders._faster  # the choice itself, which the tests' conftest pins elsewhere
# and every other family of transformers' that was tried, MLA's decompressed keys (DeepSeek-V2) among them
MORE = [
    "olmo3", "phimoe", "granitemoe", "granitemoeshared", "ernie4_5", "ernie4_5_moe", "exaone4", "helium",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "internlm3", "jetmoe", "ministral", "nemotron", "olmo", "persimmon", "phi",
    "seed_oss", "stablelm", "arcee", "apertus", "bitnet", "cohere", "gemma", "glm", "glm4_moe", "opt", "gpt_bigcode",
    "gptj", "codegen", "deepseek_v2",
]  # fmt: skip


def _greedy_equals_generate(model, sampler, n=1):
    rollout = sampler.generate(PROMPTS, max_new_tokens=10, temperature=0, stop_token_ids=(), num_samples_per_prompt=n)
    for row, prompt in enumerate(PROMPTS):
        expected = hf_greedy(model, prompt, 10)
        for sample in range(n):
            assert rollout.response_ids[row * n + sample].tolist() == expected, f"prompt {row}, sample {sample}"


@pytest.mark.parametrize("family", FAMILIES + MORE)
def test_greedy_rows_joining_mid_batch_equal_generate(family):
    model = interface_model(family)
    sampler = fastppo.Sampler(model, max_batch_size=2, max_seq_len=40)  # 3 rows through 2 slots
    assert sampler.fast_path and sampler.path == f"fast: {family}'s own modules, attending over fastppo's KV cache"
    assert sampler.kv_cache is not None and sampler.weights.bytes == 0  # the model's own modules, no copy
    _greedy_equals_generate(model, sampler)


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_shared_prompts_and_sampled_logprobs(family):
    """Blocks of 3 positions: the 7-token prompt's two full blocks shared by its 3 samples, the
    partial one copied; 9 rows through 4 slots."""
    model = interface_model(family)
    sampler = fastppo.Sampler(model, max_batch_size=4, max_seq_len=40, kv_block_size=3)
    assert sampler.kv_cache.paged
    _greedy_equals_generate(model, sampler, n=3)
    rollout = sampler.generate(
        PROMPTS, max_new_tokens=12, temperature=1.0, seed=3, num_samples_per_prompt=3, stop_token_ids=()
    )
    for row in range(len(rollout.prompt_ids)):
        n = int(rollout.response_lens[row])
        torch.testing.assert_close(
            rollout.logprobs[row, :n], recomputed_logprobs(model, rollout, row, 1.0), rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma2", "gemma3_text", "smollm3", "cohere2", "phi3"])
@pytest.mark.parametrize("kv", [{}, {"kv_block_size": 4}])
def test_episodes_equal_a_re_prefilling_reference(family, kv):
    model = interface_model(family, initializer_range=0.2)
    check_greedy_episodes(model, 3, sampler_options=kv)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2", "gemma3_text"])
def test_the_decode_kernel_serves_sinks_softcaps_and_windows(family, monkeypatch):
    """The Triton kernel (the interpreter): GPT-OSS's sinks and alternating windows, Gemma 2's soft
    cap, Gemma 3's local and global layers; a paged cache of small blocks and the cascade over the
    samples' shared prompt."""
    pytest.importorskip("triton")
    from fastppo.kernels import decode_attention as kernels

    launches, launch = [], kernels.decode_attention

    def spy(q, k, v, table, rows, lengths, max_length, scale, window, softcap, sinks, cascade, out, **options):
        launches.append((window, softcap, sinks is not None, cascade is not None))
        return launch(q, k, v, table, rows, lengths, max_length, scale, window, softcap, sinks, cascade, out, **options)

    monkeypatch.setattr(kernels, "decode_attention", spy)
    model = interface_model(family)
    sampler = fastppo.Sampler(model, max_batch_size=4, max_seq_len=40, kv_block_size=3, attention="triton")
    assert sampler.attention == "triton"
    _greedy_equals_generate(model, sampler, n=2)
    windows, softcaps, sinks, cascades = (set(x) for x in zip(*launches))
    assert windows == {6, None} if family != "gemma3_text" else 6 in windows
    assert softcaps == ({model.config.attn_logit_softcapping} if family == "gemma2" else {None})
    assert sinks == {family == "gpt_oss"} and True in cascades


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "gemma2", "gemma3_text"])
def test_episodes_through_the_decode_kernel(family, monkeypatch):
    """An episode's continuations through the same kernel, each token a query of its row."""
    pytest.importorskip("triton")
    ops_on_triton(monkeypatch)
    check_greedy_episodes(interface_model(family, initializer_range=0.2), 3, sampler_options={"attention": "triton"})


def test_what_a_family_passes_is_honoured():
    """The model's own values reach the cache attention: Gemma 2's soft cap and scale, GPT-OSS's sinks
    and its windows (one layer windowed, one not)."""
    from fastppo.rollout import attention as cache_attention

    seen = []
    prefill = cache_attention.CacheAttention.prefill

    def spy(self, layer, slots, q, k, v, how):
        seen.append((layer, *how[:3], None if how.sinks is None else how.sinks.clone()))
        return prefill(self, layer, slots, q, k, v, how)

    for family in ("gemma2", "gpt_oss"):
        model = interface_model(family)
        sampler = fastppo.Sampler(model, max_batch_size=1, max_seq_len=16)
        seen.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cache_attention.CacheAttention, "prefill", spy)
            sampler.generate([[1, 2, 3]], max_new_tokens=1, temperature=0)
        c = model.config
        if family == "gemma2":
            assert [s[1:4] for s in seen] == [
                (c.query_pre_attn_scalar**-0.5, 6, c.attn_logit_softcapping),
                (c.query_pre_attn_scalar**-0.5, None, c.attn_logit_softcapping),
            ]
        else:
            assert [s[2] for s in seen] == [6 if t == "sliding_attention" else None for t in c.layer_types]
            for layer, *_, sinks in seen:
                assert torch.equal(sinks, model.model.layers[layer].self_attn.sinks)


def test_a_keyword_the_attention_does_not_honour_is_refused_by_name():
    model = interface_model("olmo2")
    forward = model.forward
    model.forward = lambda *args, **kwargs: forward(*args, **kwargs, attention_bias=torch.ones(1))
    sampler = fastppo.Sampler(model, max_batch_size=1, max_seq_len=16)
    assert not sampler.fast_path
    assert sampler.path == (
        "generic: the model's own forward and cache, as olmo2's attention passes attention_bias=a tensor (1,), "
        "which fastppo's cache attention does not honour"
    )
    with pytest.raises(ValueError, match="attention='triton' cannot be used: the sampler's path is generic.*olmo2"):
        fastppo.Sampler(model, max_batch_size=1, max_seq_len=16, attention="triton")


@pytest.mark.parametrize(
    "family, extra, why",
    [
        (
            "qwen3_next",
            {"layer_types": ["linear_attention", "full_attention"]},
            "qwen3_next: its layer types ['linear_attention'] are not full or sliding-window attention",
        ),
        ("falcon_h1", {}, "falcon_h1: its layer types ['hybrid'] are not full or sliding-window attention"),
        ("xglm", {"d_model": 32, "attention_heads": 4, "num_layers": 2}, "xglm: 0 of its 2 layers attend through"),
        ("bloom", {"n_layer": 2, "n_head": 4}, "bloom: 0 of its 2 layers attend through"),
    ],
)
def test_families_the_cache_cannot_serve_say_why(family, extra, why):
    model = interface_model(family, **extra)
    sampler = fastppo.Sampler(model, max_batch_size=2, max_seq_len=16)
    assert not sampler.fast_path and why in sampler.path
    rollout = sampler.generate(RAGGED_PROMPTS[:2], max_new_tokens=4, temperature=0, stop_token_ids=())
    for row, prompt in enumerate(RAGGED_PROMPTS[:2]):
        assert rollout.response_ids[row].tolist() == hf_greedy(model, prompt, 4)


def test_a_decoder_can_be_named():
    """A hand-written family through its own modules gives the same tokens; a decoder that cannot serve
    the model is refused by name."""
    from tests.rollout.models import tiny

    llama = tiny("llama")
    own = fastppo.Sampler(llama, max_batch_size=2, max_seq_len=40, decoder="modules")
    assert own.path == "fast: llama's own modules, attending over fastppo's KV cache" and own.decoder == "modules"
    assert fastppo.Sampler(llama, max_batch_size=2, max_seq_len=40).decoder == "lean"
    _greedy_equals_generate(llama, own)
    generic = fastppo.Sampler(interface_model("qwen3_moe"), max_batch_size=2, max_seq_len=40, decoder="generic")
    assert not generic.fast_path and "as asked (decoder='generic')" in generic.path and generic.decoder == "generic"
    with pytest.raises(ValueError, match="decoder='lean' cannot be used: no hand-written forward serves this gemma2"):
        fastppo.Sampler(interface_model("gemma2"), max_batch_size=2, max_seq_len=40, decoder="lean")
    with pytest.raises(ValueError, match="decoder='modules' cannot be used: xglm: 0 of its 2 layers"):
        fastppo.Sampler(tiny("xglm"), max_batch_size=2, max_seq_len=40, decoder="modules")
    with pytest.raises(ValueError, match="decoder must be one of"):
        fastppo.Sampler(llama, max_batch_size=2, max_seq_len=40, decoder="fast")


@pytest.mark.parametrize("slower", ["lean", "modules"])
def test_auto_keeps_the_hand_written_forward_only_where_it_times_faster(monkeypatch, tmp_path, caplog, slower):
    """The decode step of the one made slower (by 30 ms) loses; the choice is logged and kept for the
    next sampler on this machine, which does not time again; either way greedy rows equal generate()."""
    import time

    from fastppo.rollout import calibration
    from fastppo.rollout.interface import InterfaceDecoder
    from fastppo.rollout.lean import LlamaLikeDecoder
    from tests.rollout.models import tiny

    monkeypatch.setattr(decoders, "_faster", MEASURED)
    monkeypatch.setattr(calibration, "_cache_file", lambda: tmp_path / "layouts.json")
    slowed = {"lean": LlamaLikeDecoder, "modules": InterfaceDecoder}[slower]
    decode, timed = slowed.decode, []

    def slow_decode(self, *args):
        timed.append(1)
        time.sleep(0.03)
        return decode(self, *args)

    monkeypatch.setattr(slowed, "decode", slow_decode)
    llama = tiny("llama")
    with caplog.at_level("INFO", logger="fastppo.rollout.calibration"):
        sampler = fastppo.Sampler(llama, max_batch_size=2, max_seq_len=40)
    faster = "modules" if slower == "lean" else "lean"
    assert f"rollout decoder: {faster} for 2 rows" in caplog.text
    assert (
        sampler.path
        == {
            "lean": "fast: a hand-written llama forward over fastppo's KV cache",
            "modules": "fast: llama's own modules, attending over fastppo's KV cache (timed faster here)",
        }[faster]
    )
    timed.clear()
    # as in a new process: nothing registered with transformers yet
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from fastppo.rollout.interface import IMPLEMENTATION

    monkeypatch.delitem(ALL_ATTENTION_FUNCTIONS._global_mapping, IMPLEMENTATION)
    again = fastppo.Sampler(llama, max_batch_size=2, max_seq_len=40)
    assert again.path == sampler.path and not timed  # read from the cache file, not timed again
    monkeypatch.setattr(slowed, "decode", decode)
    _greedy_equals_generate(llama, again)
