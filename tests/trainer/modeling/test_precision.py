"""Training precision on the CPU: fp32 masters from a bf16 checkpoint, the dtypes of what is
frozen, sampled and saved, and the rollout copy that follows the optimizer."""

import json

import pytest
import torch
from safetensors import safe_open

from fastppo.trainer import PPOTrainer
from fastppo.trainer.modeling.default import char_tokenizer, tiny_policy
from tests.trainer.runs import config


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """The tiny model saved as published checkpoints are: bf16 weights, a config saying so."""
    directory = tmp_path_factory.mktemp("bf16")
    tokenizer = char_tokenizer()
    tiny_policy(tokenizer, seed=0).to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    return directory


def stored_dtypes(directory) -> set:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}


def test_a_bf16_checkpoint_trains_fp32_masters_and_is_saved_in_bf16(tmp_path, bf16_checkpoint):
    trainer = PPOTrainer(
        config(
            tmp_path,
            model=str(bf16_checkpoint),
            task="vowels",
            iterations=2,
            lr=1e-5,
            prompts_per_iteration=4,
            samples_per_prompt=2,
            save_every=1,
        )
    )
    start = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    assert all(p.dtype == torch.float32 for p in start.values())
    trainer.train()
    state = trainer.optimizers.policy.state_dict()["state"]
    assert state and all(
        s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32 for s in state.values()
    )
    # Steps of lr 1e-5 moved the fp32 masters, yet most of them would round back to the same bf16
    # weight: trained in bf16 those updates would have vanished.
    moved = lost = total = 0
    for name, p in trainer.policy.named_parameters():
        changed = p.detach() != start[name]
        moved += int(changed.sum())
        lost += int((changed & (p.detach().bfloat16() == start[name].bfloat16())).sum())
        total += p.numel()
    assert moved > 0.9 * total and lost > 0.5 * moved, (moved, lost, total)

    out = tmp_path / "run"
    assert stored_dtypes(out / "policy") == {"BF16"}  # save_dtype auto: the checkpoint's own
    assert json.loads((out / "policy" / "config.json").read_text())["dtype"] == "bfloat16"
    assert stored_dtypes(out / "checkpoint-2" / "policy") == {"F32"}  # the masters, for --resume
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out / "policy")
    assert saved.dtype == torch.bfloat16
    for name, p in saved.named_parameters():
        torch.testing.assert_close(p, dict(trainer.policy.named_parameters())[name].detach().bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("save_dtype,stored", [("float32", "F32"), ("fp16", "F16")])
def test_save_dtype_chooses_the_saved_dtype(tmp_path, bf16_checkpoint, save_dtype, stored):
    trainer = PPOTrainer(
        config(
            tmp_path,
            model=str(bf16_checkpoint),
            task="vowels",
            iterations=1,
            prompts_per_iteration=2,
            samples_per_prompt=2,
            save_dtype=save_dtype,
        )
    )
    trainer.train()
    assert stored_dtypes(tmp_path / "run" / "policy") == {stored}


def test_the_cpu_computes_in_fp32_unless_autocast_is_asked(tmp_path):
    plain = PPOTrainer(config(tmp_path / "a", kl_coef=0.1, save=False))
    assert plain.models.precision.compute is None and plain.models.reference.dtype == torch.float32
    assert plain.models.rollout_weights.shared  # fp32 masters, fp32 rollout: no copy on the CPU
    asked = PPOTrainer(config(tmp_path / "b", kl_coef=0.1, autocast=True, save=False))
    assert asked.models.precision.compute == torch.bfloat16
    assert asked.models.reference.dtype == torch.bfloat16  # frozen models in the compute dtype
    assert all(p.dtype == torch.float32 for p in asked.policy.parameters())
    metrics = asked.iteration(0)
    assert all(metrics[k] == metrics[k] for k in ("approx_kl", "pg_loss", "rollout_kl"))  # not NaN


def test_the_rollout_copy_is_bf16_and_follows_each_optimizer_step(tmp_path):
    trainer = PPOTrainer(config(tmp_path, rollout_dtype="bfloat16", lr=1e-2, save=False))
    copy = trainer.models.rollout_weights.model
    assert trainer.rollouts.sampler.model is copy and copy is not trainer.policy
    assert all(p.dtype == torch.bfloat16 for p in copy.parameters())
    assert trainer.rollouts.sampler.cached.cache.k[0].dtype == torch.bfloat16  # the KV cache follows the copy
    addresses = [p.data_ptr() for p in copy.parameters()]
    metrics = trainer.iteration(0)
    assert metrics["logprob_mismatch"] > 1e-4  # bf16 sampling, fp32 recomputation: logged
    stale = [p.detach().clone() for p in copy.parameters()]
    trainer.rollout(1)  # refreshes before sampling
    assert [p.data_ptr() for p in copy.parameters()] == addresses  # in place: graphs and cache stay valid
    fresh = list(copy.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(stale, fresh))
    for ours, master in zip(fresh, trainer.policy.parameters()):
        assert torch.equal(ours, master.detach().bfloat16())


def test_tied_embeddings_stay_tied_in_the_rollout_copy(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer()
    policy = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            pad_token_id=0,
            eos_token_id=1,
        )
    )
    trainer = PPOTrainer(
        config(tmp_path, task="vowels", rollout_dtype="bfloat16", save=False), policy=policy, tokenizer=tokenizer
    )
    copy = trainer.models.rollout_weights.model
    assert copy.lm_head.weight is copy.model.embed_tokens.weight
    trainer.iteration(0)
    trainer.models.rollout_weights.refresh()
    assert torch.equal(copy.lm_head.weight, trainer.policy.lm_head.weight.detach().bfloat16())


def test_the_rollout_is_correction_weights_the_loss_and_is_logged(tmp_path):
    trainer = PPOTrainer(config(tmp_path, rollout_dtype="bfloat16", rollout_is_cap=1.01, save=False))
    metrics = trainer.iteration(0)
    assert 0 < metrics["rollout_is_weight"] <= 1.01
    assert 0 < metrics["rollout_is_capped"] < 1  # bf16 sampling puts some tokens over a tight cap
