"""The models of a run, built in one place: the policy (fp32 masters, dropout off, LoRA-wrapped
when asked), the critic, the frozen reference, the sampler's copy of the weights, and, with
``--fsdp``, all of them sharded over the ranks.

The order matters and is said here once: the critic starts from the full policy before any LoRA
wrapping (it trains in full); the rollout copy is taken whole before sharding; the reference is a
frozen copy in the compute dtype, or for LoRA the base model itself (adapters off).
"""

from dataclasses import dataclass
from typing import Optional

import torch

from . import host_memory, sharding
from .errors import UsageError
from .layout import SharedPrefix
from .lora import LoRA
from .models import (
    Critic,
    cast_parameters,
    check_causal,
    disable_dropout,
    enable_checkpointing,
    frozen_copy,
    load_policy,
)
from .precision import Precision, stored_dtype
from .rollout_weights import RolloutWeights


@dataclass
class Models:
    policy: torch.nn.Module  # the trained model (PEFT-wrapped with LoRA)
    tokenizer: object
    precision: Precision
    critic: Optional[torch.nn.Module]
    reference: Optional[torch.nn.Module]  # None without a KL; the policy itself with LoRA
    lora: Optional[LoRA]
    rollout_weights: RolloutWeights  # what the sampler decodes with
    sharded: bool
    # how the forwards encode each prompt once for its samples (``shared_prefix.py``); None: padded rows
    shared_prefix: Optional[SharedPrefix] = None
    padded_because: Optional[str] = None

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def trained(self) -> list:
        return [m for m in (self.policy, self.critic) if m is not None]


def build_models(config, ranks, policy=None, tokenizer=None) -> Models:
    """The run's models on its device (``cuda:<local rank>`` under torchrun), from ``policy`` and
    ``tokenizer`` when given, else loaded from ``--model``."""
    device = config.device
    if torch.device(device).type == "cpu" and config.releases_cpu_memory:
        host_memory.release_freed_memory()  # before the model loads: every tensor of the run is served so
    if ranks.world > 1 and torch.device(device).type == "cuda":
        device = f"cuda:{ranks.local_rank}"
    if policy is None:
        policy, tokenizer = load_policy(config.model.model)
        policy.to(device)
    precision = Precision.of(
        config.optim.autocast,
        config.rollout.rollout_dtype,
        config.run.save_dtype,
        torch.device(device).type,
        stored_dtype(policy.config),
    )
    cast_parameters(policy, torch.float32)  # the master weights, whatever the checkpoint's dtype
    disable_dropout(policy)
    check_causal(policy, config.model.model or "(the default model)")
    critic = None
    if config.uses_critic:
        from_rm = config.model.critic_init == "reward_model"
        critic = Critic.from_reward_model(config.reward.reward_model, policy) if from_rm else Critic.from_policy(policy)
        disable_dropout(critic)
        cast_parameters(critic, torch.float32)
        critic = critic.to(policy.device)
    lo = config.lora
    lora = (
        None
        if lo.lora_rank is None
        else LoRA(policy, lo.lora_rank, lo.lora_alpha, lo.lora_target_modules, precision.rollout)
    )
    if lora is not None:
        policy = lora.model
    reference = None
    if config.algo.kl_coef > 0:
        reference = policy if lora is not None else frozen_copy(policy, precision.frozen)
    if config.model.gradient_checkpointing:
        for model in (policy, critic and critic.backbone):
            if model is not None:
                enable_checkpointing(model)
    sharded = config.sharding.fsdp
    # LoRA's frozen base is already in the rollout dtype: decode through the wrapped layers.
    rollout_weights = RolloutWeights(policy, None if lora is not None else precision.rollout, gathered=sharded)
    models = Models(policy, tokenizer, precision, critic, reference, lora, rollout_weights, sharded)
    if sharded:
        shard(models, config.sharding, ranks)
    return models


def shard(models: Models, options, ranks) -> None:
    """The policy, critic and reference sharded over the ranks (``sharding.py``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if ranks.world == 1:
        raise UsageError(
            "--fsdp shards over the ranks torchrun starts, and this is one process: launch with "
            "torchrun --nproc_per_node=N (N >= 2)"
        )
    mesh = init_device_mesh(models.device.type, (ranks.world,))
    targets = [(models.policy, True), (models.critic, False)]
    if models.reference is not None and models.reference is not models.policy:
        targets.append((models.reference, True))
    for model, hidden_states in targets:
        if model is not None:
            sharding.shard(
                model,
                mesh=mesh,
                compute_dtype=models.precision.compute,
                reshard_after_forward=options.fsdp_reshard_after_forward,
                offload=options.fsdp_offload,
                hidden_states=hidden_states,
            )
