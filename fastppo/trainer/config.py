"""The trainer's configuration: one dataclass per concern, one help string per field.

The ``fastppo train`` command line is generated from these fields (``--field-name``), a
``--config`` JSON or TOML file may set any of them (flat keys), and ``validate()`` rejects
out-of-range values at start-up, naming the field.
"""

import argparse
import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


def _doc(help_text: str, default=None, **kwargs):
    return field(default=default, metadata={"help": help_text}, **kwargs)


@dataclass
class ModelConfig:
    model: Optional[str] = _doc("local path of a Hugging Face causal LM (and its tokenizer); default: the tiny "
                                "model shipped with fastppo, which knows some of the arithmetic task")
    critic: bool = _doc("train a value model (needed by estimator=gae); default: only for gae", None)
    critic_init: str = _doc("where the value model starts: policy (its backbone, a zero head) or "
                            "reward_model (the --reward-model's backbone and scoring row)", "policy")


@dataclass
class DataConfig:
    task: str = _doc("built-in task (prompts and reward) when --prompts is not given: arithmetic "
                     "('17+25=' -> '42', reward 1 when exact) or vowels", "arithmetic")
    prompts: Optional[str] = _doc("JSONL file, one object per line with a 'prompt' field; the other fields "
                                  "are passed to the reward function")
    reward: Optional[str] = _doc("reward function 'module:function', called as f(prompts, completions, "
                                 "**fields) -> one float per completion; default: the task's")
    reward_model: Optional[str] = _doc("local Hugging Face sequence-classification model scoring prompt + "
                                       "completion (its first logit), instead of a reward function")


@dataclass
class RolloutConfig:
    prompts_per_iteration: int = _doc("prompts sampled per iteration", 16)
    samples_per_prompt: int = _doc("responses sampled per prompt (the group for GRPO/RLOO)", 8)
    max_new_tokens: int = _doc("most tokens per response", 8)
    temperature: float = _doc("sampling temperature, also used when log-probs are recomputed", 1.0)
    no_stop_penalty: float = _doc("added to the score of a response that never produced the stop token", 0.0)


@dataclass
class AlgoConfig:
    estimator: str = _doc("advantages: gae (with a critic), grpo, dr_grpo, rloo or reinforce_baseline", "grpo")
    gamma: float = _doc("discount (gae)", 1.0)
    lam: float = _doc("GAE lambda (gae)", 0.95)
    kl_coef: float = _doc("weight of the KL to the reference model (in the reward for gae, in the loss otherwise)", 0.0)
    kl_estimator: str = _doc("k1, k2 or k3", "k3")
    kl_target: Optional[float] = _doc("adapt kl_coef to hold this per-token KL (Ziegler et al. 2019); "
                                      "default: a fixed kl_coef")
    kl_horizon: int = _doc("horizon of the adaptive KL controller, in sequences", 10_000)
    clip_eps: float = _doc("PPO clip range", 0.2)
    entropy_coef: float = _doc("entropy bonus", 0.0)
    vf_coef: float = _doc("value-loss weight (gae)", 0.5)
    vf_clip: float = _doc("value clip range (gae)", 0.2)
    ppo_epochs: int = _doc("passes over each rollout batch", 1)
    minibatches: int = _doc("minibatches per pass; must divide the rows of a rollout", 1)
    grad_accumulation: int = _doc("minibatches per optimizer step, normalised by their total token count; "
                                  "must divide minibatches", 1)


@dataclass
class OptimConfig:
    lr: float = _doc("AdamW learning rate of the policy", 5e-4)
    autocast: bool = _doc("bf16 autocast on CUDA (the CPU always runs fp32)", True)
    critic_lr: float = _doc("AdamW learning rate of the critic", 1e-3)
    warmup_iterations: int = _doc("linear learning-rate warm-up", 0)
    lr_schedule: str = _doc("after the warm-up: constant or cosine (to 0 at the last iteration)", "constant")
    max_grad_norm: float = _doc("gradient clipping norm", 1.0)


@dataclass
class RunConfig:
    iterations: int = _doc("training iterations", 500)
    seed: int = _doc("seed of every random draw", 0)
    device: str = _doc("where to train: auto (CUDA when available), cuda, cuda:N or cpu", "auto")
    out: str = _doc("run directory (metrics.jsonl, config.json, the final model)", "runs/fastppo")
    save: bool = _doc("save the policy (and critic) in Hugging Face format at the end", True)
    save_every: int = _doc("also save every this many iterations (0: only at the end)", 0)
    keep_checkpoints: int = _doc("numbered checkpoints to keep, newest first (0: all)", 2)


SECTIONS = (ModelConfig, DataConfig, RolloutConfig, AlgoConfig, OptimConfig, RunConfig)
ESTIMATORS = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_baseline")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def flat(self) -> dict:
        return {f.name: getattr(section, f.name) for section in self._sections() for f in dataclasses.fields(section)}

    def _sections(self):
        return (self.model, self.data, self.rollout, self.algo, self.optim, self.run)

    @classmethod
    def from_flat(cls, values: dict) -> "TrainConfig":
        names = {f.name: section for section in SECTIONS for f in dataclasses.fields(section)}
        unknown = set(values) - set(names)
        if unknown:
            raise ValueError(f"unknown config field(s): {', '.join(sorted(unknown))}")
        config = cls()
        for section in config._sections():
            for f in dataclasses.fields(section):
                if f.name in values:
                    setattr(section, f.name, values[f.name])
        return config

    @property
    def uses_critic(self) -> bool:
        return self.model.critic if self.model.critic is not None else self.algo.estimator == "gae"

    def validate(self) -> "TrainConfig":
        from .tasks import TASKS

        r, a, o, run = self.rollout, self.algo, self.optim, self.run
        rules = [
            ("task", self.data.task in TASKS or (self.data.prompts and (self.data.reward or self.data.reward_model)),
             f"must be one of {tuple(TASKS)} unless --prompts and a reward are given"),
            ("prompts_per_iteration", r.prompts_per_iteration >= 1, "must be >= 1"),
            ("samples_per_prompt", r.samples_per_prompt >= 1, "must be >= 1"),
            ("max_new_tokens", r.max_new_tokens >= 1, "must be >= 1"),
            ("temperature", r.temperature > 0, "must be > 0"),
            ("estimator", a.estimator in ESTIMATORS, f"must be one of {ESTIMATORS}"),
            ("gamma", 0 <= a.gamma <= 1, "must be in [0, 1]"),
            ("lam", 0 <= a.lam <= 1, "must be in [0, 1]"),
            ("kl_coef", a.kl_coef >= 0, "must be >= 0"),
            ("kl_target", a.kl_target is None or (a.kl_target > 0 and a.kl_coef > 0), "must be > 0, with kl_coef > 0"),
            ("kl_horizon", a.kl_horizon >= 1, "must be >= 1"),
            ("clip_eps", a.clip_eps > 0, "must be > 0"),
            ("vf_clip", a.vf_clip > 0, "must be > 0"),
            ("ppo_epochs", a.ppo_epochs >= 1, "must be >= 1"),
            ("grad_accumulation", a.grad_accumulation >= 1 and a.minibatches % a.grad_accumulation == 0,
             "must be >= 1 and divide minibatches"),
            ("lr_schedule", o.lr_schedule in ("constant", "cosine"), "must be constant or cosine"),
            ("minibatches", a.minibatches >= 1 and (r.prompts_per_iteration * r.samples_per_prompt) % a.minibatches == 0,
             "must be >= 1 and divide prompts_per_iteration x samples_per_prompt"),
            ("lr", o.lr > 0, "must be > 0"),
            ("critic_lr", o.critic_lr > 0, "must be > 0"),
            ("warmup_iterations", o.warmup_iterations >= 0, "must be >= 0"),
            ("max_grad_norm", o.max_grad_norm > 0, "must be > 0"),
            ("iterations", run.iterations >= 1, "must be >= 1"),
            ("save_every", run.save_every >= 0, "must be >= 0"),
            ("keep_checkpoints", run.keep_checkpoints >= 0, "must be >= 0"),
            ("critic", a.estimator != "gae" or self.uses_critic, "must be on for estimator=gae"),
            ("critic_init", self.model.critic_init in ("policy", "reward_model"), "must be policy or reward_model"),
            ("critic_init", self.model.critic_init != "reward_model" or self.data.reward_model,
             "reward_model needs --reward-model"),
        ]
        for name, ok, requirement in rules:
            if not ok:
                raise ValueError(f"config field {name} {requirement}, got {self.flat()[name]!r}")
        return self


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--field-name`` option per config field, its help from the field's."""
    parser.add_argument("--config", type=Path, help="JSON or TOML file of config fields (flat keys)")
    for section in SECTIONS:
        group = parser.add_argument_group(section.__name__)
        for f in dataclasses.fields(section):
            base = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)  # Optional[X] -> X
            kind = {bool: _parse_bool, int: int, float: float}.get(base, str)
            group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=argparse.SUPPRESS,
                               help=f"{f.metadata['help']} (default: {f.default})")


def from_arguments(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the ``--config`` file, then the command line; validated."""
    values = {}
    if getattr(args, "config", None) is not None:
        text = args.config.read_text()
        values = tomllib.loads(text) if args.config.suffix == ".toml" else json.loads(text)
    values.update({k: v for k, v in vars(args).items() if k not in ("config", "resume")})
    return TrainConfig.from_flat(values).validate()
