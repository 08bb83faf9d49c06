"""The trainer's configuration: one dataclass per concern, one help string per field.

The ``fastppo train`` command line is generated from these fields (``--field-name``), a
``--config`` JSON or TOML file may set any of them (flat keys), ``from_flat`` checks each value's
type against its field's (a bool is not an int, a string is not a number) and ``validate()``
rejects non-finite and out-of-range values at start-up; every error names the field (and the
file it came from).
"""

import argparse
import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .errors import UsageError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package (a dependency there)
    import tomli as tomllib


def _doc(help_text: str, default=None, **kwargs):
    return field(default=default, metadata={"help": help_text}, **kwargs)


@dataclass
class ModelConfig:
    model: Optional[str] = _doc("local path of a Hugging Face causal LM (and its tokenizer); default: the tiny "
                                "model shipped with fastppo, which knows some of the arithmetic task")
    critic: Optional[bool] = _doc("train a value model (needed by estimator=gae); default: only for gae", None)
    critic_init: str = _doc("where the value model starts: policy (its backbone, a zero head) or "
                            "reward_model (the --reward-model's backbone and scoring row)", "policy")
    gradient_checkpointing: bool = _doc("recompute each transformer block's activations in the backward "
                                        "instead of keeping them (policy and critic): less memory, one more "
                                        "forward", False)


@dataclass
class LoRAConfig:
    lora_rank: Optional[int] = _doc("train LoRA adapters of this rank on the policy (through PEFT) instead of "
                                    "all its weights; the reference is the base model; default: full training")
    lora_alpha: Optional[float] = _doc("LoRA scaling numerator (the update is alpha / rank x B A); default: "
                                       "2 x lora_rank")
    lora_target_modules: Optional[str] = _doc("comma-separated names of the linear layers to adapt (q_proj,v_proj); "
                                              "default: every attention and MLP projection")
    merge_lora: bool = _doc("also save the policy with the adapter merged in, as a plain Hugging Face model in "
                            "policy-merged/", False)


@dataclass
class ShardingConfig:
    fsdp: bool = _doc("shard the policy, critic and reference over the ranks torchrun starts (FSDP2): each rank "
                      "holds 1/N of the weights, gradients and AdamW state", False)
    fsdp_reshard_after_forward: bool = _doc("free each block's gathered weights after its forward and gather "
                                            "them again for the backward (false: keep them, one gather less)", True)
    fsdp_offload: bool = _doc("keep the sharded fp32 weights, gradients and AdamW state of the trained models in "
                              "CPU memory, the optimizer step on the CPU (CUDA only)", False)


@dataclass
class DataConfig:
    task: str = _doc("built-in task (prompts, reward and held-out prompts) when --prompts is not given: "
                     "arithmetic ('17+25=' -> '42', reward 1 when exact) or vowels", "arithmetic")
    prompts: Optional[str] = _doc("local prompt file: .jsonl, .json (a list of objects, or one per line), .parquet "
                                  "or .csv, one row per prompt; the other fields of a row are passed to the reward "
                                  "functions")
    prompt_field: str = _doc("the column holding the prompt: a string, used as is, or a list of chat messages "
                             "({role, content}) rendered with the chat template", "prompt")
    field_map: Optional[list[str]] = _doc("renames of the other columns for the reward functions, column=name "
                                          "(e.g. solution=answer)")
    chat: bool = _doc("render string prompts with the chat template too, as one user message", False)
    system_prompt: Optional[str] = _doc("a system message opening every chat prompt")
    chat_template: Optional[str] = _doc("a Jinja chat template file used instead of the tokenizer's")
    max_prompt_tokens: Optional[int] = _doc("drop (and count) prompts longer than this many tokens at start-up; "
                                            "default: no limit beyond the model's context")
    drop_long_prompts: bool = _doc("drop (and count) prompts too long for the model's context with "
                                   "max_new_tokens; without it such a prompt is an error naming its line", False)


@dataclass
class RewardConfig:
    reward: Optional[list[str]] = _doc("reward functions, each 'module:function' called as f(prompts, completions, "
                                       "**fields) -> one real number per completion, or a built-in verifier: gsm8k, "
                                       "math, boxed or format (fastppo.rewards); the score is their weighted sum; "
                                       "default: the task's")
    reward_weights: Optional[list[float]] = _doc("one weight per reward (--reward, then --reward-model); "
                                                 "default: 1 each")
    reward_model: Optional[str] = _doc("local Hugging Face sequence-classification model scoring prompt + "
                                       "completion (its first logit), one more reward")
    format_pattern: Optional[str] = _doc("regular expression the whole completion must match for the format "
                                         "reward; default: <think>...</think><answer>...</answer>")
    overlong_buffer: int = _doc("DAPO's soft overlong penalty: a response longer than max_new_tokens minus this "
                                "many tokens loses overlong_penalty x its share of the buffer it used (0: off)", 0)
    overlong_penalty: float = _doc("the overlong penalty at max_new_tokens", 1.0)


@dataclass
class EvalConfig:
    evaluate: bool = _doc("score the held-out prompts (--eval-prompts, or a built-in task's) at the start, every "
                          "--eval-every iterations and at the end", True)
    eval_prompts: Optional[str] = _doc("held-out prompt file (the formats and fields of --prompts) scored at the "
                                       "start, every --eval-every iterations and at the end; default: the task's "
                                       "held-out prompts, none with --prompts")
    eval_every: int = _doc("evaluate every this many iterations as well (0: at the start and the end only)", 0)
    eval_samples: int = _doc("samples per held-out prompt at the rollout temperature, for mean@K and pass@K "
                             "(greedy accuracy is one sample at temperature 0)", 4)


@dataclass
class RolloutConfig:
    prompts_per_iteration: int = _doc("prompts sampled per iteration", 16)
    samples_per_prompt: int = _doc("responses sampled per prompt (the group for GRPO/RLOO)", 8)
    max_new_tokens: int = _doc("most tokens per response", 8)
    temperature: float = _doc("sampling temperature, also used when log-probs are recomputed", 1.0)
    top_k: int = _doc("sample among the k most likely tokens only (0: all)", 0)
    top_p: float = _doc("sample within the smallest set of tokens of this total probability (1: all)", 1.0)
    rollout_batch_size: int = _doc("rows the sampler decodes at once, the slots of its KV cache (0: all of an "
                                   "iteration's rows, or eval_samples if more); further rows take the slots of "
                                   "finished ones", 0)
    stop: Optional[list[str]] = _doc("strings that end a response besides the end-of-sequence token; the response "
                                     "keeps the stop string and its mask ends there")
    no_stop_penalty: float = _doc("added to the score of a response that never produced the stop token", 0.0)
    filter_groups: bool = _doc("DAPO's dynamic sampling: leave out groups whose scores are all equal (no "
                               "advantage) and sample more prompts until the batch is full", False)
    filter_groups_attempts: int = _doc("most batches sampled per iteration with filter_groups; a batch still short "
                                       "is filled with equal-score groups", 4)
    rollout_dtype: str = _doc("dtype of the weights the sampler decodes with, a copy refreshed before each "
                              "rollout: auto (bfloat16 on CUDA, the fp32 masters themselves elsewhere), "
                              "bfloat16, float16 or float32", "auto")
    rollout_is_cap: Optional[float] = _doc("weight each token's policy-gradient term by min(pi_old / pi_sampler, "
                                           "this cap), correcting for the sampler's other precision (truncated "
                                           "importance sampling); must be > 1; default: off")


@dataclass
class AlgoConfig:
    estimator: str = _doc("advantages: gae (with a critic), grpo, dr_grpo, rloo, reinforce_baseline or "
                          "reinforce_pp (REINFORCE++); see fastppo/trainer/estimators.py", "grpo")
    gamma: float = _doc("discount (gae, reinforce_pp)", 1.0)
    lam: float = _doc("GAE lambda (gae)", 0.95)
    kl_coef: float = _doc("weight of the KL to the reference model (in the token rewards for gae and reinforce_pp, "
                          "in the loss otherwise)", 0.0)
    kl_estimator: str = _doc("k1, k2 or k3", "k3")
    kl_target: Optional[float] = _doc("adapt kl_coef to hold this per-token KL (Ziegler et al. 2019); "
                                      "default: a fixed kl_coef")
    kl_horizon: int = _doc("horizon of the adaptive KL controller, in sequences", 10_000)
    clip_eps: float = _doc("PPO clip range", 0.2)
    clip_eps_high: Optional[float] = _doc("upper clip range, 1 + this (DAPO's clip-higher); default: clip_eps")
    dual_clip: Optional[float] = _doc("dual-clip bound c > 1 on the loss of negative advantages; default: off")
    agg: Optional[str] = _doc("how per-token losses become one: token-mean, seq-mean-token-mean, seq-mean-token-sum "
                              "or seq-mean-token-sum-norm (over rows x max_new_tokens); default: the estimator's "
                              "(token-mean; dr_grpo: seq-mean-token-sum-norm)")
    sequence_ratio: bool = _doc("GSPO: one importance ratio per response (the geometric mean of its tokens'), "
                                "clipped per response, the loss a mean over responses; GSPO's clip ranges are "
                                "about 3e-4 and 4e-4 (--clip-eps, --clip-eps-high); needs a group estimator", False)
    mask_truncated: bool = _doc("leave responses that hit max_new_tokens out of the loss", False)
    entropy_coef: float = _doc("entropy bonus", 0.0)
    vf_coef: float = _doc("value-loss weight (gae)", 0.5)
    vf_clip: float = _doc("value clip range (gae)", 0.2)
    ppo_epochs: int = _doc("passes over each rollout batch", 1)
    minibatches: int = _doc("minibatches per pass; must divide the rows of a rollout", 1)
    grad_accumulation: int = _doc("minibatches per optimizer step, normalised by their total token count; "
                                  "must divide minibatches", 1)
    recompute_old_logprobs: bool = _doc("compute the old log-probs in a separate no-grad pass even when the "
                                        "update is exactly on-policy (one epoch, one optimizer step per "
                                        "rollout), where by default they are the update's own, detached", False)


@dataclass
class OptimConfig:
    lr: float = _doc("AdamW learning rate of the policy", 5e-4)
    autocast: Optional[bool] = _doc("forward and backward under bf16 autocast, the weights and optimizer "
                                    "state staying fp32; default: on CUDA only", None)
    critic_lr: float = _doc("AdamW learning rate of the critic", 1e-3)
    warmup_iterations: int = _doc("linear learning-rate warm-up", 0)
    lr_schedule: str = _doc("after the warm-up: constant or cosine (to 0 at the last iteration)", "constant")
    max_grad_norm: float = _doc("gradient clipping norm", 1.0)


@dataclass
class RunConfig:
    iterations: int = _doc("training iterations", 500)
    seed: int = _doc("seed of every random draw", 0)
    device: str = _doc("where to train: auto (CUDA when available), cuda, cuda:N or cpu", "auto")
    cpu_release_memory: Optional[bool] = _doc("on the CPU, return each freed tensor's memory to the OS at once "
                                              "(glibc): far lower peak memory (a LoRA run of SmolLM2-135M: 1.9 GB "
                                              "instead of 4.8) for 30-40% more time (fastppo/trainer/host_memory.py); "
                                              "default: on for LoRA runs, whose point is memory, off otherwise")
    out: str = _doc("run directory (metrics.jsonl, config.json, the final model)", "runs/fastppo")
    save: bool = _doc("save the policy (and critic) in Hugging Face format at the end", True)
    save_dtype: str = _doc("dtype of the saved policy: auto (the checkpoint's own), bfloat16, float16 or "
                           "float32; checkpoints for --resume always keep the fp32 masters", "auto")
    save_every: int = _doc("also save every this many iterations (0: only at the end)", 0)
    save_every_minutes: float = _doc("also save once this many minutes have passed since the last save, so a run "
                                     "killed hours in (out of memory, a preempted machine) loses at most that much "
                                     "(0: off)", 30.0)
    keep_checkpoints: int = _doc("numbered checkpoints to keep, newest first (0: all)", 2)
    log_completions: int = _doc("rows of each iteration written to completions.jsonl (and TensorBoard's text "
                                "tab): prompt, completion, score and each reward's (0: none)", 4)
    overwrite: bool = _doc("start afresh in a non-empty run directory, deleting what it holds (only a "
                           "fastppo run directory); without it such a directory is refused", False)


SECTIONS = (ModelConfig, LoRAConfig, ShardingConfig, DataConfig, RewardConfig, EvalConfig, RolloutConfig, AlgoConfig,
            OptimConfig, RunConfig)
# Fields a resumed run may change: how long it runs, how it saves and evaluates, how many rows its
# sampler decodes at once (a memory bound, which moves where rows draw but not the math); nothing that
# changes the math.
RESUMABLE = {"iterations", "save", "save_every", "save_every_minutes", "keep_checkpoints", "log_completions",
             "cpu_release_memory", "evaluate", "eval_prompts", "eval_every", "eval_samples", "rollout_batch_size"}


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
    raise UsageError(f"config field {f.name} must be {expected}{' or null' if optional else ''}, got "
                     f"{type(value).__name__} {value!r}{where}")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def flat(self) -> dict:
        return {f.name: getattr(section, f.name) for section in self._sections() for f in dataclasses.fields(section)}

    def _sections(self):
        return (self.model, self.lora, self.sharding, self.data, self.reward, self.eval, self.rollout, self.algo,
                self.optim, self.run)

    @classmethod
    def from_flat(cls, values, source: str = "") -> "TrainConfig":
        """A config from flat ``{field: value}``, each value checked against its field's type;
        ``source`` (a file name) is named in errors."""
        where = f" (in {source})" if source else ""
        if not isinstance(values, dict):
            raise UsageError(f"a config must be a table of fields, got {type(values).__name__}{where}")
        names = {f.name for section in SECTIONS for f in dataclasses.fields(section)}
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
        """The :class:`~fastppo.trainer.estimators.Estimator` of ``algo.estimator``."""
        from .estimators import ESTIMATORS

        return ESTIMATORS[self.algo.estimator]

    @property
    def agg(self) -> str:
        """The loss aggregation: ``algo.agg``, else the estimator's; GSPO's is a mean over responses."""
        return "seq-mean-token-mean" if self.algo.sequence_ratio else self.algo.agg or self.estimator.agg

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
        return (not a.recompute_old_logprobs and a.ppo_epochs == 1 and a.minibatches == a.grad_accumulation
                and not (self.estimator.kl_in_reward and a.kl_coef > 0))

    def check_device_here(self) -> None:
        """Refuse a ``device`` this machine lacks (a memory plan may name one; a run may not)."""
        import torch

        device = self.run.device
        if not device.startswith("cuda"):
            return
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"config field device names CUDA, and this machine has no CUDA device "
                             f"(torch.cuda.is_available() is false), got {device!r}")
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            raise UsageError(f"config field device names a GPU this machine does not have (it has {count}: "
                             f"cuda:0 to cuda:{count - 1}), got {device!r}")

    def validate(self) -> "TrainConfig":
        from ..ops.aggregation import AGG_MODES
        from .estimators import ESTIMATORS
        from .precision import ROLLOUT_DTYPES, SAVE_DTYPES
        from .tasks import TASKS

        r, a, o, run, d, lora, rw, ev = (self.rollout, self.algo, self.optim, self.run, self.data, self.lora,
                                         self.reward, self.eval)
        for name, value in self.flat().items():
            for number in value if isinstance(value, list) else [value]:
                if isinstance(number, float) and not math.isfinite(number):
                    raise UsageError(f"config field {name} must be a finite number, got {value!r}")
        rewards = len(rw.reward or ()) + bool(rw.reward_model) or 1  # else the task's one
        estimator = ESTIMATORS.get(a.estimator)  # None: refused by the estimator rule
        grouped = estimator is not None and estimator.baseline is not None
        group_estimators = ", ".join(name for name, e in ESTIMATORS.items() if e.baseline)
        rules = [
            ("task", d.task in TASKS or (d.prompts and (rw.reward or rw.reward_model)),
             f"must be one of {tuple(TASKS)} unless --prompts and a reward are given"),
            ("max_prompt_tokens", d.max_prompt_tokens is None or d.max_prompt_tokens >= 1, "must be >= 1"),
            ("system_prompt", d.system_prompt != "", "must not be empty"),
            ("reward_weights", rw.reward_weights is None or len(rw.reward_weights) == rewards,
             f"must hold one weight per reward ({rewards}: those of --reward, then --reward-model)"),
            ("overlong_buffer", 0 <= rw.overlong_buffer < r.max_new_tokens, "must be >= 0 and < max_new_tokens"),
            ("overlong_penalty", rw.overlong_penalty >= 0, "must be >= 0"),
            ("eval_every", ev.eval_every >= 0, "must be >= 0"),
            ("eval_samples", ev.eval_samples >= 1, "must be >= 1"),
            ("top_k", r.top_k >= 0, "must be >= 0"),
            ("rollout_batch_size", r.rollout_batch_size == 0 or r.rollout_batch_size >= max(
                r.samples_per_prompt, ev.eval_samples if ev.evaluate else 1),
             "must be 0 or hold a prompt's samples (>= samples_per_prompt, and eval_samples when evaluating)"),
            ("filter_groups", not r.filter_groups or (grouped and r.samples_per_prompt >= 2),
             f"needs a group estimator ({group_estimators}) and samples_per_prompt >= 2"),
            ("filter_groups_attempts", r.filter_groups_attempts >= 1, "must be >= 1"),
            ("top_p", 0 < r.top_p <= 1, "must be in (0, 1]"),
            ("stop", r.stop is None or all(r.stop), "must not hold an empty string"),
            ("clip_eps_high", a.clip_eps_high is None or a.clip_eps_high > 0, "must be > 0"),
            ("dual_clip", a.dual_clip is None or a.dual_clip > 1, "must be > 1"),
            ("agg", a.agg is None or a.agg in AGG_MODES, f"must be one of {AGG_MODES}"),
            ("sequence_ratio", not a.sequence_ratio or (grouped and a.agg in (None, "seq-mean-token-mean")
                                                        and a.dual_clip is None and r.rollout_is_cap is None),
             f"needs a group estimator ({group_estimators}), agg seq-mean-token-mean (its own), and no dual_clip "
             "or rollout_is_cap"),
            ("prompts_per_iteration", r.prompts_per_iteration >= 1, "must be >= 1"),
            ("samples_per_prompt", r.samples_per_prompt >= (estimator.min_samples if estimator else 1),
             f"must be >= {estimator.min_samples if estimator else 1} for estimator={a.estimator}"),
            ("max_new_tokens", r.max_new_tokens >= 1, "must be >= 1"),
            ("temperature", r.temperature > 0, "must be > 0"),
            ("estimator", a.estimator in ESTIMATORS, f"must be one of {tuple(ESTIMATORS)}"),
            ("gamma", 0 <= a.gamma <= 1, "must be in [0, 1]"),
            ("lam", 0 <= a.lam <= 1, "must be in [0, 1]"),
            ("kl_coef", a.kl_coef >= 0, "must be >= 0"),
            ("kl_target", a.kl_target is None or (a.kl_target > 0 and a.kl_coef > 0), "must be > 0, with kl_coef > 0"),
            ("kl_horizon", a.kl_horizon >= 1, "must be >= 1"),
            ("clip_eps", a.clip_eps > 0, "must be > 0"),
            ("entropy_coef", a.entropy_coef >= 0, "must be >= 0"),
            ("vf_coef", a.vf_coef >= 0, "must be >= 0"),
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
            ("seed", 0 <= run.seed < 2 ** 32, "must be in [0, 2**32)"),
            ("device", re.fullmatch(r"auto|cpu|cuda(:\d+)?", run.device) is not None,
             "must be auto, cpu, cuda or cuda:N"),
            ("save_every", run.save_every >= 0, "must be >= 0"),
            ("save_every_minutes", run.save_every_minutes >= 0, "must be >= 0"),
            ("log_completions", run.log_completions >= 0, "must be >= 0"),
            ("keep_checkpoints", run.keep_checkpoints >= 0, "must be >= 0"),
            ("critic", not (estimator and estimator.critic) or self.model.critic is not False,
             f"must be on for estimator={a.estimator}"),
            ("critic_init", self.model.critic_init in ("policy", "reward_model"), "must be policy or reward_model"),
            ("critic_init", self.model.critic_init != "reward_model" or rw.reward_model,
             "reward_model needs --reward-model"),
            ("rollout_dtype", r.rollout_dtype in ROLLOUT_DTYPES, f"must be one of {ROLLOUT_DTYPES}"),
            ("rollout_is_cap", r.rollout_is_cap is None or r.rollout_is_cap > 1, "must be > 1"),
            ("save_dtype", run.save_dtype in SAVE_DTYPES, f"must be one of {SAVE_DTYPES}"),
            ("lora_rank", lora.lora_rank is None or lora.lora_rank >= 1, "must be >= 1"),
            ("lora_alpha", lora.lora_alpha is None or (lora.lora_alpha > 0 and lora.lora_rank),
             "must be > 0, with lora_rank"),
            ("lora_target_modules", lora.lora_target_modules is None or lora.lora_rank, "needs lora_rank"),
            ("merge_lora", not lora.merge_lora or lora.lora_rank, "needs lora_rank"),
            ("fsdp_offload", not self.sharding.fsdp_offload or (self.sharding.fsdp and self.device.startswith("cuda")),
             "needs --fsdp and a CUDA device (on the CPU there is nowhere to offload to)"),
        ]
        for name, ok, requirement in rules:
            if not ok:
                raise UsageError(f"config field {name} {requirement}, got {self.flat()[name]!r}")
        return self


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
    for section in SECTIONS:
        group = parser.add_argument_group(section.__name__)
        for f in dataclasses.fields(section):
            base = _base_type(f)[0]
            listed = typing.get_origin(base) is list
            if listed:  # --reward a b, or --reward a --reward b
                base = typing.get_args(base)[0]
            kind = {bool: _parse_bool, int: int, float: float}.get(base, str)
            flag = dict(nargs="?", const=True) if base is bool else dict(nargs="+", action="extend") if listed else {}
            text = f.metadata["help"]  # a default said in words, or none to say, gets no "(default: None)"
            if "default:" not in text and f.default is not None:
                text += f" (default: {f.default})"
            group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=argparse.SUPPRESS,
                               help=text.replace("%", "%%"), **flag)  # argparse formats help with %


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
    values.update({k: v for k, v in vars(args).items() if k not in ("config", "resume", "debug")
                   and not k.startswith("plan")})
    return values


def from_arguments(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the ``--config`` file, then the command line; validated."""
    return TrainConfig.from_flat(given_fields(args)).validate()
