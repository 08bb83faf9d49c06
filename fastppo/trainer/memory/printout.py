"""``fastppo train --plan``: the memory plan of a run as it would start, printed against the memory
there is, and what would fit when it does not.
"""

from ...errors import UsageError
from ..configuration.arguments import from_arguments
from ..configuration.config import TrainConfig


def check_plan_options(args) -> None:
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


def print_plan(args) -> int:
    import torch
    from transformers import AutoConfig

    from ...limits import GiB
    from ..modeling.default import DEFAULT_MODEL
    from ..parallel.distributed import world_size
    from ..prompts import dataset, tasks
    from ..prompts.files import read_rows
    from .plan import device_memory, fitting_microbatch, kv_memory, memory_plan, peak, render, runtime_bytes

    config = from_arguments(args)
    check_plan_options(args)
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
        rows, origins = read_rows(d.prompts) if d.prompts else tasks.task_rows(d.task, config.run.seed)
        source = f"--prompts {d.prompts}" if d.prompts else f"task {d.task}"
        try:
            tokens = max(len(ids) for ids in dataset.load(rows, origins, tokenizer, d, source).ids)
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
    tp = config.sharding.rollout_tp
    if tp > 1:
        from ...rollout.tensor_parallel import Unsharded, kv_sharing

        if world % tp:
            raise UsageError(f"--rollout-tp {tp} does not divide the {world} ranks planned (--plan-world-size)")
        try:
            kv_sharing(model_config, tp)
        except Unsharded as why:
            raise UsageError(f"--rollout-tp {tp}: {why}") from None
    common = dict(world_size=world, reward_model_config=reward_config, runtime=runtime)
    kv = kv_memory(config, model_config, prompt_tokens=tokens, device_type=device_type, available=available, **common)

    def plan(ranks: int = world, **changes) -> list:  # the run's lines, or those of the run with ``changes``
        changed = TrainConfig.from_flat({**config.flat(), **changes}).validate()
        return memory_plan(
            changed,
            model_config,
            prompt_tokens=tokens,
            device_type=device_type,
            kv_memory=kv,
            mean_response_tokens=args.plan_mean_response_tokens,
            **{**common, "world_size": ranks},
        )

    def total(ranks: int, **changes) -> int:
        return peak(plan(ranks, **changes))

    lines = plan()
    print(
        render(
            lines,
            available,
            f"memory plan for one {device_type} device: {path}, prompts up to {tokens} "
            f"tokens, {world} rank(s), "
            + ("sharded (--fsdp)" if config.sharding.fsdp else "each holding whole copies")
            + (f", the rollout split over {tp} (--rollout-tp)" if tp > 1 else ""),
        ),
        end="",
    )
    if peak(lines) > available:
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
        print(_what_would_fit(config, total, available, budget, world, model_config))
    return 0


def _what_would_fit(config: "TrainConfig", total, available: int, budget, world: int, model_config) -> str:
    """The options (each alone, then all of them) that would bring the plan's peak
    ``total(world, **changes)`` under ``available``, with their peaks, and the fewest ranks (up to 16
    times as many) that would with the run's other options; ``budget``: the micro-batch tokens that fit
    (:func:`~fastppo.trainer.memory.plan.fitting_microbatch`), or None."""
    from ...limits import GiB

    r, sharding = config.rollout, config.sharding
    candidates = (
        [] if config.model.gradient_checkpointing else [("--gradient-checkpointing", {"gradient_checkpointing": True})]
    )
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
    if not sharding.fsdp and world > 1:
        candidates.append(("--fsdp", {"fsdp": True}))
    fsdp = sharding.fsdp or world > 1
    if fsdp and sharding.rollout_tp == 1:
        split = _largest_split(model_config, world)
        if split > 1:
            candidates.append((f"--rollout-tp {split}", {"fsdp": True, "rollout_tp": split}))
    if fsdp and config.device.startswith("cuda") and not sharding.fsdp_offload:
        candidates.append(("--fsdp-offload", {"fsdp": True, "fsdp_offload": True}))
    every = {k: v for _, change in candidates for k, v in change.items()}
    candidates.append((" ".join(option for option, _ in candidates), every))
    fitting = [(option, total(world, **change)) for option, change in candidates]
    fitting = [f"{option} ({size / GiB:.2f} GiB)" for option, size in fitting if size <= available]
    for ranks in (2 * world, 4 * world, 8 * world, 16 * world):  # more ranks, the run as it is otherwise
        change, split = {"fsdp": True}, _largest_split(model_config, ranks)
        if split > 1 and sharding.rollout_tp == 1:
            change["rollout_tp"] = split
        size = total(ranks, **change)
        if size <= available:
            options = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in change.items())
            fitting.append(f"{ranks} ranks (--plan-world-size {ranks}) with {options} ({size / GiB:.2f} GiB)")
            break
    if fitting:
        return "  it would fit with: " + "; or ".join(fitting)
    return (
        "  none of --gradient-checkpointing, LoRA, smaller minibatches, --fsdp, --rollout-tp and --fsdp-offload fits "
        f"it, nor {16 * world} ranks: a larger device"
    )


def _largest_split(model_config, ranks: int) -> int:
    """The largest ``--rollout-tp`` of at most 8 (one node's GPUs) that divides ``ranks`` and the model's
    heads, 1 where the sampler cannot split the model."""
    from ...rollout.tensor_parallel import Unsharded, kv_sharing

    if not getattr(model_config, "base_model_tp_plan", None):
        return 1
    for size in (8, 4, 2):
        if ranks % size == 0:
            try:
                kv_sharing(model_config, size)
            except Unsharded:
                continue
            return size
    return 1
