"""Bench cases for the trainer: where one PPO iteration spends its time, and what each memory and
speed option costs or saves, side by side in one run.

``trainer`` splits one iteration of the shipped tiny model on its arithmetic task (16 prompts x 8
samples, up to 8 new tokens) into its phases: the rollout (sampling and scoring), the no-grad
forward passes (reference, values; the old log-probs only when recomputed), the minibatch updates,
and the whole iteration. There is no naive contender: the rows split one iteration.

``trainer_options`` runs whole iterations of trainers that differ in one option each, beside the
previous behaviour (the old log-probs recomputed in a separate pass) as the baseline: the
default (old log-probs from the update), gradient checkpointing, a bf16 rollout copy, and LoRA.
On the shipped tiny model and on a mid-size random Llama (12 layers, hidden 768; full runs only).
Memory is the peak allocated during an iteration above what was allocated before it.

Bytes are the policy's weights, read at least once by every phase (a floor, not a model of the
traffic); the rate column is rows x max_new_tokens per second (a ceiling on generated tokens).
"""

import dataclasses
import importlib.util
import tempfile

import torch

from .case import Case, Contender

OPTIONS = {  # contender -> the config fields that make it
    "before: old log-probs recomputed": {"recompute_old_logprobs": True},
    "default: old log-probs from the update": {},
    "+ gradient checkpointing": {"gradient_checkpointing": True},
    "+ bf16 rollout copy": {"rollout_dtype": "bfloat16"},
    "LoRA rank 8 (+ bf16 rollout copy)": {"lora_rank": 8, "rollout_dtype": "bfloat16"},
}


def _trainer(device, fields: dict, policy_factory=None):
    from ..trainer import PPOTrainer, TrainConfig

    config = TrainConfig.from_flat(
        {"out": tempfile.mkdtemp(prefix="fastppo-bench-"), "save": False, "device": str(device), **fields}
    ).validate()
    if policy_factory is None:
        return PPOTrainer(config)
    policy, tokenizer = policy_factory()
    return PPOTrainer(config, policy=policy.to(device), tokenizer=tokenizer)


def _mid_size_llama():
    """A random Llama of 12 layers, hidden 768 (about 85M parameters), with the character tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..trainer.models import char_tokenizer

    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config), tokenizer


def _weights(policy_factory=None) -> int:
    """Bytes of the policy's fp32 master weights."""
    from ..trainer.models import load_policy

    policy, _ = (policy_factory or (lambda: load_policy(None)))()
    return sum(p.numel() * 4 for p in policy.parameters())


def _phases_case(device) -> Case:
    def make():
        trainer = _trainer(device, {})
        scored = trainer.rollout(0)
        return {
            "trainer": trainer,
            "rollout": scored.rollout,
            "scores": scored.scores,
            "batch": trainer.prepare(scored.rollout, scored.scores),
        }

    contenders = [
        Contender("rollout (sampler + reward)", lambda x: x["trainer"].rollout(0)),
        Contender(
            "forward (reference, values, old log-probs if recomputed)",
            lambda x: x["trainer"].prepare(x["rollout"], x["scores"]),
        ),
        # a fresh copy each call: the update fills in the old log-probs it computes
        Contender("update (PPO minibatch steps)", lambda x: x["trainer"].update(dataclasses.replace(x["batch"]))),
        Contender("whole iteration", lambda x: x["trainer"].iteration(0)),
    ]
    rows, new_tokens = 16 * 8, 8
    return Case(
        "trainer",
        f"shipped tiny model, {rows} rows x {new_tokens} tokens",
        make,
        contenders,
        bytes_fwd=_weights(),
        items=rows * new_tokens,
    )


def _options_case(device, label: str, shape: dict, policy_factory=None) -> Case:
    lora = importlib.util.find_spec("peft") is not None
    names = [name for name, fields in OPTIONS.items() if lora or "lora_rank" not in fields]

    def make():
        return {name: _trainer(device, {**shape, **OPTIONS[name]}, policy_factory) for name in names}

    contenders = [
        Contender(name, lambda x, name=name: x[name].iteration(0), baseline=name.startswith("before")) for name in names
    ]
    if not lora:
        contenders.append(Contender("LoRA rank 8 (+ bf16 rollout copy)", status="peft not installed"))
    rows = shape["prompts_per_iteration"] * shape["samples_per_prompt"]
    return Case(
        "trainer_options",
        f"{label}, {rows} rows x {shape['max_new_tokens']} tokens",
        make,
        contenders,
        bytes_fwd=_weights(policy_factory),
        items=rows * shape["max_new_tokens"],
    )


def trainer_cases(device: torch.device, quick: bool) -> list:
    return [_phases_case(device)]


def trainer_options_cases(device: torch.device, quick: bool) -> list:
    tiny = dict(prompts_per_iteration=16, samples_per_prompt=8, max_new_tokens=8)
    cases = [_options_case(device, "shipped tiny model", tiny)]
    if not quick:
        mid = dict(prompts_per_iteration=8, samples_per_prompt=4, max_new_tokens=16)
        cases.append(_options_case(device, "random Llama 12 layers x 768", mid, _mid_size_llama))
    return cases
