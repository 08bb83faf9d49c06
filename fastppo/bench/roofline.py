"""``fastppo bench --sass``: what each kernel's sm_90 machine code predicts on a GPU, without one.

Every kernel is compiled as its launcher launches it at a realistic shape, specialised as the
runtime would specialise it (``launches.py``), and its SASS is read (``sass.py``). Three times
bound the kernel from below, and the largest is the prediction:

* **issue**: the busiest SM runs ``ceil(programs / SMs)`` programs, and each program's
  instructions occupy the dispatch and the pipes at their rates (``schedule.py``: fp32 and IMAD
  sharing the two FMA pipes, IMAD alone on FMA-heavy, the integer/compare ALU at half rate,
  shuffles and loads/stores at a quarter, MUFU and conversions at an eighth). The busiest pipe
  binds, and the report names it.
* **latency**: one program's time, replayed from the control bits ptxas scheduled (each trip of the
  hot loop waits its loads' DRAM latency, unless the loop is pipelined, then its reductions,
  shuffles and barriers), times the *waves*: programs of equal length fill the SMs' resident
  slots (from warps, registers and shared memory) and refill them whole, so 1024 programs in 660
  slots take two program times, not 1.55. What an SM achieves when its resident programs' trips
  overlap perfectly and nothing else limits them.
* **memory**: the fewest bytes the kernel must move over the copy bandwidth.

The *share of copy* is the memory time over the prediction. When another bound is within 20% of
the largest, they compete, and taking the largest alone is optimistic: such a row is flagged and
given as a range, from the largest (perfect overlap) to the sum of the two largest (none).

It is an estimate from compiled code, and says so: the latencies of variable-latency instructions
and of DRAM are assumptions (in ``schedule.LATENCY`` and ``GPU.latency_us``, which
``bench/kernel_check.py`` measures on a GPU); resident programs contend for the pipes, which the
latency bound ignores; the L2 and clocks below boost are ignored. ``bench/gpu_check.sh`` measures
the real thing.

The ops from hidden states and the LM head (log-probs and the PPO loss) are bound by their
matmuls, whose cost is cuBLAS's, not SASS of ours: they get a FLOP/byte model of the launcher's
chunk plan instead (``from_hidden_model``), against the three bare matmuls.
"""

from dataclasses import dataclass, replace
from typing import Optional

from .launches import Launch, compile_launch
from .sass import disassemble, hot_loop, mix
from .schedule import global_loads, pipe_cycles, program, warp_cycles


@dataclass(frozen=True)
class GPU:
    """The figures the estimate needs; defaults are an H200 SXM's."""

    name: str = "H200"
    sms: int = 132
    clock_ghz: float = 1.98  # boost clock
    copy_tbs: float = 4.3  # device-to-device copy, bytes read + written, as measured on an H200
    matmul_tflops: float = 788.0  # dense bf16, 8192^3 products of random data, as measured on an H200
    latency_us: float = 0.8  # DRAM latency under load, an assumption
    launch_us: float = 2.5  # GPU time of a small kernel launched back to back, an assumption
    max_warps: int = 64  # resident per SM
    max_programs: int = 32
    registers: int = 65536  # per SM
    register_granule: int = 256  # registers are allocated per warp in multiples of this
    shared_bytes: int = 228 * 1024


# Bounds within this factor of the largest compete: the row gives a range.
CLOSE = 0.8


@dataclass(frozen=True)
class KernelCase:
    """A kernel as its launcher launches it at one shape, and what it must move."""

    name: str
    shape: str
    launch: Launch
    trips: int  # hot-loop iterations per program
    elements_per_trip: int  # elements a program handles per trip (per program when there is no loop)
    bytes: int  # the fewest bytes the kernel must move
    target: Optional[float] = None  # the share of copy bandwidth aimed for


def resident_programs(gpu: GPU, registers: int, shared_bytes: int, warps: int) -> int:
    """Programs of ``warps`` warps one SM holds at once, given each thread's registers."""
    per_warp = -(-registers * 32 // gpu.register_granule) * gpu.register_granule
    return max(
        1,
        min(
            gpu.max_warps // warps,
            gpu.max_programs,
            gpu.registers // max(1, per_warp) // warps,
            gpu.shared_bytes // max(1, shared_bytes),
        ),
    )


def predict(gpu: GPU, programs: int, resident: int, program_pipes: dict, program_cycles: float, bytes: int) -> dict:
    """The three bounds of ``programs`` equal programs, ``resident`` per SM at once, each taking
    ``program_pipes`` clocks of each pipe and ``program_cycles`` from start to finish, moving
    ``bytes`` in all; which binds, and the range where others compete."""
    clock = gpu.clock_ghz * 1e9
    busiest_sm = -(-programs // min(gpu.sms, programs))  # programs the busiest SM runs
    slots = gpu.sms * resident
    waves = -(-programs // slots)
    busiest = max(program_pipes, key=program_pipes.get)
    bounds = {
        "issue": busiest_sm * program_pipes[busiest] / clock,
        "latency": waves * program_cycles / clock,
        "memory": bytes / (gpu.copy_tbs * 1e12),
    }
    bound, t = max(bounds.items(), key=lambda x: x[1])
    competing = sorted((name for name, time in bounds.items() if time >= CLOSE * t), key=bounds.get, reverse=True)
    upper = sum(bounds[name] for name in competing[:2])  # the two largest, not overlapping at all
    return {
        "busiest_pipe": busiest,
        "issue_us": bounds["issue"] * 1e6,
        "latency_us": bounds["latency"] * 1e6,
        "memory_us": bounds["memory"] * 1e6,
        "waves": waves,
        "last_wave": (programs - (waves - 1) * slots) / slots,  # the share of the slots the last wave fills
        "predicted_us": t * 1e6,
        "predicted_upper_us": upper * 1e6,
        "bound": bound if bound != "issue" else f"issue ({busiest})",
        "competing": competing if len(competing) > 1 else [],
        "copy_share": bounds["memory"] / t,
        "copy_share_low": bounds["memory"] / upper,
    }


def machine_code(launch: Launch) -> tuple:
    """Compile ``launch`` for sm_90: (its SASS instructions, its resources, its shared memory bytes)."""
    compiled = compile_launch(launch)
    instructions, res = disassemble(compiled.asm["cubin"])
    # Triton allocates its shared memory dynamically at launch; res-usage shows only the static part.
    return instructions, res, max(res.shared_bytes, compiled.metadata.shared)


def estimate(case: KernelCase, gpu: GPU, code: Optional[tuple] = None) -> dict:
    """Compile ``case`` (or take its ``machine_code``), read its SASS, and predict its time on
    ``gpu``: one table row."""
    launch = case.launch
    instructions, res, shared_bytes = code or machine_code(launch)
    loop = hot_loop(instructions)
    # Without a loop the whole body is what runs per program, once.
    first, last = loop if loop else (0, len(instructions) - 1)
    body, rest = instructions[first : last + 1], instructions[:first] + instructions[last + 1 :]
    hot, once = mix(body), mix(rest)
    trips = case.trips if loop else 1
    warps = launch.num_warps
    per_thread = case.elements_per_trip / (32 * warps)  # elements one thread handles per trip

    resident = resident_programs(gpu, res.registers, shared_bytes, warps)
    # What one program occupies: each pipe's clocks, and its replay (DRAM latency included).
    trip_pipes, once_pipes = pipe_cycles(body, warps), pipe_cycles(rest, warps)
    program_pipes = {name: once_pipes[name] + trips * trip_pipes[name] for name in trip_pipes}
    dram = gpu.latency_us * 1e-6 * gpu.clock_ghz * 1e9
    program_cycles = warp_cycles(program(instructions, loop, trips), dram)
    # A trip in steady state, from the whole program (its prologue issues a pipelined loop's first
    # loads): what each trip after the first adds.
    one_trip = warp_cycles(program(instructions, loop, 1), dram)
    trip_cycles = (program_cycles - one_trip) / (trips - 1) if loop and trips > 1 else program_cycles
    timing = predict(gpu, launch.programs, resident, program_pipes, program_cycles, case.bytes)
    return {
        "kernel": case.name,
        "shape": case.shape,
        "warps": warps,
        "programs": launch.programs,
        "registers": res.registers,
        "spill_bytes": res.local_bytes,
        "shared_bytes": shared_bytes,
        "resident": resident,
        "load_bits": hot.load_bits or once.load_bits,
        "store_bits": hot.store_bits or once.store_bits,
        "loop_instructions": hot.instructions if loop else None,
        "instructions_per_element": hot.instructions / per_thread,
        "loads_per_trip": global_loads(body),
        "barriers": hot.barriers,
        "shuffles": hot.shuffles,
        "mufu_per_element": hot.mufu / per_thread,
        "trip_cycles": trip_cycles,
        **timing,
        "target": case.target,
    }


def from_hidden_model(
    gpu: GPU,
    N: int,
    H: int,
    V: int,
    chunk: int,
    in_place: bool,
    half_grad: bool,
    recompute: bool,
    element_bytes: int = 2,
) -> dict:
    """Predicted time of the chunked ops from hidden states, forward and backward, against the
    three bare matmuls of the same shapes: every pass over memory the launcher makes, each bound
    by FLOPs or by bytes, and every small launch at ``gpu.launch_us``.

    Per chunk of n rows: the logits ``(n, V)`` fp32 come out of a matmul (twice with
    ``recompute``: ``token_logprobs_from_hidden`` rebuilds them in its backward; ``ppo_loss_from_hidden``
    knows its gradients in the forward and does not), the log-prob kernel reads them, its backward
    reads them again and writes their gradient (in half directly with ``half_grad``, else fp32 in
    place and then a cast to half), and two matmuls follow: ``grad_hidden = g @ W`` (fp32 out, then
    copied into the half gradient) and ``grad_weight (+)= g.T @ h`` (after the ignored rows of ``h``
    are zeroed, a pass over ``(n, H)``). With ``in_place`` the fp32 ``(V, H)`` accumulator is the
    weight gradient matmul's output: the first chunk writes it, the others read and write it.
    Without, it is zero-filled, and each chunk's product is written, then read with the
    accumulator and the sum written back. Once per call: the accumulator's cast to half, and
    autograd's scaling of that half gradient by the upstream gradient. Small launches per chunk:
    the log-probs' copy, the partial sums' zero-fill, the entropy weights, the hidden gradient's
    copy, the row zeroing (and, recomputing, the backward's own few).
    """
    flops, bw, e = gpu.matmul_tflops * 1e12, gpu.copy_tbs * 1e12, element_bytes

    def step(f, b):
        return max(f / flops, b / bw)

    total = 0.0
    for index, r0 in enumerate(range(0, N, chunk)):
        n = min(chunk, N - r0)
        logits = step(2 * n * H * V, n * H * e + V * H * e + 4 * n * V)
        kernels = step(0, 4 * n * V) + (step(0, (4 + e) * n * V) if half_grad else step(0, (8 + 4 + e) * n * V))
        grad_hidden = step(2 * n * H * V, n * V * e + V * H * e + 4 * n * H) + step(0, (4 + e) * n * H)
        if in_place:
            accumulate = 4 * V * H if index == 0 else 8 * V * H
        else:
            accumulate = 4 * V * H + 12 * V * H
        zero_rows = step(0, 2 * e * n * H)
        grad_weight = step(2 * n * H * V, n * V * e + n * H * e + accumulate)
        small = (5 + (3 if recompute else 0)) * gpu.launch_us * 1e-6
        total += (2 if recompute else 1) * logits + kernels + grad_hidden + zero_rows + grad_weight + small
    zero_fill = 0.0 if in_place else step(0, 4 * V * H)
    total += zero_fill + step(0, (4 + e) * V * H) + step(0, 2 * e * V * H)  # cast, then autograd's scale
    bare = 3 * step(2 * N * H * V, 0)
    return {
        "N": N,
        "H": H,
        "V": V,
        "chunk": chunk,
        "in_place": in_place,
        "half_grad": half_grad,
        "recompute": recompute,
        "predicted_ms": total * 1e3,
        "bare_ms": bare * 1e3,
        "ratio": total / bare,
    }


def predicted(r: dict) -> tuple:
    """(predicted us, bound, copy share) of a row as printed: a range where bounds compete."""
    if not r["competing"]:
        return f"{r['predicted_us']:.1f}", r["bound"], f"{r['copy_share']:.0%}"
    others = [name for name in r["competing"] if not r["bound"].startswith(name)]
    return (
        f"**{r['predicted_us']:.1f}-{r['predicted_upper_us']:.1f}**",
        f"**{r['bound']} ~ {', '.join(others)}**",
        f"**{r['copy_share_low']:.0%}-{r['copy_share']:.0%}**",
    )


def waves(r: dict) -> str:
    last = r["last_wave"]
    return str(r["waves"]) if last == 1 else f"{r['waves']} (last {f'{last:.0%}' if last >= 0.01 else '<1%'})"


def markdown(
    rows: list, plans: list, gpu: GPU, meta: dict, beside: Optional[dict] = None, decode_bytes: Optional[list] = None
) -> str:
    """The report; ``beside``: the JSON of the same report under another triton, compared per kernel;
    ``decode_bytes``: the keys and values a decode step reads by each way of attending
    (``kernel_cases.decode_step_bytes``)."""
    lines = [
        f"# fastppo kernels on {gpu.name}, predicted from sm_90 machine code (an estimate, not a measurement)",
        "",
        f"{meta['date']}, commit {meta['commit']}, triton {meta['triton']} compiling for sm_90 on a CPU.",
        "",
        f"{gpu.name}: {gpu.sms} SMs at {gpu.clock_ghz} GHz, {gpu.copy_tbs} TB/s copy, {gpu.matmul_tflops:.0f} "
        f"TFLOP/s bf16 matmul, {gpu.latency_us} us DRAM latency under load (assumed). Each kernel is compiled "
        "as its launcher launches it on real tensors (the runtime's specialization). Instructions are SASS per "
        "thread in the hot loop; loads are global load instructions per warp per trip; trip cycles = what each "
        "trip adds to one program in steady state; resident = programs an SM holds at once; waves = the "
        "resident slots filled in turn (the last one's share of them). Predicted = the largest of: issue (the "
        "busiest SM's programs, the busiest pipe at its rate), latency (one program's trips as ptxas scheduled "
        "them, DRAM latency included, times the waves) and memory (the bytes at copy bandwidth); copy share = "
        f"memory over predicted. **Bold**: another bound within {1 - CLOSE:.0%} of the largest; they compete, "
        "and the row is a range from the largest alone to the sum of the two largest.",
        "",
        "| kernel | shape | warps x programs | regs | resident | waves | ld/st bits | instr/elem | loads/trip | "
        "bar | shfl | trip cycles | issue us | latency us | memory us | predicted us | bound | copy share | target |",
        "| --- " * 19 + "|",
    ]
    for r in rows:
        bits = f"{','.join(map(str, r['load_bits']))}/{','.join(map(str, r['store_bits']))}"
        target = f"{r['target']:.0%}" if r["target"] else ""
        spills = f" (+{r['spill_bytes']} B spilled)" if r["spill_bytes"] else ""
        us, bound, share = predicted(r)
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['warps']} x {r['programs']} | {r['registers']}{spills} | "
            f"{r['resident']} | {waves(r)} | {bits} | {r['instructions_per_element']:.1f} | "
            f"{r['loads_per_trip']} | {r['barriers']} | {r['shuffles']} | {r['trip_cycles']:.0f} | "
            f"{r['issue_us']:.1f} | {r['latency_us']:.1f} | {r['memory_us']:.1f} | {us} | {bound} | {share} | "
            f"{target} |"
        )
    if beside:
        other = {(r["kernel"], r["shape"]): r for r in beside["kernels"]}
        mine, theirs = meta["triton"], beside["meta"]["triton"]
        lines += [
            "",
            f"## Side by side: triton {mine} and triton {theirs}",
            "",
            f"The same kernels, shapes and model compiled by triton {theirs} (commit {beside['meta']['commit']}).",
            "",
            f"| kernel | shape | {mine}: predicted us | bound | copy share | {theirs}: predicted us | bound | "
            "copy share |",
            "| --- " * 8 + "|",
        ]
        for r in rows:
            o = other.get((r["kernel"], r["shape"]))
            theirs_cells = " | ".join(predicted(o)) if o else "not in that report | | "
            lines.append(f"| {r['kernel']} | {r['shape']} | {' | '.join(predicted(r))} | {theirs_cells} |")
    if decode_bytes:
        lines += [
            "",
            "## Decode attention: keys and values read per decode step, all layers",
            "",
            "The kernel reads each row's live keys once; the cascade reads a group's shared prompt once for the "
            "group; the gather (CUDA without flash-attn, before the kernel) reads each row's blocks, writes them "
            f"into a new tensor and SDPA reads that again. Time at {gpu.copy_tbs} TB/s copy bandwidth.",
            "",
            "| workload | kernel GB | cascade GB | gather GB | cascade's prompt bytes / kernel's | kernel ms | "
            "cascade ms | gather ms |",
            "| --- " * 8 + "|",
        ]
        for d in decode_bytes:
            ms = {k: d[k] / (gpu.copy_tbs * 1e12) * 1e3 if d[k] else None for k in ("kernel", "cascade", "gather")}
            gb = {k: f"{d[k] / 1e9:.1f}" if d[k] else "" for k in ("kernel", "cascade", "gather")}
            share = f"{d['prompt_share']:.3g}" if d.get("prompt_share") else ""
            times = " | ".join(f"{ms[k]:.1f}" if ms[k] else "" for k in ("kernel", "cascade", "gather"))
            lines.append(f"| {d['workload']} | {gb['kernel']} | {gb['cascade']} | {gb['gather']} | {share} | {times} |")
    if plans:
        lines += [
            "",
            "## From hidden states: a FLOP/byte model of the chunk plan",
            "",
            "Each pass over memory takes max(FLOPs / matmul rate, bytes / copy bandwidth), and each small "
            f"launch {gpu.launch_us} us (assumed); bare = the three matmuls (logits, hidden and weight "
            "gradients) alone.",
            "",
            "| op | N x H x V | chunk rows | logit grad | weight grad | predicted ms | bare matmuls ms | ratio |",
            "| --- " * 8 + "|",
        ]
        for m in plans:
            op = "token_logprobs_from_hidden" if m["recompute"] else "ppo_loss_from_hidden"
            chunk = f"{m['chunk']} (the launcher's)" if m.get("default") else str(m["chunk"])
            grad = "half, by the kernel" if m["half_grad"] else "fp32, then cast"
            how = "in place (fp32 out)" if m["in_place"] else "+= per chunk"
            lines.append(
                f"| {op} | {m['N']} x {m['H']} x {m['V']} | {chunk} | {grad} | {how} | "
                f"{m['predicted_ms']:.1f} | {m['bare_ms']:.1f} | {m['ratio']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def with_overrides(gpu: GPU, **figures) -> GPU:
    return replace(gpu, **{k: v for k, v in figures.items() if v is not None})
