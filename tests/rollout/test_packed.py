"""The packed rollout copy (``rollout/packed.py``) in every layout that runs here decodes as the
model's own modules do, catches up with the weights when they change, and is chosen by a
measurement kept per machine (``rollout/calibration.py``)."""

import json
import logging

import pytest
import torch
from torch import nn

import fastppo
from fastppo.rollout import calibration
from fastppo.rollout.weight_layouts import LAYOUTS, layouts_for

from .models import PROMPTS, RAGGED_PROMPTS, hf_greedy, recomputed_logprobs, tiny

CPU_LAYOUTS = layouts_for(torch.device("cpu"), torch.float32)
LEAN = ["llama", "qwen2", "qwen3", "mistral", "gpt2"]


def _rollout(model, **options):
    sampler = fastppo.Sampler(model, max_batch_size=8, max_seq_len=40, **options)
    return sampler, sampler.generate(
        RAGGED_PROMPTS, max_new_tokens=12, temperature=0, stop_token_ids=(), num_samples_per_prompt=2
    )


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
@pytest.mark.parametrize("layout", CPU_LAYOUTS)
@pytest.mark.parametrize("family", LEAN)
def test_the_packed_copy_decodes_as_the_live_modules(family, layout, kv_cache):
    model = tiny(family)
    _, live = _rollout(model, weights="live", kv_cache=kv_cache)
    sampler, packed = _rollout(model, weights="packed", layout=layout, kv_cache=kv_cache)
    assert sampler.weights.weights == "packed" and sampler.weights.layout == layout
    assert torch.equal(packed.response_ids, live.response_ids)
    torch.testing.assert_close(packed.logprobs, live.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", LEAN)
def test_the_default_sampler_decodes_like_generate_and_its_logprobs_are_the_models(family):
    model = tiny(family)
    sampler = fastppo.Sampler(model, max_batch_size=4, max_seq_len=40)
    assert sampler.weights.weights == "packed" and sampler.weights.layout in CPU_LAYOUTS
    rollout = sampler.generate(PROMPTS, max_new_tokens=10, temperature=0, stop_token_ids=())
    for row, prompt in enumerate(PROMPTS):
        assert rollout.response_ids[row].tolist() == hf_greedy(model, prompt, 10), f"row {row}"
        expected = recomputed_logprobs(model, rollout, row, 1.0)
        torch.testing.assert_close(rollout.logprobs[row, : len(expected)], expected, atol=1e-5, rtol=0)


def test_onednn_holds_bf16_only_where_this_cpu_lets_it_and_a_bf16_sampler_runs_either_way(monkeypatch):
    """On an AVX2-only CPU oneDNN refuses to store a bf16 matrix: the layout is then not offered,
    asking for it is refused by name, and the calibration picks among the others."""
    from fastppo.rollout import weight_layouts

    monkeypatch.setattr(weight_layouts, "onednn_bf16", lambda: False)
    assert "onednn" not in layouts_for(torch.device("cpu"), torch.bfloat16)
    assert "onednn" in layouts_for(torch.device("cpu"), torch.float32)
    model = tiny("llama").to(torch.bfloat16)
    with pytest.raises(ValueError, match="layout 'onednn' does not run on cpu in torch.bfloat16"):
        fastppo.Sampler(model, max_batch_size=2, max_seq_len=40, layout="onednn")
    monkeypatch.setattr(calibration, "_read", lambda: {})  # measured here, whatever a cache holds
    monkeypatch.setattr(calibration, "_write", lambda key, choice: None)
    sampler, _ = _rollout(model)
    assert sampler.weights.layout in layouts_for(torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("layout", layouts_for(torch.device("cpu"), torch.bfloat16))
def test_a_bf16_copy_decodes_as_the_bf16_modules(layout):
    model = tiny("llama").to(torch.bfloat16)
    _, live = _rollout(model, weights="live")
    _, packed = _rollout(model, weights="packed", layout=layout)
    assert torch.equal(packed.response_ids, live.response_ids)
    torch.testing.assert_close(packed.logprobs, live.logprobs, atol=2e-2, rtol=0)


@pytest.mark.parametrize("step", ["fused AdamW", "a write through .data"])
@pytest.mark.parametrize("layout", CPU_LAYOUTS)
def test_a_weight_update_is_seen_by_the_next_rollout(layout, step):
    """Both updates leave the parameters' version counters as they were."""
    model = tiny("llama")
    sampler = fastppo.Sampler(model, max_batch_size=8, max_seq_len=40, layout=layout)
    sampler.generate(PROMPTS, max_new_tokens=4, temperature=0)
    if step == "fused AdamW":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optimizer.step()
    else:
        for p in model.parameters():
            p.data.mul_(-1.5)
    after = sampler.generate(RAGGED_PROMPTS, max_new_tokens=12, temperature=0, stop_token_ids=())
    fresh = fastppo.Sampler(model, max_batch_size=8, max_seq_len=40, weights="live").generate(
        RAGGED_PROMPTS, max_new_tokens=12, temperature=0, stop_token_ids=()
    )
    assert torch.equal(after.response_ids, fresh.response_ids)
    torch.testing.assert_close(after.logprobs, fresh.logprobs, atol=1e-5, rtol=0)


def test_a_projection_that_is_not_a_plain_linear_runs_live(caplog):
    class Adapted(nn.Linear):  # what a LoRA or quantized layer looks like to the packer
        def forward(self, x):
            return super().forward(x) + 1.0

    model = tiny("llama")
    attn = model.model.layers[0].self_attn
    adapted = Adapted(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
    adapted.weight = attn.q_proj.weight
    attn.q_proj = adapted
    with caplog.at_level(logging.INFO, logger="fastppo.rollout.packed"):
        sampler = fastppo.Sampler(model, max_batch_size=4, max_seq_len=40)
    assert sampler.weights.weights == "live" and "Adapted cannot be packed" in caplog.text
    rollout = sampler.generate(PROMPTS, max_new_tokens=6, temperature=0, stop_token_ids=())
    assert rollout.response_ids[0].tolist() == hf_greedy(model, PROMPTS[0], 6)


def test_the_choice_is_measured_once_per_machine_and_kept(_layout_cache, monkeypatch, caplog):
    _layout_cache.unlink(missing_ok=True)
    timed = []
    real = calibration.time_layout
    monkeypatch.setattr(calibration, "time_layout", lambda name, m, rows: timed.append(name) or real(name, m, rows))
    matrices = [torch.randn(48, 32), torch.randn(32, 32), torch.randn(96, 32)]
    with caplog.at_level(logging.INFO, logger="fastppo.rollout.calibration"):
        first = calibration.choose_layout(iter(matrices), rows=5)
    assert sorted(timed) == sorted(CPU_LAYOUTS) and first in CPU_LAYOUTS
    assert f"{first} layout for 5 rows" in caplog.text
    kept = json.loads(_layout_cache.read_text())
    (entry,) = kept.values()
    assert entry["layout"] == first and set(entry["ms"]) == set(CPU_LAYOUTS)
    timed.clear()
    assert calibration.choose_layout(iter(matrices), rows=5) == first and timed == []  # read, not measured
    calibration.choose_layout(iter(matrices), rows=6)  # another batch is another measurement
    assert sorted(timed) == sorted(CPU_LAYOUTS)


def test_a_cache_that_cannot_be_read_or_written_is_measured_around(_layout_cache, monkeypatch, tmp_path):
    _layout_cache.write_text("{not json")
    assert calibration.choose_layout(iter([torch.randn(8, 8)]), rows=2) in CPU_LAYOUTS
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(calibration, "_cache_file", lambda: blocked / "layouts.json")  # under a file
    assert calibration.choose_layout(iter([torch.randn(8, 8)]), rows=2) in CPU_LAYOUTS


def test_the_timed_sample_is_a_prefix_up_to_its_bytes(monkeypatch):
    monkeypatch.setattr(calibration, "SAMPLE_BYTES", 3 * 64 * 4)
    matrices = [torch.zeros(8, 8) for _ in range(5)]  # 256 bytes each
    assert len(calibration.sample(iter(matrices))) == 3
    assert len(calibration.sample(iter([torch.zeros(100, 100)]))) == 1  # at least one


def test_every_layout_multiplies_as_linear_with_and_without_bias():
    x, weight, bias = torch.randn(5, 24, dtype=torch.float64), torch.randn(40, 24), torch.randn(40)
    expected = x @ weight.double().T + bias.double()
    for name in CPU_LAYOUTS:
        layout = LAYOUTS[name]
        stored = layout.store(weight, rows=5)
        got = layout.apply(x.float(), stored, weight, bias).double()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5, msg=name)
        torch.testing.assert_close(
            layout.apply(x.float(), stored, weight, None).double(), expected - bias.double(), atol=1e-4, rtol=1e-5
        )


@pytest.mark.parametrize(
    "bad, message", [(dict(weights="fast"), "weights must be one of"), (dict(layout="blas"), "layout must be one of")]
)
def test_bad_weights_options_name_the_argument(bad, message):
    with pytest.raises(ValueError, match=message):
        fastppo.Sampler(tiny("llama"), max_batch_size=2, max_seq_len=16, **bad)


def test_a_layout_that_does_not_run_in_the_models_dtype_is_refused():
    if "mkl" not in LAYOUTS or not LAYOUTS["mkl"].available(torch.device("cpu"), torch.float32):
        pytest.skip("MKL is not in this torch")
    with pytest.raises(ValueError, match="layout 'mkl' does not run on cpu in torch.bfloat16"):
        fastppo.Sampler(tiny("llama").to(torch.bfloat16), max_batch_size=2, max_seq_len=16, layout="mkl")


@pytest.mark.parametrize(
    "options, expected",
    [
        ({}, "static"),  # every slot at the cap: nothing to page
        (dict(kv_block_size=4), "paged"),  # blocks asked for
        (dict(kv_memory=2 * 4 * 40 * 2 * 2 * 8 * 4 - 1), "paged"),  # one byte short of every slot at the cap
        (dict(kv_memory=2 * 4 * 40 * 2 * 2 * 8 * 4), "static"),
    ],
)
def test_auto_pages_only_what_the_budget_needs(options, expected):
    sampler = fastppo.Sampler(tiny("llama"), max_batch_size=4, max_seq_len=40, **options)
    assert ("paged" if sampler.kv_cache.paged else "static") == expected
