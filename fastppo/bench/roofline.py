"""``fastppo bench --sass``: what each kernel's sm_90 machine code predicts on a GPU, without one.

Every kernel is compiled at a realistic shape with the tiling its launcher picks, and its SASS
is read (``sass.py``). From the instruction counts and the bytes the kernel must move, three
times bound it from below:

* **issue**: warp instructions / (4 per clock per SM x busy SMs x clock). An SM issues at most
  one instruction per scheduler (4) per clock; a kernel above its memory time here cannot reach
  the bandwidth, whatever the memory system does. In the hot loop this reads as *instructions
  per element* per thread: at 4.3 TB/s and 1.98 GHz on 132 SMs the budget for a 2-byte element
  is 32 x 4 x 132 x 1.98e9 / 2.15e12 = 15.6.
* **MUFU**: special-function lanes (exp2, log2, reciprocal) run at 16 per clock per SM.
* **memory**: bytes / bandwidth, where the bandwidth is the copy bandwidth unless too few bytes
  are in flight to cover the DRAM latency (Little's law: resident programs x bytes each loads per
  trip / latency); this is what a grid of a few hundred programs runs into.

The prediction is the largest of the three and the *share of copy* is the memory time at copy
bandwidth over it. It is an estimate from compiled code: it ignores stalls on dependent
instructions, the L2, the tail of a partial wave and clocks below boost, so a kernel predicted
at 100% is necessary-but-not-sufficient evidence. ``bench/gpu_check.sh`` measures the real thing.

The ops from hidden states and the LM head (log-probs and the PPO loss) are bound by their
matmuls, whose cost is cuBLAS's, not SASS of ours: they get a FLOP/byte model of the launcher's
chunk plan instead (``from_hidden_model``), against the three bare matmuls.
"""

from dataclasses import dataclass, field, replace
from typing import Optional

from .sass import compile_sm90, disassemble, hot_loop, mix


@dataclass(frozen=True)
class GPU:
    """The figures the estimate needs; defaults are an H200 SXM's."""

    name: str = "H200"
    sms: int = 132
    clock_ghz: float = 1.98  # boost clock
    copy_tbs: float = 4.3  # device-to-device copy, bytes read + written, as measured on an H200
    matmul_tflops: float = 788.0  # dense bf16, 8192^3 products of random data, as measured on an H200
    latency_us: float = 0.8  # DRAM latency under load, an assumption
    issue_per_clock: int = 4  # warp instructions per SM per clock
    mufu_per_clock: int = 16  # special-function lanes per SM per clock
    max_warps: int = 64  # resident per SM
    max_programs: int = 32
    registers: int = 65536  # per SM
    shared_bytes: int = 228 * 1024


@dataclass(frozen=True)
class KernelCase:
    """A kernel variant at one shape: what to compile, how it is launched, and what it must move."""

    name: str
    shape: str
    kernel: object
    types: dict
    constexprs: dict
    num_warps: int
    programs: int
    trips: int  # hot-loop iterations per program
    elements_per_trip: int  # elements a program handles per trip (per program when there is no loop)
    loaded_per_trip: int  # bytes a program loads per trip: what it has in flight
    bytes: int  # the fewest bytes the kernel must move
    target: Optional[float] = None  # the share of copy bandwidth aimed for
    aligned: tuple = field(default_factory=tuple)


def estimate(case: KernelCase, gpu: GPU) -> dict:
    """Compile ``case``, read its SASS, and predict its time on ``gpu``: one table row."""
    compiled = compile_sm90(case.kernel, case.types, case.constexprs, case.num_warps, case.aligned)
    instructions, res = disassemble(compiled.asm["cubin"])
    loop = hot_loop(instructions)
    # Without a loop the whole body is what runs per program, once.
    first, last = loop if loop else (0, len(instructions) - 1)
    hot, once = mix(instructions[first : last + 1]), mix(instructions[:first] + instructions[last + 1 :])
    trips = case.trips if loop else 1
    threads = 32 * case.num_warps
    per_thread = case.elements_per_trip / threads  # elements one thread handles per trip

    clock = gpu.clock_ghz * 1e9
    busy_sms = min(gpu.sms, case.programs)
    warp_instructions = case.programs * case.num_warps * (once.instructions + trips * hot.instructions)
    mufu_lanes = 32 * case.programs * case.num_warps * (once.mufu + trips * hot.mufu)
    t_issue = warp_instructions / (gpu.issue_per_clock * busy_sms * clock)
    t_mufu = mufu_lanes / (gpu.mufu_per_clock * busy_sms * clock)

    per_sm = min(
        gpu.max_warps // case.num_warps,
        gpu.max_programs,
        gpu.registers // max(1, res.registers * threads),
        gpu.shared_bytes // max(1, res.shared_bytes),
    )
    in_flight = min(case.programs, gpu.sms * per_sm) * case.loaded_per_trip
    bandwidth = min(gpu.copy_tbs * 1e12, in_flight / (gpu.latency_us * 1e-6))
    t_copy = case.bytes / (gpu.copy_tbs * 1e12)
    t_memory = case.bytes / bandwidth
    bound, t = max((("issue", t_issue), ("MUFU", t_mufu), ("memory", t_memory)), key=lambda x: x[1])
    return {
        "kernel": case.name,
        "shape": case.shape,
        "warps": case.num_warps,
        "programs": case.programs,
        "registers": res.registers,
        "spill_bytes": res.local_bytes,
        "shared_bytes": res.shared_bytes,
        "load_bits": hot.load_bits or once.load_bits,
        "store_bits": hot.store_bits or once.store_bits,
        "loop_instructions": hot.instructions if loop else None,
        "instructions_per_element": hot.instructions / per_thread,
        "barriers": hot.barriers,
        "shuffles": hot.shuffles,
        "mufu_per_element": hot.mufu / per_thread,
        "issue_us": t_issue * 1e6,
        "mufu_us": t_mufu * 1e6,
        "memory_us": t_memory * 1e6,
        "predicted_us": t * 1e6,
        "bound": bound,
        "copy_share": t_copy / t,
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
    three bare matmuls of the same shapes, each step bound by FLOPs or by bytes.

    Per chunk of n rows: the logits ``(n, V)`` fp32 come out of a matmul (twice with
    ``recompute``: ``token_logprobs_from_hidden`` rebuilds them in its backward; ``ppo_loss_from_hidden``
    knows its gradients in the forward and does not), the log-prob kernel reads them, its backward
    reads them again and writes their gradient (in half directly with ``half_grad``, else fp32 in
    place and then a cast to half), and two matmuls follow: ``grad_hidden = g @ W`` and
    ``grad_weight (+)= g.T @ h``. With ``in_place`` the fp32 ``(V, H)`` accumulator is the weight
    gradient matmul's output (read and written once per chunk); without, each chunk's product is
    written, then read with the accumulator and the sum written back.
    """
    flops, bw, e = gpu.matmul_tflops * 1e12, gpu.copy_tbs * 1e12, element_bytes

    def step(f, b):
        return max(f / flops, b / bw)

    total = 0.0
    for r0 in range(0, N, chunk):
        n = min(chunk, N - r0)
        logits = step(2 * n * H * V, n * H * e + V * H * e + 4 * n * V)
        kernels = step(0, 4 * n * V) + (step(0, (4 + e) * n * V) if half_grad else step(0, (8 + 4 + e) * n * V))
        grad_hidden = step(2 * n * H * V, n * V * e + V * H * e + 4 * n * H)
        accumulate = 8 * V * H if in_place else 4 * V * H + 12 * V * H
        grad_weight = step(2 * n * H * V, n * V * e + n * H * e + accumulate)
        total += (2 if recompute else 1) * logits + kernels + grad_hidden + grad_weight
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


def markdown(rows: list, plans: list, gpu: GPU, meta: dict) -> str:
    lines = [
        f"# fastppo kernels on {gpu.name}, predicted from sm_90 machine code (an estimate, not a measurement)",
        "",
        f"{meta['date']}, commit {meta['commit']}, triton {meta['triton']} compiling for sm_90 on a CPU.",
        "",
        f"{gpu.name}: {gpu.sms} SMs at {gpu.clock_ghz} GHz, {gpu.copy_tbs} TB/s copy, {gpu.matmul_tflops:.0f} "
        f"TFLOP/s bf16 matmul, {gpu.latency_us} us DRAM latency. Instructions are SASS per thread in the "
        "hot loop; loads/stores are the widths of the global accesses (bits). Predicted time = the largest "
        "of issue, MUFU and memory time; copy share = the time at copy bandwidth over it.",
        "",
        "| kernel | shape | warps x programs | regs | spills | smem | ld/st bits | instr/elem | bar | shfl | "
        "issue us | memory us | predicted us | bound | copy share | target |",
        "| --- " * 16 + "|",
    ]
    for r in rows:
        bits = f"{','.join(map(str, r['load_bits']))}/{','.join(map(str, r['store_bits']))}"
        target = f"{r['target']:.0%}" if r["target"] else ""
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['warps']} x {r['programs']} | {r['registers']} | "
            f"{r['spill_bytes']} | {r['shared_bytes']} | {bits} | {r['instructions_per_element']:.1f} | "
            f"{r['barriers']} | {r['shuffles']} | {r['issue_us']:.0f} | {r['memory_us']:.0f} | "
            f"{r['predicted_us']:.0f} | {r['bound']} | {r['copy_share']:.0%} | {target} |"
        )
    if plans:
        lines += [
            "",
            "## From hidden states: a FLOP/byte model of the chunk plan",
            "",
            "Each step of each chunk takes max(FLOPs / matmul rate, bytes / copy bandwidth); "
            "bare = the three matmuls (logits, hidden and weight gradients) alone.",
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
