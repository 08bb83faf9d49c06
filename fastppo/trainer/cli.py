"""``fastppo train``: every config field is an option; ``--config FILE`` sets many at once;
``--resume RUN_DIR`` continues a run exactly.

What the user gave being wrong (a config, a data file, a model, a run directory) is one line,
``fastppo train: error: ...``, and exit code 2, as argparse does for its own errors; a reward
function that raised (or called ``sys.exit``), a run that trained nothing (every step skipped) or
reached non-finite weights is one line, ``fastppo train: failed: ...``, and exit code 1; anything
else is a bug and keeps its traceback. ``--debug`` shows the traceback of every error.
"""

import argparse
import sys
from pathlib import Path

from .config import TrainConfig, add_arguments, from_arguments, given_fields
from .errors import RewardFailed, TrainingFailed, UsageError
from .ppo import PPOTrainer
from .signals import StoppedAtOnce


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastppo train", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest checkpoint; "
        "--config and options may change only how long it runs and how it saves",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of every error")
    plan = parser.add_argument_group("memory plan")
    plan.add_argument(
        "--plan",
        action="store_true",
        help="print the memory this run needs on one device, from "
        "the model's config alone (no weights read), and exit without training",
    )
    plan.add_argument(
        "--plan-prompt-tokens",
        type=int,
        metavar="N",
        help="the longest prompt, in tokens (default: measured from the prompts with the model's tokenizer)",
    )
    plan.add_argument("--plan-world-size", type=int, metavar="N", help="ranks of the run (default: $WORLD_SIZE or 1)")
    plan.add_argument(
        "--plan-mean-response-tokens",
        type=int,
        metavar="N",
        help="the responses' mean length, for the rows in flight the KV cache allows "
        "(default: a quarter of the budget)",
    )
    plan.add_argument(
        "--plan-device-memory",
        type=float,
        metavar="GIB",
        help="memory of the device to compare with (default: this machine's GPU, else its RAM)",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        if args.plan:
            return _plan(args)
        return _train(args)
    except UsageError as error:
        if args.debug:
            raise
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except (TrainingFailed, RewardFailed) as error:
        if args.debug:
            raise
        print(f"{parser.prog}: failed: {error}", file=sys.stderr)
        return 1
    except StoppedAtOnce as error:
        if args.debug:
            raise
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 130  # as a shell reports a process stopped by SIGINT


def exit_after_sharding(code: int) -> None:
    """Exit now, without the interpreter's teardown. After ``fully_shard`` something inside torch
    keeps the gloo process group alive past ``destroy_process_group``, and its threads, still
    joinable when the interpreter destroys them at exit, abort the process ("terminate called
    without an active exception"): a run that wrote everything would report a crash. Everything
    is on disk and closed by then (each save atomic, the logs flushed)."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _train(args) -> int:
    if args.resume:
        trainer, start = PPOTrainer.resume(args.resume, given_fields(args))
        if trainer.ranks.main:
            print(
                f"resuming {args.resume} from checkpoint-{start}: iterations {start} to "
                f"{trainer.config.run.iterations - 1}",
                flush=True,
            )
    else:
        trainer, start = PPOTrainer(from_arguments(args)), 0
    try:
        history = trainer.train(start)
    finally:
        trainer.ranks.close()
    if trainer.ranks.main and history:
        for line in summary(
            Path(trainer.config.run.out), len(trainer.eval_prompts or ()), trainer.config.eval.eval_samples
        ):
            print(line)
    if trainer.models.sharded:
        exit_after_sharding(0)
    return 0


def _check_plan_options(args) -> None:
    import math

    if args.plan_prompt_tokens is not None and args.plan_prompt_tokens < 1:
        raise UsageError(f"--plan-prompt-tokens must be >= 1, got {args.plan_prompt_tokens}")
    if args.plan_world_size is not None and args.plan_world_size < 1:
        raise UsageError(f"--plan-world-size must be >= 1, got {args.plan_world_size}")
    if args.plan_mean_response_tokens is not None and args.plan_mean_response_tokens < 1:
        raise UsageError(f"--plan-mean-response-tokens must be >= 1, got {args.plan_mean_response_tokens}")
    memory = args.plan_device_memory
    if memory is not None and not (math.isfinite(memory) and memory > 0):
        raise UsageError(f"--plan-device-memory must be a positive number of GiB, got {memory}")


def summary(out: Path, held_out: int, k: int) -> list:
    """The end-of-run lines, from the whole run's ``metrics.jsonl`` (a resumed run's too): the mean
    reward of the first and last 5 iterations, and the held-out scores at the first and the last
    evaluation, each reward function's as well when there are several."""
    from .run_directory import read_metrics

    rows = [row for _, row in read_metrics(out / "metrics.jsonl")]
    trained = [row for row in rows if "reward_mean" in row]
    lines = []
    if trained:
        first, last = trained[:5], trained[-5:]
        lines.append(
            f"mean reward: first 5 iterations {sum(r['reward_mean'] for r in first) / len(first):.3f}, "
            f"last 5 {sum(r['reward_mean'] for r in last) / len(last):.3f} ({len(trained)} iterations); "
            f"metrics in {out}/metrics.jsonl"
        )
    evaluated = [row for row in rows if "eval/greedy" in row]
    if len(evaluated) >= 2:
        before, after = evaluated[0], evaluated[-1]
        prefixes = sorted({key[: -len("greedy")] for key in after if key.endswith("/greedy")})
        for prefix in prefixes:  # "eval/" first, then each reward's
            name = "" if prefix == "eval/" else f"{prefix[len('eval/') : -1]}: "
            passed = f"{prefix}pass@{k}"  # missing before a resume that changed eval_samples
            best = f", pass@{k} {before[passed]:.3f} -> {after[passed]:.3f}" if passed in before else ""
            lines.append(
                f"held-out ({held_out} prompts): {name}greedy {before[prefix + 'greedy']:.3f} -> "
                f"{after[prefix + 'greedy']:.3f}{best} (iteration {before['iteration']} -> "
                f"{after['iteration']})"
            )
    return lines


def _plan(args) -> int:
    import torch
    from transformers import AutoConfig

    from . import data, tasks
    from .distributed import world_size
    from .models import DEFAULT_MODEL
    from .plan import GiB, device_memory, fitting_microbatch, kv_memory, memory_plan, render, runtime_bytes

    config = from_arguments(args)
    _check_plan_options(args)
    path = config.model.model or DEFAULT_MODEL
    try:
        model_config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise UsageError(f"--model {path}: no model config to plan from ({error})") from None
    tokens = args.plan_prompt_tokens
    if tokens is None:
        from transformers import AutoTokenizer

        try:  # transformers 5 makes an empty tokenizer (one token) of a directory without one
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            tokenizer = None
        if tokenizer is None or len(tokenizer) < 2:
            raise UsageError(f"--model {path} has no tokenizer to measure the prompts with; give --plan-prompt-tokens")
        d = config.data
        rows, origins = data.read_rows(d.prompts) if d.prompts else tasks.task_rows(d.task, config.run.seed)
        source = f"--prompts {d.prompts}" if d.prompts else f"task {d.task}"
        try:
            tokens = max(len(ids) for ids in data.load(rows, origins, tokenizer, d, source).ids)
        except UsageError as error:
            raise UsageError(f"{error} (with the tokenizer of --model {path}; or give --plan-prompt-tokens)") from None
    context = getattr(model_config, "max_position_embeddings", None)
    if context is not None and tokens + config.response_tokens > context:
        room = f"--max-new-tokens {config.rollout.max_new_tokens}"
        if config.episodes:
            room += f" and --max-tool-tokens {config.tools.max_tool_tokens}"
        raise UsageError(
            f"--plan-prompt-tokens {tokens} with {room} exceeds the context of --model {path} ({context} positions)"
        )
    device_type = torch.device(config.device).type
    world = args.plan_world_size or world_size()
    reward_config = AutoConfig.from_pretrained(config.reward.reward_model) if config.reward.reward_model else None
    runtime = runtime_bytes() if device_type == "cpu" else 0
    available = int(args.plan_device_memory * GiB) if args.plan_device_memory else device_memory(device_type)
    common = dict(world_size=world, reward_model_config=reward_config, runtime=runtime)
    kv = kv_memory(config, model_config, prompt_tokens=tokens, device_type=device_type, available=available, **common)

    def plan(**changes) -> list:  # the run's lines, or those of the run with ``changes``
        changed = TrainConfig.from_flat({**config.flat(), **changes}).validate()
        return memory_plan(
            changed,
            model_config,
            prompt_tokens=tokens,
            device_type=device_type,
            kv_memory=kv,
            mean_response_tokens=args.plan_mean_response_tokens,
            **common,
        )

    def total(**changes) -> int:
        return sum(line.bytes for line in plan(**changes))

    lines = plan()
    print(
        render(
            lines,
            available,
            f"memory plan for one {device_type} device: {path}, prompts up to {tokens} "
            f"tokens, {world} rank(s), "
            + ("sharded (--fsdp)" if config.sharding.fsdp else "each holding whole copies"),
        ),
        end="",
    )
    if sum(line.bytes for line in lines) > available:
        budget = fitting_microbatch(
            config,
            model_config,
            prompt_tokens=tokens,
            device_type=device_type,
            available=available,
            world_size=world,
            reward_model_config=reward_config,
            runtime=runtime,
        )
        print(_what_would_fit(config, total, available, budget))
    return 0


def _what_would_fit(config, total, available: int, budget) -> str:
    """The options (each alone, then all of them) that would bring the plan's ``total(**changes)``
    under ``available``, with their totals; ``budget``: the micro-batch tokens that would fit
    (:func:`~fastppo.trainer.plan.fitting_microbatch`), or None."""
    from .plan import GiB

    r = config.rollout
    candidates = [("--gradient-checkpointing", {"gradient_checkpointing": True})]
    if budget is not None:
        candidates.append((f"--max-tokens-per-microbatch {budget}", {"max_tokens_per_microbatch": budget}))
    if config.lora.lora_rank is None:
        candidates.append(("--lora-rank 16", {"lora_rank": 16}))
    rows = r.prompts_per_iteration * r.samples_per_prompt
    if config.algo.minibatches < rows and rows % (4 * config.algo.minibatches) == 0:
        more = config.algo.minibatches * 4
        candidates.append(
            (f"--minibatches {more} --grad-accumulation {more}", {"minibatches": more, "grad_accumulation": more})
        )
    candidates.append(
        (" ".join(option for option, _ in candidates), {k: v for _, change in candidates for k, v in change.items()})
    )
    fitting = [(option, total(**change)) for option, change in candidates]
    fitting = [f"{option} ({size / GiB:.2f} GiB)" for option, size in fitting if size <= available]
    if not fitting:
        return (
            "  none of --gradient-checkpointing, LoRA and smaller minibatches fits it on one device: shard it "
            "over more (--fsdp with torchrun) or a larger device"
        )
    return "  it would fit with: " + "; or ".join(fitting)
