"""The trainer's configuration: the sections of ``fields.py`` (one dataclass per concern, each field
with its help and its bound) assembled into one :class:`TrainConfig`.

The ``fastppo train`` command line is generated from the fields (``--field-name``), a
``--config`` JSON or TOML file may set any of them (flat keys), ``from_flat`` checks each value's
type against its field's (a bool is not an int, a string is not a number) and ``validate()``
rejects non-finite values, values outside their field's bound and combinations the rules that
span fields forbid, at start-up; every error names the field (and the file it came from).
"""

import argparse
import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError
from .fields import (
    FLOAT32_MAX,
    LARGEST_INT,
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

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package (a dependency there)
    import tomli as tomllib

# Fields a resumed run may change: how long it runs, how it saves and evaluates, how many rows its
# sampler decodes at once and in how much KV memory (memory bounds, which move where rows draw but not
# the math); nothing that changes the math.
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
}


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
        """The registered :class:`~fastppo.trainer.estimators.Estimator` of ``algo.estimator``."""
        from .estimators import ESTIMATORS

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
        one that sampled) and nothing needs them before it (KL-shaped token rewards do)."""
        a = self.algo
        return (
            not a.recompute_old_logprobs
            and a.ppo_epochs == 1
            and a.minibatches == a.grad_accumulation
            and not (self.estimator.kl_in_reward and a.kl_coef > 0)
        )

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
        """Each field within its bound (declared beside it), then the rules that span fields."""
        from .estimators import ESTIMATORS
        from .tasks import TASKS

        flat = self.flat()
        for f in fields():
            value = flat[f.name]
            numbers = value if isinstance(value, list) else [value]
            if any(isinstance(x, float) and not math.isfinite(x) for x in numbers):
                raise UsageError(f"config field {f.name} must be a finite number, got {value!r}")
            bound = f.metadata["bound"]
            if bound is not None and value is not None and not bound.holds(value):
                raise UsageError(f"config field {f.name} {bound.requirement()}, got {value!r}")
            if any(isinstance(x, float) and abs(x) > FLOAT32_MAX for x in numbers):
                raise UsageError(f"config field {f.name} must be within float32's range, got {value!r}")
            if any(isinstance(x, int) and not isinstance(x, bool) and abs(x) >= LARGEST_INT for x in numbers):
                raise UsageError(f"config field {f.name} must be < 2**32 in size, got {value!r}")
        r, a, d, lora, rw, ev = self.rollout, self.algo, self.data, self.lora, self.reward, self.eval
        rewards = len(rw.reward or ()) + bool(rw.reward_model) or 1  # else the task's one
        estimator = ESTIMATORS[a.estimator]
        group_estimators = ", ".join(name for name, e in ESTIMATORS.items() if e.grouped)
        rules = [
            (
                "task",
                d.task in TASKS or (d.prompts and (rw.reward or rw.reward_model or self.tools.environment)),
                f"must be one of {tuple(TASKS)} unless --prompts and a reward (or an environment) are given",
            ),
            (
                "reward_weights",
                rw.reward_weights is None or len(rw.reward_weights) == rewards,
                f"must hold one weight per reward ({rewards}: those of --reward, then --reward-model)",
            ),
            ("overlong_buffer", 0 <= rw.overlong_buffer < r.max_new_tokens, "must be >= 0 and < max_new_tokens"),
            (
                "stop",
                not (r.stop and self.episodes),
                "cannot be given with tools: an episode's turns end at the end-of-turn token",
            ),
            (
                "rollout_batch_size",
                r.rollout_batch_size == 0
                or r.rollout_batch_size >= max(r.samples_per_prompt, ev.eval_samples if ev.evaluate else 1),
                "must be 0 or hold a prompt's samples (>= samples_per_prompt, and eval_samples when evaluating)",
            ),
            (
                "filter_groups",
                not r.filter_groups or (estimator.grouped and r.samples_per_prompt >= 2),
                f"needs a group estimator ({group_estimators}) and samples_per_prompt >= 2",
            ),
            (
                "sequence_ratio",
                not a.sequence_ratio
                or (
                    estimator.grouped
                    and a.agg in (None, "seq-mean-token-mean")
                    and a.dual_clip is None
                    and r.rollout_is_cap is None
                ),
                f"needs a group estimator ({group_estimators}), agg seq-mean-token-mean (its own), and no dual_clip "
                "or rollout_is_cap",
            ),
            (
                "samples_per_prompt",
                r.samples_per_prompt >= estimator.min_samples,
                f"must be >= {estimator.min_samples} for estimator={a.estimator}",
            ),
            ("kl_target", a.kl_target is None or (a.kl_target > 0 and a.kl_coef > 0), "must be > 0, with kl_coef > 0"),
            (
                "grad_accumulation",
                a.grad_accumulation >= 1 and a.minibatches % a.grad_accumulation == 0,
                "must be >= 1 and divide minibatches",
            ),
            (
                "minibatches",
                a.minibatches >= 1 and (r.prompts_per_iteration * r.samples_per_prompt) % a.minibatches == 0,
                "must be >= 1 and divide prompts_per_iteration x samples_per_prompt",
            ),
            (
                "critic",
                not estimator.critic or self.model.critic is not False,
                f"must be on for estimator={a.estimator}",
            ),
            (
                "critic_init",
                self.model.critic_init != "reward_model" or rw.reward_model,
                "reward_model needs --reward-model",
            ),
            (
                "lora_alpha",
                lora.lora_alpha is None or (lora.lora_alpha > 0 and lora.lora_rank),
                "must be > 0, with lora_rank",
            ),
            ("lora_target_modules", lora.lora_target_modules is None or lora.lora_rank, "needs lora_rank"),
            ("merge_lora", not lora.merge_lora or lora.lora_rank, "needs lora_rank"),
            (
                "fsdp_offload",
                not self.sharding.fsdp_offload or (self.sharding.fsdp and self.device.startswith("cuda")),
                "needs --fsdp and a CUDA device (on the CPU there is nowhere to offload to)",
            ),
        ]
        for name, ok, requirement in rules:
            if not ok:
                raise UsageError(f"config field {name} {requirement}, got {flat[name]!r}")
        return self


def sections() -> list:
    """The config's section classes, in the order of :class:`TrainConfig`'s fields."""
    return [f.default_factory for f in dataclasses.fields(TrainConfig)]


def fields() -> list:
    """Every field of every section."""
    return [f for section in sections() for f in dataclasses.fields(section)]


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--field-name`` option per config field, its help from the field's. A bool option alone
    means true (``--overwrite``); it also takes a value (``--save false``)."""
    parser.add_argument("--config", type=Path, help="JSON or TOML file of config fields (flat keys)")
    for section in sections():
        group = parser.add_argument_group(section.__name__)
        for f in dataclasses.fields(section):
            base = _base_type(f)[0]
            listed = typing.get_origin(base) is list
            if listed:  # --reward a b, or --reward a --reward b
                base = typing.get_args(base)[0]
            kind = {bool: _parse_bool, int: int, float: float}.get(base, str)
            flag = dict(nargs="?", const=True) if base is bool else dict(nargs="+", action="extend") if listed else {}
            text = f.metadata["help"]  # a default said in words, or none to say, gets no "(default: None)"
            text = text() if callable(text) else text
            if "default:" not in text and f.default is not None:
                text += f" (default: {f.default})"
            group.add_argument(
                f"--{f.name.replace('_', '-')}",
                dest=f.name,
                type=kind,
                default=argparse.SUPPRESS,
                help=text.replace("%", "%%"),
                **flag,
            )  # argparse formats help with %


def read_config_file(path: Path) -> dict:
    """The fields of a JSON or TOML config file (TOML by its ``.toml`` suffix), type-checked."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        values = tomllib.loads(text) if Path(path).suffix == ".toml" else json.loads(text)
    except OSError as error:
        raise UsageError(f"--config {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--config {path}: not UTF-8 text") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"--config {path}: does not parse ({error})") from None
    TrainConfig.from_flat(values, source=str(path))  # the types, named with the file
    return values


def given_fields(args: argparse.Namespace) -> dict:
    """The fields the user set: the ``--config`` file's, then the command line's over them."""
    values = read_config_file(args.config) if getattr(args, "config", None) is not None else {}
    values.update(
        {k: v for k, v in vars(args).items() if k not in ("config", "resume", "debug") and not k.startswith("plan")}
    )
    return values


def from_arguments(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the ``--config`` file, then the command line; validated."""
    return TrainConfig.from_flat(given_fields(args)).validate()
