"""LoRA through PEFT: what is trained, what the sampler and the reference see, what is saved, and
the errors at start-up."""

import copy
import json

import pytest
import torch

pytest.importorskip("peft")

from fastppo.errors import UsageError
from fastppo.trainer import PPOTrainer  # noqa: E402
from fastppo.trainer.modeling.default import char_tokenizer, tiny_policy
from fastppo.trainer.update.loss import minibatch_loss
from tests.trainer.runs import config, direct_logprobs, mean_reward, rolled_out  # noqa: E402  # noqa: E402


def lora_trainer(tmp_path, **fields):
    tokenizer = char_tokenizer()
    base = tiny_policy(tokenizer, seed=0)
    original = copy.deepcopy(base)
    trainer = PPOTrainer(
        config(tmp_path, task="vowels", lora_rank=4, prompts_per_iteration=4, samples_per_prompt=2, **fields),
        policy=base,
        tokenizer=tokenizer,
    )
    return trainer, original


def perturb_adapters(trainer):
    """LoRA starts as the identity (B = 0); give the adapters weight so tests can tell them apart."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_only_the_adapters_train_in_fp32_and_the_base_is_shared(tmp_path):
    trainer, _ = lora_trainer(tmp_path, kl_coef=0.1, save=False)
    trained = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert {id(p) for g in trainer.optimizers.policy.param_groups for p in g["params"]} == {
        id(p) for p in trainer.policy.parameters() if p.requires_grad
    }
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters() if p.requires_grad)
    assert trainer.models.reference is trainer.policy  # no copy: the reference is the adapters switched off
    assert trainer.models.rollout_weights.shared and trainer.rollouts.sampler.model is trainer.policy
    projections = {n.split(".")[-1] for n, m in trainer.policy.named_modules() if hasattr(m, "lora_A")}
    assert projections == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_greedy_rollouts_equal_generate_of_the_peft_model(tmp_path):
    trainer, original = lora_trainer(tmp_path, save=False)
    perturb_adapters(trainer)
    tok = trainer.tokenizer
    prompts = [tok(p, add_special_tokens=False).input_ids for p in ("abc", "hello", "xy")]
    rollout = trainer.rollouts.sampler.generate(
        prompts, max_new_tokens=8, temperature=0.0, stop_token_ids=(), pad_token_id=tok.pad_token_id
    )
    peft_model = trainer.models.lora.peft_model
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        expected = peft_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id,
        )
        assert rollout.response_ids[i].tolist() == expected[0, len(prompt) :].tolist()
        plain = original.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id,
        )
        if i == 0:
            assert plain[0, len(prompt) :].tolist() != expected[0, len(prompt) :].tolist()  # the adapters matter


def test_reference_logprobs_are_the_base_models(tmp_path):
    trainer, original = lora_trainer(tmp_path, kl_coef=0.1, temperature=0.7, save=False)
    perturb_adapters(trainer)
    _, batch = rolled_out(trainer)
    with torch.no_grad():
        base = direct_logprobs(original, batch, 0.7)
        adapted = direct_logprobs(trainer.policy, batch, 0.7)
    torch.testing.assert_close(batch.ref_logprobs, base, rtol=0, atol=1e-6)
    assert (adapted - base).abs().max() > 1e-2  # the policy itself is not the base
    metrics = trainer.iteration(0)
    assert metrics["rollout_kl"] > 0


def test_a_lora_run_on_the_default_task_raises_its_reward(tmp_path):
    history = PPOTrainer(config(tmp_path, iterations=120, lora_rank=8, lr=2e-3, save=False)).train()
    first, last = mean_reward(history, lambda h: h[:10]), mean_reward(history, lambda h: h[-10:])
    assert last > first + 0.05, (first, last)


def test_the_adapter_is_saved_in_peft_format_and_merged_on_request(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer, original = lora_trainer(tmp_path, iterations=1, merge_lora=True, lora_alpha=16.0, lr=1e-2)
    trainer.train()
    out = tmp_path / "run"
    adapter = json.loads((out / "policy" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 16.0 and adapter["lora_dropout"] == 0.0
    reloaded = PeftModel.from_pretrained(copy.deepcopy(original), out / "policy").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "policy-merged").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        live = trainer.policy(input_ids=ids).logits
        torch.testing.assert_close(reloaded(input_ids=ids).logits, live, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, live, rtol=1e-4, atol=1e-4)
        assert (original(input_ids=ids).logits - live).abs().max() > 1e-3  # training moved the adapters


def test_a_lora_run_resumes_exactly(tmp_path):
    fields = dict(
        lora_rank=4, lr=1e-2, prompts_per_iteration=4, samples_per_prompt=2, warmup_iterations=2, lr_schedule="cosine"
    )
    straight = PPOTrainer(config(tmp_path / "a", iterations=4, **fields))
    straight.train()
    PPOTrainer(config(tmp_path / "b", iterations=2, save_every=2, **fields)).train()
    resumed, start = PPOTrainer.resume(tmp_path / "b" / "run", {"iterations": 4})
    assert start == 2 and resumed.models.lora is not None
    resumed.train(start)
    adapters = [(n, p) for n, p in straight.policy.named_parameters() if p.requires_grad]
    assert adapters
    theirs = dict(resumed.policy.named_parameters())
    for name, p in adapters:
        assert torch.equal(p, theirs[name]), name
    assert any((p != 0).any() for n, p in adapters if "lora_B" in n)  # the adapters trained


@pytest.mark.parametrize(
    "targets,match",
    [
        ("q_proj,attn_out", "attn_out is not a linear layer of this model; it has down_proj, gate_proj, k_proj"),
        ("lm_head", "LoRA on the LM head"),
        (" , ", "nothing is not a linear layer"),
    ],
)
def test_bad_target_modules_are_named(tmp_path, targets, match):
    with pytest.raises(UsageError, match=match):
        lora_trainer(tmp_path, lora_target_modules=targets)


def test_lora_without_peft_says_how_to_install_it(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ModuleNotFoundError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(UsageError, match=r"pip install 'fastppo\[lora\]'"):
        lora_trainer(tmp_path)


def test_lora_with_gradient_checkpointing_gives_the_same_adapter_gradients(tmp_path):
    grads = []
    for checkpointing in (False, True):
        trainer, _ = lora_trainer(tmp_path / str(checkpointing), save=False, gradient_checkpointing=checkpointing)
        perturb_adapters(trainer)
        _, batch = rolled_out(trainer)
        trainer.policy.train()
        loss, _ = minibatch_loss(
            batch, trainer.models, trainer.config, trainer.state.kl_coef, batch.mask.sum(), on_policy=True
        )
        loss.backward()
        grads.append([p.grad for p in trainer.policy.parameters() if p.requires_grad])
    assert all(g is not None for g in grads[1]) and any(g.abs().sum() > 0 for g in grads[1])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-6, atol=1e-8)
