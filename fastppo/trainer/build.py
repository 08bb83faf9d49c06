"""A run's parts built from its config: models, rewards, the agent.

Each is built in one place: the models (``build_models``), the rewards (``configured_rewards``) and
the agent of a run with tools (``configured_agent``).

The models: the policy (fp32 masters, dropout off, LoRA-wrapped when asked), the critic, the
frozen reference, the sampler's copy of the weights, and, with ``--fsdp``, all of them sharded
over the ranks.

The order matters and is said here once: the critic starts from the full policy before any LoRA
wrapping (it trains in full); the rollout copy is made before sharding (whole, or split over a
group of ranks with ``--rollout-tp``, and without storage until its first refresh where the policy
has none yet); the reference is a frozen copy in the compute dtype, or for LoRA the base model
itself (adapters off).

Under ``--fsdp`` on several ranks all of that is done on the meta device, as if the weights were
there, and only the sharded models are given storage, each rank reading its own slices of the
checkpoint (``parallel/sharded_loading.py``); the policy is checked to be causal once it has them.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ..agents import Agent
from ..errors import UsageError
from ..hf import cast_parameters
from ..rewards.loading import load_reward
from ..rewards.scoring import Rewards
from .modeling import host_memory
from .modeling.critic import Critic
from .modeling.default import DEFAULT_MODEL
from .modeling.loading import check_causal, load_policy
from .modeling.lora import LoRA
from .modeling.precision import Precision, stored_dtype
from .modeling.rollout_tp import ParallelRolloutWeights, RolloutGroup, check_rollout_tp
from .modeling.rollout_weights import RolloutWeights
from .modeling.weights import disable_dropout, enable_checkpointing, frozen_copy
from .parallel import sharded_loading, sharding
from .prompts.tasks import TASKS
from .update.row_layout import SharedPrefix

if TYPE_CHECKING:  # for the annotations only
    from .configuration.config import TrainConfig
    from .parallel.distributed import Ranks


@dataclass
class Models:
    policy: torch.nn.Module  # the trained model (PEFT-wrapped with LoRA)
    tokenizer: object
    precision: Precision
    critic: Optional[torch.nn.Module]
    reference: Optional[torch.nn.Module]  # None without a KL; the policy itself with LoRA
    lora: Optional[LoRA]
    rollout_weights: RolloutWeights  # what the sampler decodes with (split over ranks: ParallelRolloutWeights)
    sharded: bool
    rollout_group: RolloutGroup  # the ranks that decode one batch together (--rollout-tp; else this rank)
    loaded: str  # how the weights were read (whole, or shard by shard), for the start-up log
    # how the forwards encode each prompt once for its samples (``update/row_layout.py``); None: padded rows
    shared_prefix: Optional[SharedPrefix] = None
    padded_because: Optional[str] = None

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def trained(self) -> list:
        return [m for m in (self.policy, self.critic) if m is not None]


def build_models(config: "TrainConfig", ranks: "Ranks", policy=None, tokenizer=None) -> Models:
    """The run's models on its device (``cuda:<local rank>`` under torchrun), from ``policy`` and
    ``tokenizer`` when given, else loaded from ``--model``."""
    device = config.device
    if torch.device(device).type == "cpu":  # before the model loads: every tensor of the run is served so
        if config.releases_cpu_memory:
            host_memory.release_freed_memory()
        else:
            host_memory.keep_freed_memory()
    if ranks.world > 1 and torch.device(device).type == "cuda":
        device = f"cuda:{ranks.local_rank}"
    check_rollout_tp(config.sharding.rollout_tp, ranks.world)  # before anything loads
    on_meta, loaded = False, "as given" if policy is not None else "whole on every rank"
    if policy is None:
        policy, tokenizer, on_meta, loaded = _policy(config, ranks)
    if not on_meta:
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
    name = config.model.model or "(the default model)"
    if not on_meta:  # a model on the meta device is checked once it has its weights
        check_causal(policy, name)
    critic = None
    if config.uses_critic:
        from_rm = config.model.critic_init == "reward_model"
        critic = Critic.from_reward_model(config.reward.reward_model, policy) if from_rm else Critic.from_policy(policy)
        disable_dropout(critic)
        cast_parameters(critic, torch.float32)
        if on_meta:  # the head too: it is given storage with the backbone, once sharded
            critic.head.to(policy.device)
        else:
            critic.to(policy.device)
    lo = config.lora
    lora = (
        None
        if lo.lora_rank is None
        else LoRA(policy, lo.lora_rank, lo.lora_alpha, lo.lora_target_modules, precision.rollout)
    )
    if lora is not None:
        policy = lora.model
        if not on_meta:
            _set_adapters(lora, config.run.seed)
    reference = None
    if config.algo.kl_coef > 0:
        reference = policy if lora is not None else frozen_copy(policy, precision.frozen)
    if config.model.gradient_checkpointing:
        for model in (policy, critic and critic.backbone):
            if model is not None:
                enable_checkpointing(model)
    sharded, tp = config.sharding.fsdp, config.sharding.rollout_tp
    group = RolloutGroup.of(ranks.rank, ranks.world, tp)
    if tp > 1:
        rollout_weights = ParallelRolloutWeights(policy, precision.rollout, torch.device(device), group, lora)
    else:  # LoRA's frozen base is already in the rollout dtype: decode through the wrapped layers.
        rollout_weights = RolloutWeights(
            policy, None if lora is not None else precision.rollout, gathered=sharded, device=torch.device(device)
        )
    models = Models(policy, tokenizer, precision, critic, reference, lora, rollout_weights, sharded, group, loaded)
    if sharded:
        shard(models, config.sharding, ranks, torch.device(device))
    if on_meta:
        _read_shards(models, config, torch.device(device))
        with precision.autocast():  # a sharded forward computes as the update's does
            check_causal(models.policy, name)
        sharding.reshard(models.policy)
    return models


def _policy(config: "TrainConfig", ranks: "Ranks") -> tuple:
    """``(policy, tokenizer, on_meta, how)`` of ``--model``: under ``--fsdp`` on several ranks, with
    its parameters on the meta device, read shard by shard once sharded (``sharded_loading.py``),
    where the checkpoint's names are the model's; else loaded whole. ``how`` says which, for the log."""
    path = config.model.model or DEFAULT_MODEL
    if not (config.sharding.fsdp and ranks.world > 1):
        return (*load_policy(config.model.model), False, "whole on every rank")
    if config.uses_critic and config.model.critic_init == "reward_model":  # the critic's start is loaded whole
        return (
            *load_policy(config.model.model),
            False,
            "whole on every rank, as the critic starts from a reward model",
        )
    policy, tokenizer = sharded_loading.load_meta_policy(path)
    why = sharded_loading.unreadable(policy, path)
    if why:
        return (*load_policy(config.model.model), False, f"whole on every rank, as {why}")
    return policy, tokenizer, True, "shard by shard: each rank reads its own slices of the checkpoint"


def _set_adapters(lora: LoRA, seed: int) -> None:
    """LoRA's adapters at their start (``LoRA.initial_adapters``), sharded or not."""
    own = dict(lora.model.named_parameters())
    for name, value in lora.initial_adapters(seed).items():
        sharded_loading.set_whole(own[name], value)


def _read_shards(models: Models, config: "TrainConfig", device: torch.device) -> None:
    """Storage and values for models built on the meta device and sharded: each rank's shards of the
    checkpoint, a critic's head at zero and LoRA's adapters at their start."""
    path = config.model.model or DEFAULT_MODEL
    policy = models.policy

    def plain(name: str) -> str:  # a LoRA-wrapped layer's base weight is the checkpoint's layer weight
        return name.replace(".base_layer.", ".")

    offloaded = config.sharding.fsdp_offload  # the trained models' shards in CPU memory
    sharded_loading.materialize(
        policy, device, path, {n: plain(n) for n, _ in policy.named_parameters() if ".lora_" not in n}, offloaded
    )
    if models.lora is not None:
        _set_adapters(models.lora, config.run.seed)
    if models.reference is not None and models.reference is not policy:
        sharded_loading.materialize(
            models.reference, device, path, {n: n for n, _ in models.reference.named_parameters()}
        )
    critic = models.critic
    if critic is not None:
        prefix = policy.base_model_prefix
        names = {
            n: f"{prefix}.{n.removeprefix('backbone.')}"
            for n, _ in critic.named_parameters()
            if n.startswith("backbone.")
        }
        sharded_loading.materialize(critic, device, path, names, offloaded)
        for parameter in critic.head.parameters():
            sharded_loading.set_whole(parameter, torch.zeros(parameter.shape))


def shard(models: Models, options, ranks: "Ranks", device: torch.device) -> None:
    """The policy, critic and reference sharded over the ranks (``sharding.py``) of ``device``'s type."""
    from torch.distributed.device_mesh import init_device_mesh

    if ranks.world == 1:
        raise UsageError(
            "--fsdp shards over the ranks torchrun starts, and this is one process: launch with "
            "torchrun --nproc_per_node=N (N >= 2)"
        )
    mesh = init_device_mesh(device.type, (ranks.world,))
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


def configured_rewards(config: "TrainConfig", reward_fn=None, reward_model=None, environment=()) -> "Rewards":
    """A run's rewards: ``reward_fn`` (the Python API's), else each ``--reward`` and the
    ``--reward-model`` (made by ``reward_model(path)``), else the built-in task's; weighted by
    ``--reward-weights``; and the environments' ``[(name, function)]``, each with weight 1."""
    c = config.reward
    if reward_fn is not None:
        named = [(getattr(reward_fn, "__name__", "reward"), reward_fn)]
    else:
        named = [(spec, load_reward(spec, c.format_pattern)) for spec in c.reward or ()]
        if c.reward_model:
            named.append(("reward_model", reward_model(c.reward_model)))
    if not named and not environment:
        task = config.data.task
        if task not in TASKS:
            raise UsageError(f"no reward: task {task!r} is not built in and --reward is not given")
        named = [(task, TASKS[task].reward)]
    rewards = Rewards(named, c.reward_weights)
    rewards.named += environment
    rewards.weights += [1.0] * len(environment)
    return rewards


def configured_agent(tools) -> Agent:
    """The :class:`~fastppo.agents.Agent` of a run's tools section (``ToolsConfig``)."""
    return Agent(
        tools=tools.tools or (),
        environment=tools.environment,
        max_tool_calls=tools.max_tool_calls,
        timeout=tools.tool_timeout,
        escape_tokens=tools.escape_tool_tokens,
    )
