"""The bench suite never rots: every family runs at --quick size on the CPU, timed once.

(On a GPU machine the full bench runs right after the tests in bench/gpu_check.sh.)"""

import json
import math
import os

import pytest
import torch

from fastppo.bench.cli import main as bench_main
from fastppo.bench.runner import FAMILIES, run_suite

CPU = torch.device("cpu")


@pytest.mark.parametrize("op", list(FAMILIES))
def test_every_contender_gets_a_row(op):
    device = CPU
    meta, rows = run_suite([op], device, quick=True, smoke=True)
    cases = FAMILIES[op](device, quick=True)
    passes = 2 if cases[0].bytes_fwd_bwd else 1
    assert len(rows) == sum(len(c.contenders) for c in cases) * passes
    statuses = {r["contender"]: r["status"] for r in rows}
    baseline = next((c.name for c in cases[0].contenders if c.baseline), None)
    assert all(
        status == "ok"
        for name, status in statuses.items()
        if not name.startswith(("torch.compile", "HF generate (static", "liger", "flash-attn", "trl"))
    )
    assert baseline is None or statuses[baseline] == "ok"
    for row in rows:
        assert row["bytes"] > 0
        assert row["status"] == "ok" or row["median_ms"] is None  # unavailable rows say why, with no numbers
        assert not row["status"].startswith("error"), row
        if row["status"] == "ok":
            assert math.isfinite(row["gbps"]) and row["gbps"] > 0
            assert baseline is None or (math.isfinite(row["speedup"]) and row["speedup"] > 0)
            assert row["memory_bytes"] > 0
    assert meta["copy_gbps"] > 0 and meta["device"] == device.type


def test_cli_writes_json_and_markdown(tmp_path, capsys):
    assert (
        bench_main(
            [
                "--op",
                "gae",
                "--device",
                "cpu",
                "--quick",
                "--json",
                str(tmp_path / "r.json"),
                "--markdown",
                str(tmp_path / "r.md"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "## gae" in printed and "| fastppo | fwd |" in printed
    assert (tmp_path / "r.md").read_text() == printed
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"]["device"] == "cpu" and {r["op"] for r in data["rows"]} == {"gae"}


def test_time_budget_skips_the_rest():
    _, rows = run_suite(["whiten"], CPU, quick=True, smoke=True, time_budget_s=-1.0)
    assert {r["status"] for r in rows if r["contender"] == "fastppo"} == {"skipped: time budget"}


@pytest.mark.slow
def test_versus_trl_runs_both_trainers_side_by_side(tmp_path, capsys):
    pytest.importorskip("trl")
    assert (
        bench_main(
            [
                "--versus-trl",
                "--device",
                "cpu",
                "--iterations",
                "3",
                "--prompts",
                "2",
                "--samples",
                "2",
                "--max-new-tokens",
                "4",
                "--trl-without-checkpointing",
                "--json",
                str(tmp_path / "v.json"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| fastppo train |" in printed and "| TRL GRPOTrainer |" in printed and "fp32" in printed
    result = json.loads((tmp_path / "v.json").read_text())
    trl = ["TRL GRPOTrainer", "TRL GRPOTrainer, no gradient checkpointing"]
    assert [r["trainer"] for r in result["rows"]] == ["fastppo train", *trl]
    fastest = min(result["rows"][1:], key=lambda r: r["seconds_median"])
    assert result["against"] == fastest["trainer"] and f"against {fastest['trainer']}" in printed
    assert result["speedup"] == pytest.approx(fastest["seconds_median"] / result["rows"][0]["seconds_median"])
    for row in result["rows"]:
        assert row["iterations"] == 3 and row["seconds_median"] > 0 and row["tokens_per_s"] > 0
        assert 0 <= row["system_median"] <= (os.cpu_count() or 1) * row["seconds_median"]  # CPU s, all cores
        # 0 when the other trainer's whole run ended before this one's first iteration did
        assert 0 <= row["reward_at_cutoff"] <= 1 and 0 <= row["iterations_by_cutoff"] <= 3
    assert math.isfinite(result["speedup"]) and result["speedup"] > 0


@pytest.mark.slow
def test_sharding_runs_every_mode_on_two_ranks(tmp_path, capsys):
    assert (
        bench_main(
            ["--sharding", "--hidden", "128", "--layers", "2", "--iterations", "1", "--json", str(tmp_path / "s.json")]
        )
        == 0
    )
    assert "| --fsdp | 1 |" in capsys.readouterr().out
    modes = json.loads((tmp_path / "s.json").read_text())["modes"]
    for replicated, sharded, split in zip(modes["replicated"], modes["--fsdp"], modes["--fsdp --rollout-tp 2"]):
        assert sharded["trained"] < 0.6 * replicated["trained"]
        assert replicated["rollout"] > 0 and sharded["rollout"] == split["rollout"] == 0 and sharded["seconds"] > 0
        assert 0 < sharded["peak"] < replicated["peak"] and split["refresh"] > 0


def test_the_real_model_contenders_generate_exactly_the_imposed_lengths(monkeypatch, tmp_path):
    """The long-tail case's workload: fastppo makes exactly each row's length, generate() every row
    to the longest (as with an EOS); without the model, the case says how to get it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import fastppo
    from fastppo.bench import sampler_real, smollm2

    lengths = sampler_real.long_tail_lengths(12, 40)
    assert lengths == sampler_real.long_tail_lengths(12, 40) and min(lengths) >= 1 and max(lengths) <= 40
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            bos_token_id=None,
            eos_token_id=None,
        )
    ).eval()
    prompts = [[i + 1] * (3 + i % 4) for i in range(12)]
    out = sampler_real._hf_generate(model, prompts, lengths)
    assert out.shape == (12, max(map(len, prompts)) + max(lengths))
    rollout = fastppo.Sampler(model, max_batch_size=4, max_seq_len=48).generate(
        prompts, max_new_tokens=lengths, stop_token_ids=(), seed=0
    )
    assert rollout.response_lens.tolist() == lengths

    monkeypatch.setenv("FASTPPO_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    [case] = sampler_real.real_sampler_cases(CPU, quick=False)
    assert {c.status for c in case.contenders} == {
        f"unavailable: SmolLM2-135M-Instruct is not installed ({smollm2.INSTALL})"
    }
    assert sampler_real.real_sampler_cases(CPU, quick=True) == []

    def broken(gguf, target):
        raise ValueError("no such tensor type")

    monkeypatch.setattr(smollm2, "_gguf_file", lambda: tmp_path / smollm2.GGUF)
    monkeypatch.setattr(smollm2, "_convert", broken)
    [case] = sampler_real.real_sampler_cases(CPU, quick=False)
    assert {c.status for c in case.contenders} == {
        f"unavailable: converting {smollm2.GGUF} failed (ValueError: no such tensor type)"
    }


def test_the_chat_workload_asks_with_worked_examples_and_its_answers_pass_the_verifier():
    from fastppo.bench import chat_workload
    from fastppo.rewards.verifiers import gsm8k_reward

    rows = chat_workload.rows(6, seed=1)
    assert rows == chat_workload.rows(6, seed=1) and rows != chat_workload.rows(6, seed=2)
    for row in rows:
        system, user = row["prompt"]
        assert system["role"] == "system" and "####" in system["content"] and user["role"] == "user"
        assert 1 <= user["content"].count("Solution:") <= 2 and user["content"].count("Problem:") >= 2
    answers = [row["answer"] for row in rows]
    assert gsm8k_reward(None, [f"so it is\n{a}" for a in answers], answers) == [1.0] * 6
    assert gsm8k_reward(None, ["#### -1"] * 6, answers) == [0.0] * 6


@pytest.mark.slow
def test_versus_trl_runs_the_chat_workload(tmp_path, capsys):
    pytest.importorskip("trl")
    from fastppo.trainer.modeling.default import tiny_policy
    from fastppo.trainer.modeling.loading import load_policy

    _, tokenizer = load_policy(None)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] | lower }} {% endfor %}"
    model = tiny_policy(tokenizer, seed=0)
    model.config.max_position_embeddings = 1024  # a character per token: the prompts are 700-800 long
    model.save_pretrained(tmp_path / "chat")
    tokenizer.save_pretrained(tmp_path / "chat")
    argv = ["--versus-trl", "--workload", "chat", "--model", str(tmp_path / "chat"), "--device", "cpu"]
    argv += ["--iterations", "2", "--prompts", "1", "--samples", "2", "--max-new-tokens", "4"]
    assert bench_main(argv) == 0
    printed = capsys.readouterr().out
    assert "chat workload (prompts of 150-300 tokens, gsm8k verifier)" in printed and "| TRL GRPOTrainer |" in printed


@pytest.mark.slow
def test_versus_trl_runs_the_tools_workload(tmp_path, capsys):
    pytest.importorskip("trl")
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.agents.runs import chatml_tokenizer, turn_taking_policy

    tokenizer = chatml_tokenizer()
    tokenizer.pad_token = "<pad>"
    small = turn_taking_policy(tokenizer)
    model = LlamaForCausalLM(LlamaConfig(**{**small.config.to_dict(), "max_position_embeddings": 2048}))
    model.load_state_dict(small.state_dict())
    model.save_pretrained(tmp_path / "tools")
    tokenizer.save_pretrained(tmp_path / "tools")
    argv = ["--versus-trl", "--workload", "tools", "--model", str(tmp_path / "tools"), "--device", "cpu"]
    argv += ["--iterations", "2", "--prompts", "1", "--samples", "2", "--max-new-tokens", "4"]
    argv += ["--json", str(tmp_path / "t.json")]
    assert bench_main(argv) == 0
    printed = capsys.readouterr().out
    assert "tools workload" in printed and "| TRL GRPOTrainer |" in printed and "prefill tokens per episode" in printed
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert all(r["prefill_per_episode"] > 0 for r in rows)


def test_async_runs_each_staleness_side_by_side(tmp_path, capsys):
    """``--async --quick``: every K's row in each table, stale tokens only ahead of K = 0."""
    assert bench_main(["--async", "--device", "cpu", "--quick", "--json", str(tmp_path / "a.json")]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "a.json").read_text())
    runs = result["long_tail"]["runs"]
    assert [r["ahead"] for r in runs] == [0, 1, 2]
    assert runs[0]["stale_share"] == 0 and runs[1]["stale_share"] > 0
    assert len({r["tokens"] for r in runs}) == 1  # the same work at every K
    tools = result["tools"]["spreads"][0]["runs"]
    assert [(r["schedule"], r["ahead"]) for r in tools] == [("fixed", 0), ("eager", 0), ("eager", 1), ("eager", 2)]
    assert set(result["learning"]["runs"][0]["curves"]) == {"0", "1"}
    assert "## Long tail" in printed and "## Tools answering after 0.02 s" in printed and "## Learning" in printed
