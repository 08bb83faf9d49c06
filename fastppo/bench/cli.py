"""``fastppo bench``: print the bench tables, optionally writing them as JSON and markdown."""

import argparse
from pathlib import Path

import torch

from .report import markdown, to_json
from .roofline import GPU
from .runner import FAMILIES, run_suite


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastppo bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--op", action="append", choices=list(FAMILIES), help="an op family to run (repeatable; default: all)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes that finish in seconds on a CPU")
    parser.add_argument("--json", type=Path, help="also write the rows and the machine as JSON here")
    parser.add_argument("--markdown", type=Path, help="also write the tables here")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=float("inf"),
        metavar="SECONDS",
        help="stop measuring after this long; the rest is listed as skipped",
    )
    parser.add_argument(
        "--limits",
        action="store_true",
        help="measure this machine's matmul rate per dtype and read bandwidth (the limits the end-to-end "
        "reports hold each phase to) instead of the op tables",
    )
    versus = parser.add_argument_group("end to end against TRL (--versus-trl)")
    versus.add_argument(
        "--versus-trl",
        action="store_true",
        help="train with fastppo and with TRL's GRPOTrainer side by side instead of the op tables",
    )
    versus.add_argument("--model", help="local Hugging Face causal LM (default: the shipped tiny model)")
    versus.add_argument("--iterations", type=int, help="iterations of each run (default: 40; 3 with --sharding)")
    versus.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    versus.add_argument("--samples", type=int, default=8, help="samples per prompt")
    versus.add_argument("--max-new-tokens", type=int, default=8)
    versus.add_argument(
        "--workload",
        choices=("arithmetic", "chat", "tools"),
        default="arithmetic",
        help="the shipped task's short prompts, chat prompts of 150-300 tokens with a verifier reward, or "
        "multi-turn episodes with a calculator tool",
    )
    versus.add_argument("--lr", type=float, default=5e-4)
    versus.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="both trainers in bf16 mixed precision (default: on CUDA only)",
    )
    versus.add_argument(
        "--trl-without-checkpointing",
        action="store_true",
        help="also run TRL with its gradient checkpointing off; the speed-up is against its faster run",
    )
    parser.add_argument(
        "--async",
        dest="streamed",
        action="store_true",
        help="rollouts that never drain (--max-staleness K) at K = 0, 1 and 2 side by side: a long-tail "
        "workload and slow tools on SmolLM2-135M, and the learning curve of the shipped task",
    )
    sharded = parser.add_argument_group("sharded against replicated data parallelism (--sharding)")
    sharded.add_argument(
        "--sharding",
        action="store_true",
        help="one PPO iteration on 2 gloo ranks with and without --fsdp instead of the op tables",
    )
    sharded.add_argument("--hidden", type=int, default=512, help="hidden size of the random Llama")
    sharded.add_argument("--layers", type=int, default=8, help="layers of the random Llama")
    sass = parser.add_argument_group("predicted from sm_90 machine code, no GPU needed (--sass)")
    sass.add_argument(
        "--sass",
        action="store_true",
        help="compile every kernel at realistic shapes and print the roofline estimate of its SASS",
    )
    gpu = GPU()
    sass.add_argument("--gpu-name", help=f"the GPU the figures describe (default: {gpu.name})")
    sass.add_argument("--gpu-sms", type=int, help=f"multiprocessors (default: {gpu.sms})")
    sass.add_argument("--gpu-clock-ghz", type=float, help=f"SM clock (default: {gpu.clock_ghz})")
    sass.add_argument("--gpu-copy-tbs", type=float, help=f"copy bandwidth, read + write (default: {gpu.copy_tbs})")
    sass.add_argument("--gpu-matmul-tflops", type=float, help=f"dense bf16 matmul rate (default: {gpu.matmul_tflops})")
    sass.add_argument("--gpu-latency-us", type=float, help=f"DRAM latency under load (default: {gpu.latency_us})")
    sass.add_argument(
        "--beside",
        type=Path,
        metavar="JSON",
        help="a --sass --json report made under another triton: compare the two per kernel",
    )
    args = parser.parse_args(argv)
    if args.sass:
        return _sass(args, parser)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.limits:
        return _limits(args)
    if args.versus_trl:
        return _versus_trl(args)
    if args.sharding:
        return _sharding(args)
    if args.streamed:
        return _streamed(args)

    def write(meta, rows):
        for path, render in ((args.json, to_json), (args.markdown, markdown)):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(render(meta, rows))

    meta, rows = run_suite(
        args.op or list(FAMILIES),
        torch.device(args.device),
        quick=args.quick,
        time_budget_s=args.time_budget,
        on_case=write,
    )
    write(meta, rows)
    print(markdown(meta, rows), end="")
    return 0


def _versus_trl(args) -> int:
    from .runner import machine
    from .versus_trl import compare
    from .versus_trl import markdown as versus_markdown

    device = torch.device(args.device)
    result = compare(
        args.model,
        device,
        prompts=args.prompts,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr,
        iterations=args.iterations or 40,
        bf16=args.bf16,
        workload=args.workload,
        trl_without_checkpointing=args.trl_without_checkpointing,
    )
    return _report(args, result, versus_markdown(result, machine(device)))


def _limits(args) -> int:
    from dataclasses import asdict

    from .phase_limits import markdown as limits_markdown
    from .phase_limits import measure

    limits = measure(torch.device(args.device))
    return _report(args, asdict(limits), limits_markdown(limits))


def _sharding(args) -> int:
    from .runner import machine
    from .sharding import compare
    from .sharding import markdown as sharding_markdown

    result = compare(hidden=args.hidden, layers=args.layers, iterations=args.iterations or 3)
    return _report(args, result, sharding_markdown(result, machine(torch.device("cpu"))))


def _streamed(args) -> int:
    from .runner import machine
    from .staleness import compare
    from .staleness import markdown as staleness_markdown

    device = torch.device(args.device)
    result = compare(device, args.quick)
    return _report(args, result, staleness_markdown(result, machine(device)))


def _sass(args, parser) -> int:
    import datetime
    import json
    import os
    from dataclasses import asdict

    from ..ops.dispatch import TRITON_INSTALLED
    from .kernel_cases import all_cases, decode_step_bytes, from_hidden_plans
    from .roofline import estimate, with_overrides
    from .roofline import markdown as roofline_markdown
    from .runner import commit

    if os.environ.get("TRITON_INTERPRET"):
        parser.error("--sass compiles for a GPU: unset TRITON_INTERPRET")
    if not TRITON_INSTALLED:
        parser.error("--sass needs triton (pip install triton)")
    import triton

    for name in ("gpu_sms", "gpu_clock_ghz", "gpu_copy_tbs", "gpu_matmul_tflops", "gpu_latency_us"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    gpu = with_overrides(
        GPU(),
        name=args.gpu_name,
        sms=args.gpu_sms,
        clock_ghz=args.gpu_clock_ghz,
        copy_tbs=args.gpu_copy_tbs,
        matmul_tflops=args.gpu_matmul_tflops,
        latency_us=args.gpu_latency_us,
    )
    beside = None
    if args.beside is not None:
        try:
            beside = json.loads(args.beside.read_text())
            beside["meta"]["triton"], beside["kernels"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            parser.error(f"--beside {args.beside}: not a --sass --json report ({error})")
    meta = {"date": datetime.date.today().isoformat(), "commit": commit(), "triton": triton.__version__}
    rows = [estimate(case, gpu) for case in all_cases()]
    plans = from_hidden_plans(gpu)
    decode_bytes = decode_step_bytes()
    return _report(
        args,
        {"meta": meta, "gpu": asdict(gpu), "kernels": rows, "from_hidden": plans, "decode_bytes": decode_bytes},
        roofline_markdown(rows, plans, gpu, meta, beside, decode_bytes),
    )


def _report(args, result: dict, table: str) -> int:
    """Print ``table``; write it and ``result`` where --markdown and --json say."""
    import json

    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
    print(table, end="")
    return 0
