"""``fastppo train``: every config field is an option; ``--config FILE`` sets many at once;
``--resume RUN_DIR`` continues a run exactly.

What the user gave being wrong (a config, a data file, a model, a run directory) is one line,
``fastppo train: error: ...``, and exit code 2, as argparse does for its own errors; a run
that trained nothing (every step skipped) is one line and exit code 1; anything else is a bug
and keeps its traceback. ``--debug`` shows the traceback of every error.
"""

import argparse
import sys

from .config import add_arguments, from_arguments, given_fields
from .errors import UsageError
from .ppo import PPOTrainer, StoppedAtOnce, TrainingFailed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastppo train", description=__doc__.splitlines()[0])
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint; "
                        "--config and options may change only how long it runs and how it saves")
    parser.add_argument("--debug", action="store_true", help="show the traceback of every error")
    plan = parser.add_argument_group("memory plan")
    plan.add_argument("--plan", action="store_true", help="print the memory this run needs on one device, from "
                      "the model's config alone (no weights read), and exit without training")
    plan.add_argument("--plan-prompt-tokens", type=int, metavar="N", help="the longest prompt, in tokens "
                      "(default: measured from the prompts with the model's tokenizer)")
    plan.add_argument("--plan-world-size", type=int, metavar="N", help="ranks of the run (default: $WORLD_SIZE or 1)")
    plan.add_argument("--plan-device-memory", type=float, metavar="GIB",
                      help="memory of the device to compare with (default: this machine's GPU, else its RAM)")
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
    except TrainingFailed as error:
        if args.debug:
            raise
        print(f"{parser.prog}: failed: {error}", file=sys.stderr)
        return 1
    except StoppedAtOnce as error:
        if args.debug:
            raise
        print(f"{parser.prog}: {error}; the newest checkpoint is intact", file=sys.stderr)
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
    else:
        trainer, start = PPOTrainer(from_arguments(args)), 0
    try:
        history = trainer.train(start)
    finally:
        trainer.ranks.close()
    if trainer.ranks.main and history:
        first = sum(h["reward_mean"] for h in history[:5]) / len(history[:5])
        last = sum(h["reward_mean"] for h in history[-5:]) / len(history[-5:])
        print(f"mean reward: first 5 iterations {first:.3f}, last 5 {last:.3f} ({len(history)} iterations); "
              f"metrics in {trainer.config.run.out}/metrics.jsonl")
        if len(trainer.evaluations) >= 2:
            before, after = trainer.evaluations[0], trainer.evaluations[-1]
            k = trainer.config.eval.eval_samples
            print(f"held-out ({len(trainer.eval_prompts)} prompts): greedy {before['eval/greedy']:.3f} -> "
                  f"{after['eval/greedy']:.3f}, pass@{k} {before[f'eval/pass@{k}']:.3f} -> "
                  f"{after[f'eval/pass@{k}']:.3f} (iteration {before['iteration']} -> {after['iteration']})")
    if trainer.sharded:
        exit_after_sharding(0)
    return 0


def _check_plan_options(args) -> None:
    import math

    if args.plan_prompt_tokens is not None and args.plan_prompt_tokens < 1:
        raise UsageError(f"--plan-prompt-tokens must be >= 1, got {args.plan_prompt_tokens}")
    if args.plan_world_size is not None and args.plan_world_size < 1:
        raise UsageError(f"--plan-world-size must be >= 1, got {args.plan_world_size}")
    memory = args.plan_device_memory
    if memory is not None and not (math.isfinite(memory) and memory > 0):
        raise UsageError(f"--plan-device-memory must be a positive number of GiB, got {memory}")


def _plan(args) -> int:
    import torch
    from transformers import AutoConfig

    from . import data, tasks
    from .distributed import world_size
    from .models import DEFAULT_MODEL
    from .plan import GiB, device_memory, memory_plan, render

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

        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            raise UsageError(f"--model {path} has no tokenizer to measure the prompts with; give "
                             "--plan-prompt-tokens") from None
        d = config.data
        rows, origins = data.read_rows(d.prompts) if d.prompts else tasks.task_rows(d.task, config.run.seed)
        source = f"--prompts {d.prompts}" if d.prompts else f"task {d.task}"
        try:
            tokens = max(len(ids) for ids in data.load(rows, origins, tokenizer, d, source).ids)
        except UsageError as error:
            raise UsageError(f"{error} (with the tokenizer of --model {path}; or give --plan-prompt-tokens)") from None
    context = getattr(model_config, "max_position_embeddings", None)
    if context is not None and tokens + config.rollout.max_new_tokens > context:
        raise UsageError(f"--plan-prompt-tokens {tokens} with --max-new-tokens {config.rollout.max_new_tokens} "
                         f"exceeds the context of --model {path} ({context} positions)")
    device_type = torch.device(config.device).type
    world = args.plan_world_size or world_size()
    reward_config = AutoConfig.from_pretrained(config.reward.reward_model) if config.reward.reward_model else None
    lines = memory_plan(config, model_config, prompt_tokens=tokens, device_type=device_type, world_size=world,
                        reward_model_config=reward_config)
    available = int(args.plan_device_memory * GiB) if args.plan_device_memory else device_memory(device_type)
    print(render(lines, available, f"memory plan for one {device_type} device: {path}, prompts up to {tokens} "
                                   f"tokens, {world} rank(s), "
                                   + ("sharded (--fsdp)" if config.sharding.fsdp else "each holding whole copies")),
          end="")
    return 0
