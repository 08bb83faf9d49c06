"""The rules a config must keep, checked at start-up by ``TrainConfig.validate``: each field within the
bound declared beside it (``fields.py``), every number finite and within float32's range, and the
rules that span fields (a group estimator for ``filter_groups``, one weight per reward, ...), each
error naming the field."""

import math
from typing import TYPE_CHECKING

from ...errors import UsageError
from ...limits import FLOAT32_MAX
from ..prompts.tasks import TASKS
from ..update import estimators
from .fields import LARGEST_INT

if TYPE_CHECKING:  # for the annotations only
    from .config import TrainConfig


def check(config: "TrainConfig", fields: list) -> None:
    """Raise :class:`~fastppo.errors.UsageError` naming the first field that breaks a rule; ``fields``:
    every field of every section of ``config`` (``config.fields()``), each with its bound."""
    registered = estimators.ESTIMATORS  # read now: an estimator may be registered after import

    flat = config.flat()
    for f in fields:
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
    r, a, d, lora, rw, ev = config.rollout, config.algo, config.data, config.lora, config.reward, config.eval
    rewards = len(rw.reward or ()) + bool(rw.reward_model) or 1  # else the task's one
    estimator = registered[a.estimator]
    group_estimators = ", ".join(name for name, e in registered.items() if e.grouped)
    rules = [
        (
            "task",
            d.task in TASKS or (d.prompts and (rw.reward or rw.reward_model or config.tools.environment)),
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
            not (r.stop and config.episodes),
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
            "max_staleness",
            not r.max_staleness
            or (r.max_staleness <= config.run.iterations and not r.filter_groups and not a.sequence_ratio),
            "must be at most iterations, and without filter_groups (whose batches vary) or sequence_ratio "
            "(no importance weights)",
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
        ("critic", not estimator.critic or config.model.critic is not False, f"must be on for estimator={a.estimator}"),
        (
            "critic_init",
            config.model.critic_init != "reward_model" or rw.reward_model,
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
            not config.sharding.fsdp_offload or (config.sharding.fsdp and config.device.startswith("cuda")),
            "needs --fsdp and a CUDA device (on the CPU there is nowhere to offload to)",
        ),
        (
            "rollout_tp",
            config.sharding.rollout_tp == 1
            or (
                config.sharding.fsdp
                and r.rollout_decoder in ("auto", "modules")
                and not r.max_staleness
                and not config.episodes
            ),
            "above 1 needs --fsdp (its copy is filled from the shards) and the modules decoder (auto or "
            "modules), and is not for max_staleness or tools",
        ),
    ]
    for name, ok, requirement in rules:
        if not ok:
            raise UsageError(f"config field {name} {requirement}, got {flat[name]!r}")
