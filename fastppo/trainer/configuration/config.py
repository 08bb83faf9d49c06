"""The trainer's configuration: the sections of ``fields.py`` (one dataclass per concern, each field
with its help and its bound) assembled into one :class:`TrainConfig`, and each value typed.

``from_flat`` checks each value's type against its field's (a bool is not an int, a string is not
a number); ``validate()`` applies the bounds and the rules that span fields (``rules.py``). The
command line and the ``--config`` file are read by ``arguments.py``.
"""

import dataclasses
import typing
from dataclasses import dataclass, field

from ...errors import UsageError
from .fields import (
    AlgoConfig,
    DataConfig,
    EvalConfig,
    LoRAConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    ShardingConfig,
    ToolsConfig,
)
from .rules import check

# Fields a resumed run may change: how long it runs, how it saves and evaluates, how many rows its
# sampler decodes at once and in how much KV memory (memory bounds, which move where rows draw but not
# the math), and how far its rollouts run ahead; nothing else that changes the math.
RESUMABLE = {
    "iterations",
    "save",
    "save_every",
    "save_every_minutes",
    "keep_checkpoints",
    "log_completions",
    "cpu_release_memory",
    "evaluate",
    "eval_prompts",
    "eval_every",
    "eval_samples",
    "rollout_batch_size",
    "rollout_kv_memory",
    "rollout_kv_block_size",
    "tool_schedule",
    "tool_window",
    "max_staleness",
}

STALE_IS_CAP = 2.0  # the importance weights' cap with max_staleness >= 1 and no rollout_is_cap given


def _base_type(f: dataclasses.Field):
    """``(type, optional)`` of a field: ``Optional[X]`` -> ``(X, True)``."""
    args = [t for t in typing.get_args(f.type) if t is not type(None)]
    return (args[0], True) if args else (f.type, False)


EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _scalar(kind, value):
    """``value`` as ``kind`` (an int is a float, a bool is not an int), or None when it is not one."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    return None


def _typed(f: dataclasses.Field, value, source: str):
    """``value`` as the field's type, or a ``UsageError`` naming the field (and ``source``). A list
    field takes a list of its items, or one item alone."""
    kind, optional = _base_type(f)
    if value is None and optional:
        return None
    item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
    if item is None:
        typed = _scalar(kind, value)
    elif isinstance(value, (list, tuple)):
        typed = [_scalar(item, v) for v in value]
        typed = typed if typed and None not in typed else None
    else:
        typed = None if _scalar(item, value) is None else [_scalar(item, value)]
    if typed is not None:
        return typed
    where = f" (in {source})" if source else ""
    expected = EXPECTED[kind] if item is None else f"a non-empty list of {EXPECTED[item].removeprefix('a ')}s"
    raise UsageError(
        f"config field {f.name} must be {expected}{' or null' if optional else ''}, got "
        f"{type(value).__name__} {value!r}{where}"
    )


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def flat(self) -> dict:
        return {f.name: getattr(section, f.name) for section in self._sections() for f in dataclasses.fields(section)}

    def _sections(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def from_flat(cls, values, source: str = "") -> "TrainConfig":
        """A config from flat ``{field: value}``, each value checked against its field's type;
        ``source`` (a file name) is named in errors."""
        where = f" (in {source})" if source else ""
        if not isinstance(values, dict):
            raise UsageError(f"a config must be a table of fields, got {type(values).__name__}{where}")
        names = {f.name for f in fields()}
        unknown = set(values) - names
        if unknown:
            raise UsageError(f"unknown config field(s): {', '.join(sorted(unknown))}{where}")
        config = cls()
        for section in config._sections():
            for f in dataclasses.fields(section):
                if f.name in values:
                    setattr(section, f.name, _typed(f, values[f.name], source))
        return config

    @property
    def estimator(self):
        """The registered :class:`~fastppo.trainer.update.estimators.Estimator` of ``algo.estimator``."""
        from ..update.estimators import ESTIMATORS

        return ESTIMATORS[self.algo.estimator]

    @property
    def agg(self) -> str:
        """The loss aggregation: ``algo.agg``, else the estimator's; GSPO's is a mean over responses."""
        return "seq-mean-token-mean" if self.algo.sequence_ratio else self.algo.agg or self.estimator.agg

    @property
    def episodes(self) -> bool:
        """Whether responses are multi-turn episodes (tools or an environment given)."""
        return bool(self.tools.tools or self.tools.environment)

    @property
    def response_tokens(self) -> int:
        """The most tokens of one response: ``max_new_tokens``, and in an episode the tool results'
        room too."""
        return self.rollout.max_new_tokens + (self.tools.max_tool_tokens if self.episodes else 0)

    @property
    def uses_critic(self) -> bool:
        return self.model.critic if self.model.critic is not None else self.estimator.critic

    @property
    def sampler_slots(self) -> int:
        """The rows the sampler decodes at once: ``rollout_batch_size``, else an iteration's rows (or a
        held-out prompt's samples, if more)."""
        r = self.rollout
        return r.rollout_batch_size or max(r.prompts_per_iteration * r.samples_per_prompt, self.eval.eval_samples)

    @property
    def device(self) -> str:
        """``run.device`` with ``auto`` resolved: CUDA when available, else the CPU."""
        import torch

        if self.run.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.run.device

    @property
    def releases_cpu_memory(self) -> bool:
        """Whether a CPU run returns freed tensor memory at once: ``cpu_release_memory``, else for LoRA."""
        release = self.run.cpu_release_memory
        return self.lora.lora_rank is not None if release is None else release

    @property
    def old_logprobs_from_update(self) -> bool:
        """Whether the old log-probs are the update's own (detached): true when the update is exactly
        on-policy (one epoch, one optimizer step per rollout, so the policy the update sees is the
        one that sampled, or with ``max_staleness`` the policy at the update's start that decoupled
        PPO clips against) and nothing needs them before it (KL-shaped token rewards do)."""
        a = self.algo
        return (
            not a.recompute_old_logprobs
            and a.ppo_epochs == 1
            and a.minibatches == a.grad_accumulation
            and not (self.estimator.kl_in_reward and a.kl_coef > 0)
        )

    @property
    def rollout_is_cap(self):
        """The cap of the truncated importance weights of old over sampler log-probs, or None (off):
        ``rollout_is_cap``, else ``STALE_IS_CAP`` when tokens may be stale (``max_staleness``)."""
        r = self.rollout
        return r.rollout_is_cap if r.rollout_is_cap is not None or not r.max_staleness else STALE_IS_CAP

    def check_device_here(self) -> None:
        """Refuse a ``device`` this machine lacks (a memory plan may name one; a run may not)."""
        import torch

        device = self.run.device
        if not device.startswith("cuda"):
            return
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(
                f"config field device names CUDA, and this machine has no CUDA device "
                f"(torch.cuda.is_available() is false), got {device!r}"
            )
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            raise UsageError(
                f"config field device names a GPU this machine does not have (it has {count}: "
                f"cuda:0 to cuda:{count - 1}), got {device!r}"
            )

    def validate(self) -> "TrainConfig":
        """Each field within its bound (declared beside it), then the rules that span fields (``rules.py``)."""
        check(self, fields())
        return self


def sections() -> list:
    """The config's section classes, in the order of :class:`TrainConfig`'s fields."""
    return [f.default_factory for f in dataclasses.fields(TrainConfig)]


def fields() -> list:
    """Every field of every section."""
    return [f for section in sections() for f in dataclasses.fields(section)]
