"""The sampler over a model split across gloo ranks (``rollout/tensor_parallel.py``): the same tokens
as one rank's whole model for the same seeds, greedy and sampled, top-k and top-p included, and
log-probs within 1e-5; each rank's KV cache and weights a 1/N share; what cannot be split refused
by name."""

import copy
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fastppo
from fastppo.rollout.tensor_parallel import Unsharded, tp_plan
from tests.ranks import rank_environment, spawn

from .models import FAMILIES, LLAMA_LIKE, interface_model

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42], [7, 7], [3, 1, 4, 1, 5], [9], [2, 7, 1, 8], [60, 61]]
SAMPLES, NEW = 4, 32  # 8 prompts x 4 samples x 32 tokens: 1,024 sampled tokens a case
CASES = [  # (options of generate, label)
    (dict(temperature=0.0), "greedy"),
    (dict(temperature=1.0), "sampled"),
    (dict(temperature=0.8, top_k=5, top_p=0.9), "top-k, top-p"),
]


def _model(family: str):
    torch.manual_seed(0)
    if family == "llama4kv":  # four KV heads: whole heads over four ranks
        return LlamaForCausalLM(LlamaConfig(**{**LLAMA_LIKE, "num_attention_heads": 8, "num_key_value_heads": 4}))
    if family == "llama3kv":  # three KV heads: neither over two ranks nor a whole number of them on each
        return LlamaForCausalLM(
            LlamaConfig(**{**LLAMA_LIKE, "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3})
        )
    return FAMILIES[family]() if family in FAMILIES else interface_model(family)


def _worker(rank, port, out, families, world):
    from torch.distributed.device_mesh import init_device_mesh

    from fastppo.bench.measure import storage_bytes
    from fastppo.rollout.tensor_parallel import parallelize

    rank_environment(rank, port, world)
    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    found = {}
    for family in families:
        model = _model(family).eval()
        whole = fastppo.Sampler(model, max_batch_size=16, max_seq_len=48, decoder="modules")
        split = parallelize(copy.deepcopy(model), mesh)
        # paged (blocks of 8, a prompt's full blocks shared by its samples) against the whole model's static cache
        sampler = fastppo.Sampler(split, max_batch_size=16, max_seq_len=48, decoder="modules", kv_block_size=8)
        cases = {}
        for options, label in CASES:
            kwargs = dict(max_new_tokens=NEW, num_samples_per_prompt=SAMPLES, seed=11, **options)
            want, got = whole.generate(PROMPTS, **kwargs), sampler.generate(PROMPTS, **kwargs)
            same = got.response_ids == want.response_ids
            live = want.response_mask & got.response_mask & same
            cases[label] = {
                "tokens": int(want.response_mask.sum()),
                "differ": int((~same & (want.response_mask | got.response_mask)).sum()),
                "logprob_error": float((got.logprobs - want.logprobs)[live].abs().max()),
            }
        found[family] = {
            "cases": cases,
            "kv_heads": [sampler.kv_cache.k[0].shape[-2], whole.kv_cache.k[0].shape[-2]],
            "paged": sampler.kv_cache.paged,
            "weight_bytes": [storage_bytes(split.parameters()), storage_bytes(model.parameters())],
            "path": sampler.path,
        }
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(found, f)
    torch.distributed.destroy_process_group()


def _check(found: dict, world: int) -> None:
    for family, result in found.items():
        for label, case in result["cases"].items():
            assert case["tokens"] >= 1000 if label != "greedy" else case["tokens"] > 0, (family, label)
            # the row-parallel sums round in another order: a near tie could flip; none does here
            assert case["differ"] == 0, (family, label, case)
            assert case["logprob_error"] <= 1e-5, (family, label, case)
        local, whole = result["kv_heads"]
        assert local == max(whole // world, 1), family  # each rank caches its own KV heads, or its one
        split, full = result["weight_bytes"]
        # norms and biases whole beside 1/N (and the key and value projections, where KV heads are fewer)
        assert split < full / world * (1.1 if whole >= world else 1.5), (family, split, full)
        assert "own modules" in result["path"] and result["paged"]


@pytest.mark.parametrize(
    "families",
    [
        ["llama", "gpt_neox"],  # GQA; one fused QKV matrix, per head
        pytest.param(["qwen3", "mistral"], marks=pytest.mark.slow),  # QK norms; a sliding window
    ],
    ids=str,
)
def test_two_ranks_decode_the_whole_models_tokens(tmp_path, families):
    spawn(_worker, str(tmp_path), families, 2)
    for rank in range(2):
        _check(json.loads((tmp_path / f"rank{rank}.json").read_text()), 2)


@pytest.mark.slow
def test_four_ranks_decode_the_whole_models_tokens(tmp_path):
    # four KV heads, one a rank; and two, each on two ranks (the key and value projections whole on each)
    spawn(_worker, str(tmp_path), ["llama4kv", "llama"], 4, world=4)
    for rank in range(4):
        _check(json.loads((tmp_path / f"rank{rank}.json").read_text()), 4)


@pytest.mark.parametrize(
    "family, size, says",
    [
        ("gpt2", 2, "declares no tensor-parallel layout"),
        ("llama3kv", 2, "has 3 KV heads, which neither divide over 2 ranks nor divide them"),
        ("llama", 3, "has 4 attention heads, which do not divide over 3 ranks"),
        ("gpt_neox", 8, "has 4 attention heads, which do not divide over 8 ranks"),
    ],
)
def test_what_cannot_be_split_is_refused_by_name(family, size, says):
    with pytest.raises(Unsharded, match=says):
        tp_plan(_model(family), size)


def test_a_layout_style_it_does_not_apply_is_named():
    model = _model("llama")
    model.config.base_model_tp_plan = {"layers.*.mlp.experts": "grouped_gemm", **model.config.base_model_tp_plan}
    with pytest.raises(Unsharded, match="shards layers.\\*.mlp.experts as 'grouped_gemm'"):
        tp_plan(model, 2)


def test_the_plan_adds_the_vocabulary_split_embedding_and_head():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = tp_plan(_model("llama"), 2)
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel) and isinstance(plan["lm_head"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.self_attn.o_proj"], RowwiseParallel)
