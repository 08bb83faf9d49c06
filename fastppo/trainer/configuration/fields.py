"""The trainer's configuration fields: one dataclass per concern, and for each field its help
string and its bound, declared beside it.

``config.py`` assembles the sections into :class:`~fastppo.trainer.configuration.config.TrainConfig`, checks
each value against its field's type and bound and the rules that span fields, and generates the
command line from them; this file is only what the fields are.
"""

import re
import typing
from dataclasses import dataclass, field
from typing import Optional


def _doc(help_text, default=None, bound=None, **kwargs):
    """A field with its help (a string, or a function giving one from a registry) and its ``bound``:
    the rule its value alone must meet (None always passes an optional field)."""
    return field(default=default, metadata={"help": help_text, "bound": bound}, **kwargs)


@dataclass(frozen=True)
class Bound:
    """A rule on one field's value, and how the error says it."""

    holds: typing.Callable
    says: typing.Union[str, typing.Callable]  # or a function giving it, for a registry's names

    def requirement(self) -> str:
        return self.says() if callable(self.says) else self.says


def at_least(low) -> Bound:
    return Bound(lambda v: v >= low, f"must be >= {low}")


def above(low) -> Bound:
    return Bound(lambda v: v > low, f"must be > {low}")


def within(low, high, open_low: bool = False) -> Bound:
    return Bound(
        lambda v: (v > low if open_low else v >= low) and v <= high,
        f"must be in {'(' if open_low else '['}{low}, {high}]",
    )


def one_of(choices) -> Bound:
    """One of ``choices``: a tuple, or a function returning one (a registry read when checked)."""

    def listed():
        return tuple(choices() if callable(choices) else choices)

    return Bound(lambda v: v in listed(), lambda: f"must be one of {listed()}")


def matching(pattern: str, says: str) -> Bound:
    return Bound(lambda v: re.fullmatch(pattern, v) is not None, says)


# Every number a field holds: a float within float32's range (the tensors it reaches), an int below
# 2**32 in size (counts past that are no run this trainer can hold).
LARGEST_INT = 2**32

NOT_EMPTY = Bound(lambda v: v != "", "must not be empty")
NO_EMPTY_STRING = Bound(lambda v: all(v), "must not hold an empty string")


# The registries some fields name, read when a value is checked (they import torch; the CLI's
# parser is built without it).
def _estimator_names() -> tuple:
    from ..update.estimators import ESTIMATORS

    return tuple(ESTIMATORS)


def _longest_tool_timeout() -> float:
    from ...agents.calls import MAX_TOOL_TIMEOUT

    return MAX_TOOL_TIMEOUT


TOOL_TIMEOUT = Bound(
    lambda v: 0 < v <= _longest_tool_timeout(), lambda: f"must be in (0, {_longest_tool_timeout():g}] seconds"
)


def _estimator_help() -> str:
    from ..update.estimators import help_text

    return help_text()


def _agg_modes() -> tuple:
    from ...ops.aggregation import AGG_MODES

    return AGG_MODES


def _save_dtypes() -> tuple:
    from ..modeling.precision import SAVE_DTYPES

    return SAVE_DTYPES


def _rollout_dtypes() -> tuple:
    from ..modeling.precision import ROLLOUT_DTYPES

    return ROLLOUT_DTYPES


def _rollout_weights() -> tuple:
    from ...rollout.packed import WEIGHTS

    return WEIGHTS


def _rollout_decoders() -> tuple:
    from ...rollout.decoders import DECODERS

    return DECODERS


def _tool_schedules() -> tuple:
    from ...rollout.batching import TOOL_SCHEDULES

    return TOOL_SCHEDULES


@dataclass
class ModelConfig:
    model: Optional[str] = _doc(
        "local path of a Hugging Face causal LM (and its tokenizer); default: the tiny "
        "model shipped with fastppo, which knows some of the arithmetic task"
    )
    critic: Optional[bool] = _doc("train a value model (needed by estimator=gae); default: only for gae", None)
    critic_init: str = _doc(
        "where the value model starts: policy (its backbone, a zero head) or "
        "reward_model (the --reward-model's backbone and scoring row)",
        "policy",
        bound=one_of(("policy", "reward_model")),
    )
    gradient_checkpointing: bool = _doc(
        "recompute each transformer block's activations in the backward "
        "instead of keeping them (policy and critic): less memory, one more "
        "forward",
        False,
    )
    shared_prefix: bool = _doc(
        "encode each prompt once for all its samples in every forward of the update (exact: the "
        "samples attend to the prompt's keys and values); off, or where a model cannot take it, "
        "each sample is a padded row of its own",
        True,
    )


@dataclass
class LoRAConfig:
    lora_rank: Optional[int] = _doc(
        "train LoRA adapters of this rank on the policy (through PEFT) instead of "
        "all its weights; the reference is the base model; default: full training",
        bound=at_least(1),
    )
    lora_alpha: Optional[float] = _doc(
        "LoRA scaling numerator (the update is alpha / rank x B A); default: 2 x lora_rank"
    )
    lora_target_modules: Optional[str] = _doc(
        "comma-separated names of the linear layers to adapt (q_proj,v_proj); "
        "default: every attention and MLP projection"
    )
    merge_lora: bool = _doc(
        "also save the policy with the adapter merged in, as a plain Hugging Face model in policy-merged/", False
    )


@dataclass
class ShardingConfig:
    fsdp: bool = _doc(
        "shard the policy, critic and reference over the ranks torchrun starts (FSDP2): each rank "
        "holds 1/N of the weights, gradients and AdamW state",
        False,
    )
    fsdp_reshard_after_forward: bool = _doc(
        "free each block's gathered weights after its forward and gather "
        "them again for the backward (false: keep them, one gather less)",
        True,
    )
    fsdp_offload: bool = _doc(
        "keep the sharded fp32 weights, gradients and AdamW state of the trained models in "
        "CPU memory, the optimizer step on the CPU (CUDA only)",
        False,
    )
    rollout_tp: int = _doc(
        "decode with the rollout copy split over groups of this many ranks (tensor parallelism: heads, "
        "MLP columns and vocabulary, each rank 1/N of the copy and of the KV cache), filled from the "
        "--fsdp shards; a group rolls out its ranks' prompts together. 1: every rank a whole copy",
        1,
        bound=at_least(1),
    )


@dataclass
class DataConfig:
    task: str = _doc(
        "built-in task (prompts, reward and held-out prompts) when --prompts is not given: "
        "arithmetic ('17+25=' -> '42', reward 1 when exact), vowels, or multiply (three-digit "
        "times two-digit products as chat prompts with a worked example, for --tools calculator)",
        "arithmetic",
    )
    prompts: Optional[str] = _doc(
        "local prompt file: .jsonl, .json (a list of objects, or one per line), .parquet "
        "or .csv, one row per prompt; the other fields of a row are passed to the reward "
        "functions"
    )
    prompt_field: str = _doc(
        "the column holding the prompt: a string, used as is, or a list of chat messages "
        "({role, content}) rendered with the chat template",
        "prompt",
    )
    field_map: Optional[list[str]] = _doc(
        "renames of the other columns for the reward functions, column=name (e.g. solution=answer)"
    )
    chat: bool = _doc("render string prompts with the chat template too, as one user message", False)
    system_prompt: Optional[str] = _doc("a system message opening every chat prompt", bound=NOT_EMPTY)
    chat_template: Optional[str] = _doc("a Jinja chat template file used instead of the tokenizer's")
    max_prompt_tokens: Optional[int] = _doc(
        "drop (and count) prompts longer than this many tokens at start-up; "
        "default: no limit beyond the model's context",
        bound=at_least(1),
    )
    drop_long_prompts: bool = _doc(
        "drop (and count) prompts too long for the model's context with "
        "max_new_tokens; without it such a prompt is an error naming its line",
        False,
    )


@dataclass
class RewardConfig:
    reward: Optional[list[str]] = _doc(
        "reward functions, each 'module:function' called as f(prompts, completions, "
        "**fields) -> one real number per completion, or a built-in verifier: gsm8k, "
        "math, boxed or format (fastppo.rewards); the score is their weighted sum; "
        "default: the task's"
    )
    reward_weights: Optional[list[float]] = _doc(
        "one weight per reward (--reward, then --reward-model); default: 1 each"
    )
    reward_model: Optional[str] = _doc(
        "local Hugging Face sequence-classification model scoring prompt + "
        "completion (its first logit), one more reward"
    )
    format_pattern: Optional[str] = _doc(
        "regular expression the whole completion must match for the format "
        "reward; default: <think>...</think><answer>...</answer>"
    )
    overlong_buffer: int = _doc(
        "DAPO's soft overlong penalty: a response longer than max_new_tokens minus this "
        "many tokens loses overlong_penalty x its share of the buffer it used (0: off)",
        0,
    )
    overlong_penalty: float = _doc("the overlong penalty at max_new_tokens", 1.0, bound=at_least(0))


@dataclass
class EvalConfig:
    evaluate: bool = _doc(
        "score the held-out prompts (--eval-prompts, or a built-in task's) at the start, every "
        "--eval-every iterations and at the end",
        True,
    )
    eval_prompts: Optional[str] = _doc(
        "held-out prompt file (the formats and fields of --prompts) scored at the "
        "start, every --eval-every iterations and at the end; default: the task's "
        "held-out prompts, none with --prompts"
    )
    eval_every: int = _doc(
        "evaluate every this many iterations as well (0: at the start and the end only)", 0, bound=at_least(0)
    )
    eval_samples: int = _doc(
        "samples per held-out prompt at the rollout temperature, for mean@K and pass@K "
        "(greedy accuracy is one sample at temperature 0)",
        4,
        bound=at_least(1),
    )


@dataclass
class RolloutConfig:
    prompts_per_iteration: int = _doc("prompts sampled per iteration", 16, bound=at_least(1))
    samples_per_prompt: int = _doc("responses sampled per prompt (the group for GRPO/RLOO)", 8)
    max_new_tokens: int = _doc("most tokens per response", 8, bound=at_least(1))
    temperature: float = _doc("sampling temperature, also used when log-probs are recomputed", 1.0, bound=above(0))
    top_k: int = _doc("sample among the k most likely tokens only (0: all)", 0, bound=at_least(0))
    top_p: float = _doc(
        "sample within the smallest set of tokens of this total probability (1: all)",
        1.0,
        bound=within(0, 1, open_low=True),
    )
    rollout_batch_size: int = _doc(
        "rows the sampler decodes at once, the slots of its KV cache (0: all of an "
        "iteration's rows, or eval_samples if more); further rows take the slots of "
        "finished ones",
        0,
    )
    rollout_kv_memory: Optional[float] = _doc(
        "GiB of the sampler's paged KV cache: rows enter while it covers them, a "
        "prompt's blocks shared by its samples (default: on CUDA what the memory plan "
        "leaves on the device, less a tenth of it; elsewhere enough for every slot at "
        "the cap)",
        bound=above(0),
    )
    rollout_kv_block_size: int = _doc(
        "positions per block of the sampler's KV cache (0: 256 where flash-attn's "
        "decode runs, which pages in multiples of 256, else 16); at most the context",
        0,
        bound=at_least(0),
    )
    stop: Optional[list[str]] = _doc(
        "strings that end a response besides the end-of-sequence token; the response "
        "keeps the stop string and its mask ends there",
        bound=NO_EMPTY_STRING,
    )
    no_stop_penalty: float = _doc("added to the score of a response that never produced the stop token", 0.0)
    filter_groups: bool = _doc(
        "DAPO's dynamic sampling: leave out groups whose scores are all equal (no "
        "advantage) and sample more prompts until the batch is full",
        False,
    )
    filter_groups_attempts: int = _doc(
        "most batches sampled per iteration with filter_groups; a batch still short is filled with equal-score groups",
        4,
        bound=at_least(1),
    )
    rollout_dtype: str = _doc(
        "dtype of the weights the sampler decodes with, a copy refreshed before each "
        "rollout: auto (bfloat16 on CUDA, the fp32 masters themselves elsewhere), "
        "bfloat16, float16 or float32",
        "auto",
        bound=one_of(_rollout_dtypes),
    )
    rollout_weights: str = _doc(
        "what the sampler's projections multiply by: packed (a copy of the rollout weights with each "
        "layer's projections on one input fused, in the layout measured fastest on this machine, "
        "made again before each rollout) or live (the modules themselves: no extra memory); "
        "LoRA and --fsdp runs decode live",
        "packed",
        bound=one_of(_rollout_weights),
    )
    rollout_decoder: str = _doc(
        "the sampler's decoder: lean (a hand-written forward, on the packed weights: llama, mistral, "
        "qwen2, qwen3, gpt2), modules (the model's own modules, attending over fastppo's KV cache: any "
        "family whose layers attend through transformers' attention interface), generic (the model's "
        "own forward and cache), or auto: the first of those that serves the model; the start-up log "
        "says which and why",
        "auto",
        bound=one_of(_rollout_decoders),
    )
    rollout_is_cap: Optional[float] = _doc(
        "weight each token's policy-gradient term by min(pi_old / pi_sampler, "
        "this cap), correcting for the sampler's other precision (truncated "
        "importance sampling); must be > 1; default: off, and 2 with max_staleness >= 1",
        bound=above(1),
    )
    max_staleness: int = _doc(
        "rollouts that never drain: the prompts of up to this many later iterations enter the "
        "sampler's free slots while an iteration's last rows finish, and rows in flight go on "
        "with the new weights after an update; each token's policy-gradient term is then weighted "
        "by the truncated importance weight of the policy at the update's start over the weights "
        "that drew it (decoupled PPO). 0: each rollout drains before its update",
        0,
        bound=at_least(0),
    )


@dataclass
class ToolsConfig:
    tools: Optional[list[str]] = _doc(
        "tools the policy may call, making each response a multi-turn episode: 'module:function' "
        "(type hints and a docstring, as TRL's tools) or a built-in: python (code in a limited "
        "subprocess) or calculator",
        bound=NO_EMPTY_STRING,
    )
    environment: Optional[str] = _doc(
        "an environment class 'module:Class' (TRL's environment_factory): reset(**fields) opens "
        "each episode, its public methods are tools, its get_reward() (if it has one) one more reward",
        bound=NOT_EMPTY,
    )
    max_tool_calls: int = _doc("most assistant turns that call tools in one episode", 8, bound=at_least(1))
    tool_timeout: float = _doc(
        "seconds a tool call may take; past it the model reads a timeout error and the episode goes on",
        30.0,
        bound=TOOL_TIMEOUT,
    )
    escape_tool_tokens: bool = _doc(
        "read a token's text in a tool's result (<|im_end|>, <tool_call>) as text, not as the token: "
        "a result cannot then forge a turn in the model's context",
        False,
    )
    tool_schedule: str = _doc(
        "when a row paused for its tools resumes: fixed (tool_window decode steps after its turn, "
        "whatever the tools' timing; every row waits for a tool still running then; a seed "
        "reproduces the run token for token) or eager (as soon as its tools are done; the rollout "
        "waits for tools only when no row can decode; reproducible in distribution, not token for token)",
        "fixed",
        bound=one_of(_tool_schedules),
    )
    tool_window: int = _doc(
        "decode steps the fixed tool schedule gives a row's tools before it resumes the row", 16, bound=at_least(0)
    )
    max_tool_tokens: int = _doc(
        "room in each row's context for tool results and chat scaffolding, beyond the prompt and "
        "max_new_tokens; a result that would pass it ends the episode as truncated",
        1024,
        bound=at_least(1),
    )


@dataclass
class AlgoConfig:
    estimator: str = _doc(_estimator_help, "grpo", bound=one_of(_estimator_names))
    gamma: float = _doc("discount (gae, reinforce_pp)", 1.0, bound=within(0, 1))
    lam: float = _doc("GAE lambda (gae)", 0.95, bound=within(0, 1))
    kl_coef: float = _doc(
        "weight of the KL to the reference model (in the token rewards for gae and reinforce_pp, "
        "in the loss otherwise)",
        0.0,
        bound=at_least(0),
    )
    kl_estimator: str = _doc("k1, k2 or k3", "k3", bound=one_of(("k1", "k2", "k3")))
    kl_target: Optional[float] = _doc(
        "adapt kl_coef to hold this per-token KL (Ziegler et al. 2019); default: a fixed kl_coef"
    )
    kl_horizon: int = _doc("horizon of the adaptive KL controller, in sequences", 10_000, bound=at_least(1))
    clip_eps: float = _doc(
        "PPO clip range: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]",
        0.2,
        bound=Bound(lambda v: 0 < v < 1, "must be in (0, 1)"),
    )
    clip_eps_high: Optional[float] = _doc(
        "upper clip range, 1 + this (DAPO's clip-higher); default: clip_eps", bound=above(0)
    )
    dual_clip: Optional[float] = _doc(
        "dual-clip bound c > 1 on the loss of negative advantages; default: off", bound=above(1)
    )
    agg: Optional[str] = _doc(
        "how per-token losses become one: token-mean, seq-mean-token-mean, seq-mean-token-sum "
        "or seq-mean-token-sum-norm (over rows x max_new_tokens); default: the estimator's "
        "(token-mean; dr_grpo: seq-mean-token-sum-norm)",
        bound=one_of(_agg_modes),
    )
    sequence_ratio: bool = _doc(
        "GSPO: one importance ratio per response (the geometric mean of its tokens'), "
        "clipped per response, the loss a mean over responses; GSPO's clip ranges are "
        "about 3e-4 and 4e-4 (--clip-eps, --clip-eps-high); needs a group estimator",
        False,
    )
    mask_truncated: bool = _doc("leave responses that hit max_new_tokens out of the loss", False)
    entropy_coef: float = _doc("entropy bonus", 0.0, bound=at_least(0))
    vf_coef: float = _doc("value-loss weight (gae)", 0.5, bound=at_least(0))
    vf_clip: float = _doc("value clip range (gae)", 0.2, bound=above(0))
    ppo_epochs: int = _doc("passes over each rollout batch", 1, bound=at_least(1))
    minibatches: int = _doc("minibatches per pass; must divide the rows of a rollout", 1)
    grad_accumulation: int = _doc(
        "minibatches per optimizer step, normalised by their total token count; must divide minibatches", 1
    )
    max_tokens_per_microbatch: Optional[int] = _doc(
        "split each minibatch's forwards into micro-batches of at most this many prompt and "
        "response tokens, similar lengths together (gradients accumulate; the loss is the same); "
        "default: one forward per minibatch, or on CUDA the most the memory plan fits",
        None,
        bound=at_least(1),
    )
    recompute_old_logprobs: bool = _doc(
        "compute the old log-probs in a separate no-grad pass even when the "
        "update is exactly on-policy (one epoch, one optimizer step per "
        "rollout), where by default they are the update's own, detached",
        False,
    )


@dataclass
class OptimConfig:
    lr: float = _doc("AdamW learning rate of the policy", 5e-4, bound=within(0, 1, open_low=True))
    autocast: Optional[bool] = _doc(
        "forward and backward under bf16 autocast, the weights and optimizer state staying fp32; default: on CUDA only",
        None,
    )
    critic_lr: float = _doc("AdamW learning rate of the critic", 1e-3, bound=within(0, 1, open_low=True))
    warmup_iterations: int = _doc("linear learning-rate warm-up", 0, bound=at_least(0))
    lr_schedule: str = _doc(
        "after the warm-up: constant or cosine (to 0 at the last iteration)",
        "constant",
        bound=one_of(("constant", "cosine")),
    )
    max_grad_norm: float = _doc("gradient clipping norm", 1.0, bound=above(0))


@dataclass
class RunConfig:
    iterations: int = _doc("training iterations", 500, bound=at_least(1))
    seed: int = _doc("seed of every random draw", 0, bound=Bound(lambda v: 0 <= v < 2**32, "must be in [0, 2**32)"))
    device: str = _doc(
        "where to train: auto (CUDA when available), cuda, cuda:N or cpu",
        "auto",
        bound=matching(r"auto|cpu|cuda(:\d+)?", "must be auto, cpu, cuda or cuda:N"),
    )
    cpu_release_memory: Optional[bool] = _doc(
        "on the CPU, return each freed tensor's memory to the OS at once "
        "(glibc): far lower peak memory (a LoRA run of SmolLM2-135M: 1.9 GB "
        "instead of 4.8) for 30-40% more time; off, the heap keeps it for the "
        "next iteration's tensors, with no fresh page faults "
        "(fastppo/trainer/modeling/host_memory.py); "
        "default: on for LoRA runs, whose point is memory, off otherwise"
    )
    out: str = _doc("run directory (metrics.jsonl, config.json, the final model)", "runs/fastppo")
    save: bool = _doc("save the policy (and critic) in Hugging Face format at the end", True)
    save_dtype: str = _doc(
        "dtype of the saved policy: auto (the checkpoint's own), bfloat16, float16 or "
        "float32; checkpoints for --resume always keep the fp32 masters",
        "auto",
        bound=one_of(_save_dtypes),
    )
    save_every: int = _doc("also save every this many iterations (0: only at the end)", 0, bound=at_least(0))
    save_every_minutes: float = _doc(
        "also save once this many minutes have passed since the last save, so a run "
        "killed hours in (out of memory, a preempted machine) loses at most that much "
        "(0: off)",
        30.0,
        bound=at_least(0),
    )
    keep_checkpoints: int = _doc("numbered checkpoints to keep, newest first (0: all)", 2, bound=at_least(0))
    log_completions: int = _doc(
        "rows of each iteration written to completions.jsonl (and TensorBoard's text "
        "tab): prompt, completion, score and each reward's (0: none)",
        4,
        bound=at_least(0),
    )
    overwrite: bool = _doc(
        "start afresh in a non-empty run directory, deleting what it holds (only a "
        "fastppo run directory); without it such a directory is refused",
        False,
    )
