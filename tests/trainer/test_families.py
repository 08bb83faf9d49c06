"""``fastppo train`` on every decoder family the sampler serves over its own cache: two iterations of
the vowels task from a tiny random model of each family saved with a tokenizer (the command a user
runs on a local checkpoint), the start-up log naming the sampler's path and the update's layout
(each prompt encoded once where the shared-prefix probe accepts the family), and the memory plan
counting the family's experts and KV."""

import json

import pytest
import torch

from fastppo.cli import main as fastppo_main
from fastppo.trainer.modeling.default import char_tokenizer
from tests.rollout.models import interface_model
from tests.rollout.test_interface import FAMILIES


def saved_model(directory, family):
    tokenizer = char_tokenizer()
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = interface_model(family, vocab_size=len(tokenizer), max_position_embeddings=256, **ids)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_two_iterations_of_each_family(tmp_path, family, capsys):
    saved_model(tmp_path / "model", family)
    out = tmp_path / "run"
    argv = ["--model", str(tmp_path / "model"), "--task", "vowels", "--iterations", "2", "--out", str(out)]
    argv += [
        "--prompts-per-iteration",
        "2",
        "--samples-per-prompt",
        "3",
        "--max-new-tokens",
        "6",
        "--evaluate",
        "false",
    ]
    assert fastppo_main(["train", *argv]) == 0
    log = capsys.readouterr().out
    assert f"sampler: fast: {family}'s own modules, attending over fastppo's KV cache" in log
    assert "update forwards: each prompt encoded once for its samples" in log  # the probe accepts each
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "reward_mean" in r] == [0, 1]
    assert all(torch.isfinite(torch.tensor(r["reward_mean"])) for r in rows if "reward_mean" in r)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gemma2", "gpt_oss", "phi3", "deepseek_v2"])
def test_the_plan_counts_each_family_s_experts_and_kv(tmp_path, family):
    from fastppo.trainer import PPOTrainer
    from fastppo.trainer.memory.plan import memory_plan
    from tests.trainer.memory.test_plan import nbytes
    from tests.trainer.runs import config

    tokenizer = char_tokenizer()
    policy = interface_model(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=1)
    cfg = config(tmp_path, task="vowels", prompts_per_iteration=2, samples_per_prompt=3, save=False, iterations=1)
    trainer = PPOTrainer(cfg, policy=policy, tokenizer=tokenizer)
    trainer.iteration(0)
    longest = max(len(ids) for ids in trainer.prompts.ids)
    plan = {line.name: line.bytes for line in memory_plan(cfg, policy.config, prompt_tokens=longest, device_type="cpu")}
    assert plan["policy weights"] == nbytes(policy.parameters())  # every expert's weights
    cache = trainer.rollouts.sampler.kv_cache
    assert plan["KV cache"] == nbytes(cache.k + cache.v)


def test_a_decoder_that_cannot_serve_the_model_is_one_line(tmp_path, capsys):
    saved_model(tmp_path / "model", "gemma2")
    capsys.readouterr()
    argv = ["--model", str(tmp_path / "model"), "--task", "vowels", "--out", str(tmp_path / "run")]
    assert fastppo_main(["train", *argv, "--rollout-decoder", "lean"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fastppo")]  # not progress bars
    assert err == [
        "fastppo train: error: --rollout-decoder='lean' cannot be used: no hand-written forward serves this "
        "gemma2 model (they serve llama, mistral, qwen2, qwen3, gpt2)"
    ]


@pytest.mark.slow
def test_a_sharded_run_decodes_a_family_over_the_cache(tmp_path):
    """Under --fsdp the rollout copy is whole only during a rollout; the sampler, which runs the model
    once when it is built (the shape of its cache), gets it whole then too."""
    import subprocess
    import sys

    from tests.ranks import free_port

    saved_model(tmp_path / "model", "qwen3_moe")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}"]
    train = ["-m", "fastppo", "train", "--model", str(tmp_path / "model"), "--task", "vowels", "--fsdp"]
    train += ["--device", "cpu", "--iterations", "2", "--out", str(tmp_path / "run"), "--evaluate", "false"]
    train += ["--prompts-per-iteration", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6"]
    done = subprocess.run(launch + train, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sampler: fast: qwen3_moe's own modules, attending over fastppo's KV cache" in done.stdout
