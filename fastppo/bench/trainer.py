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

``trainer_options`` also times the update phase alone, one prepared batch under each forward
layout: one padded row per sample (the baseline, what the update did before the shared prefix),
padded rows in micro-batches of similar length, each prompt encoded once for its samples (its
attention dense under the units' mask, as before, and split by the mask, the default:
``trainer/update/unit_attention.py``), and that in micro-batches; each row notes the token slots
its forwards computed. On the shipped tiny model,
and in full runs on SmolLM2-135M-Instruct with the chat workload (``chat_workload.py``) when it is
installed.

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

    from ..trainer.modeling.default import char_tokenizer

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
    from ..trainer.modeling.loading import load_policy

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
        Contender("update (PPO minibatch steps)", lambda x: x["trainer"].update(dataclasses.replace(x["batch"]), 0)),
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
    return _options(label, shape, make, contenders, policy_factory)


def _options(label: str, fields: dict, make, contenders: list, policy_factory=None) -> Case:
    """A ``trainer_options`` case of runs shaped by ``fields``; its rate: rows x max_new_tokens."""
    rows = fields["prompts_per_iteration"] * fields["samples_per_prompt"]
    return Case(
        "trainer_options",
        f"{label}, {rows} rows x up to {fields['max_new_tokens']} tokens",
        make,
        contenders,
        bytes_fwd=_weights(policy_factory),
        items=rows * fields["max_new_tokens"],
    )


LAYOUTS = {  # contender -> (shared prefix, max_tokens_per_microbatch, the units' attention split by their mask)
    "before: one padded row per sample": (False, None, False),
    "padded rows, micro-batches by length": (False, "budget", False),
    "each prompt encoded once, dense mask": (True, None, False),
    "default: each prompt once, attention split": (True, None, True),
    "prompt once, micro-batches": (True, "budget", True),
}


def _update_tokens(trainer, batch) -> int:
    """Token slots (padding included) the update's forwards compute on ``batch``: one pass."""
    from ..trainer.update.batch import forward_parts

    models, config, total = trainer.models, trainer.config, 0
    for index in batch.minibatches(config.algo.minibatches, torch.Generator().manual_seed(0)):
        mb = batch.rows(index)
        total += sum(mb.rows(part).layout(models.shared_prefix).tokens for part in forward_parts(mb, models, config))
    return total


def _layouts_case(device, label: str, fields: dict, budget: int, policy_factory=None) -> Case:
    from ..trainer.update import unit_attention
    from ..trainer.update.row_layout import SharedPrefix, key_cost

    def make():
        trainer = _trainer(device, fields, policy_factory)
        scored = trainer.rollout(0)
        return {"trainer": trainer, "batch": trainer.prepare(scored.rollout, scored.scores)}

    def laid_out(x, shared, tokens, split):
        trainer = x["trainer"]
        policy = trainer.policy
        trainer.models.shared_prefix = SharedPrefix(key_cost(policy)) if shared else None
        trainer.config.algo.max_tokens_per_microbatch = budget if tokens else None
        if split:
            unit_attention.adopt(policy)
        else:
            unit_attention.release(policy)
        return trainer

    def update(x, *layout):  # a fresh copy each call: the update fills in its old log-probs
        return laid_out(x, *layout).update(dataclasses.replace(x["batch"]), 0)

    def note(x, *layout):
        trainer, batch = laid_out(x, *layout), x["batch"]
        real = int((batch.prompt_lens + batch.lens).sum())
        return f"{_update_tokens(trainer, batch):,} token slots; rows hold {real:,}"

    contenders = [
        Contender(
            name,
            lambda x, layout=layout: update(x, *layout),
            baseline=name.startswith("before"),
            note=lambda x, layout=layout: note(x, *layout),
        )
        for name, layout in LAYOUTS.items()
    ]
    return _options(
        f"update phase, {label}, micro-batches of {budget} tokens", fields, make, contenders, policy_factory
    )


def _smollm2_chat(device) -> list:
    """The update layouts on SmolLM2-135M-Instruct and the chat workload, when it is installed."""
    from . import chat_workload, smollm2

    try:
        model = str(smollm2.smollm2())
    except smollm2.Unavailable:
        return []
    fields = {
        **chat_workload.train_fields(tempfile.mkdtemp(prefix="fastppo-bench-chat-")),
        "model": model,
        "prompts_per_iteration": 2,
        "kl_coef": 0.0,
        "lr": 1e-6,
    }
    return [_layouts_case(device, "SmolLM2-135M-Instruct, chat prompts", fields, 2048)]


def trainer_cases(device: torch.device, quick: bool) -> list:
    return [_phases_case(device)]


def trainer_options_cases(device: torch.device, quick: bool) -> list:
    tiny = dict(prompts_per_iteration=16, samples_per_prompt=8, max_new_tokens=8)
    cases = [_options_case(device, "shipped tiny model", tiny), _layouts_case(device, "shipped tiny model", tiny, 256)]
    if not quick:
        mid = dict(prompts_per_iteration=8, samples_per_prompt=4, max_new_tokens=16)
        cases.append(_options_case(device, "random Llama 12 layers x 768", mid, _mid_size_llama))
        cases += _smollm2_chat(device)
    return cases
