"""``fastppo bench --sass``: the SASS reader on known code, the estimate's arithmetic, and the report end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastppo.bench import roofline, sass, schedule
from fastppo.ops.dispatch import TRITON_INSTALLED

# Shaped like cuobjdump -sass output: a prologue, a loop from 0x0020 to 0x0070, an epilogue.
SNIPPET = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                       /* 0x00000a0000017a02 */
        /*0010*/              @!P0 LDG.E.64 R2, desc[UR12][R2.64] ;             /* 0x0000000c02028981 */
        /*0020*/               @P0 LDG.E.128 R12, desc[UR12][R16.64] ;          /* 0x0000000c100c0981 */
        /*0030*/                   MUFU.EX2 R19, R41 ;                          /* 0x0000002900137308 */
        /*0040*/                   SHFL.BFLY PT, R13, R7, 0x10, 0x1f ;          /* 0x0e001f00070d7f89 */
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                /* 0x0000000000007b1d */
        /*0060*/                   NOP ;                                        /* 0x0000000000007918 */
        /*0070*/              @!P1 BRA 0x20 ;                                   /* 0xffffffe800e89947 */
        /*0080*/               @P0 STG.E.U16 desc[UR12][R2.64], R11 ;           /* 0x0000000b02000986 */
        /*0090*/                   BRA 0xa0 ;                                   /* 0x0000000b02000986 */
        /*00a0*/                   EXIT ;                                       /* 0x000000000000794d */
"""


def test_the_hot_loop_is_the_backward_branch_and_its_mix_is_counted():
    instructions = sass.parse(SNIPPET)
    assert [i.opcode for i in instructions[:3]] == ["MOV", "LDG.E.64", "LDG.E.128"]  # predicates stripped
    first, last = sass.hot_loop(instructions)
    assert (instructions[first].address, instructions[last].address) == (0x20, 0x70)  # a forward BRA is no loop
    loop = sass.mix(instructions[first : last + 1])
    assert (loop.instructions, loop.mufu, loop.shuffles, loop.barriers) == (5, 1, 1, 1)  # the NOP not counted
    assert loop.load_bits == (128,) and loop.store_bits == ()
    whole = sass.mix(instructions)
    assert whole.load_bits == (64, 128) and whole.store_bits == (16,)
    assert sass.hot_loop(sass.parse(SNIPPET.replace("BRA 0x20", "BRA 0x80"))) is None
    # A second loop after the main one (a row's edges, read apart) is not the hot loop, however
    # long; a loop inside the main one is part of it.
    two = SNIPPET.replace("BRA 0xa0", "BRA 0x80")  # 0x80-0x90: a loop after the first
    instructions = sass.parse(two)
    assert [(instructions[a].address, instructions[b].address) for a, b in [sass.hot_loop(instructions)]] == [
        (0x20, 0x70)
    ]
    nested = sass.parse(SNIPPET.replace("BRA 0x20", "BRA 0x40").replace("BRA 0xa0", "BRA 0x10"))
    first, last = sass.hot_loop(nested)
    assert (nested[first].address, nested[last].address) == (0x10, 0x90)


# cuobjdump prints each instruction's high 64-bit word on the line below it; its top 23 bits are
# the control bits. These are from a compiled log-prob kernel: an LDG that sets scoreboard 2, and a
# MUFU.RCP that waits on scoreboard 0, sets it again, and stalls 2 cycles.
CONTROLLED = """
        /*00e0*/              @!P0 LDG.E.64 R2, desc[UR14][R2.64] ;   /* 0x0000000e02028981 */
                                                                      /* 0x000ea2000c1e1b00 */
        /*0190*/                   MUFU.RCP R0, R0 ;                  /* 0x0000000000007308 */
                                                                      /* 0x001e240000001000 */
"""


def _ins(opcode, stall=1, sets=None, frees=None, waits=(), operands=""):
    return sass.Instruction(0, opcode, operands, stall=stall, sets=sets, frees=frees, waits=waits)


def test_control_bits_are_read_from_the_line_under_each_instruction():
    load, rcp = sass.parse(CONTROLLED)
    assert (load.opcode, load.stall, load.sets, load.frees, load.waits) == ("LDG.E.64", 1, 2, None, ())
    assert (rcp.opcode, rcp.stall, rcp.sets, rcp.waits) == ("MUFU.RCP", 2, 0, (0,))
    assert sass.parse(SNIPPET)[0].waits == ()  # no control line: nothing assumed


def test_a_warp_waits_for_its_loads_and_counts_stalls_barriers_and_pipelined_copies():
    dram = 1000
    # Two independent loads issued together, then a use of both: one latency, not two.
    together = [_ins("LDG.E.128", sets=0), _ins("LDG.E.128", sets=1), _ins("FADD", stall=4, waits=(0, 1))]
    assert schedule.warp_cycles(together, dram) == pytest.approx(1 + dram + 4)
    # A load whose address comes from another load: the latencies add up (ptxas serialised them).
    chained = [_ins("LDG.E", sets=0), _ins("LDG.E", sets=1, waits=(0,)), _ins("FADD", waits=(1,))]
    assert schedule.warp_cycles(chained, dram) == pytest.approx(2 * dram + 1)
    # Stall counts and a barrier add up when nothing is pending.
    assert schedule.warp_cycles([_ins("FFMA", stall=5), _ins("BAR.SYNC"), _ins("FFMA")], dram) == 5 + 21 + 1
    # Copies to shared memory in flight: DEPBAR.LE SB0, 1 waits for all groups but the latest.
    copies = [
        _ins("LDGSTS.E.BYPASS.128"),
        _ins("LDGDEPBAR", sets=0),
        _ins("LDGSTS.E.BYPASS.128"),
        _ins("LDGDEPBAR", sets=0),
        _ins("DEPBAR.LE", operands="SB0, 0x1"),
        _ins("FADD"),
    ]
    # The FADD issues when the first group lands (at dram), then the second lands at 2 + dram.
    assert schedule.warp_cycles(copies, dram) == pytest.approx(2 + dram)
    # Waiting for every group (SB0, 0x0), the FADD issues after the second lands.
    every = copies[:4] + [_ins("DEPBAR.LE", operands="SB0, 0x0"), _ins("FADD")]
    assert schedule.warp_cycles(every, dram) == pytest.approx(2 + dram + 2)
    # The loop replayed trip after trip, around its prologue and epilogue.
    code = [_ins("S2R"), _ins("LDG.E", sets=0), _ins("FADD", waits=(0,)), _ins("EXIT")]
    assert [i.opcode for i in schedule.program(code, (1, 2), 3)] == ["S2R"] + ["LDG.E", "FADD"] * 3 + ["EXIT"]


def test_each_instruction_occupies_its_pipe_at_the_pipes_rate():
    code = [_ins("FFMA"), _ins("FFMA"), _ins("IMAD.WIDE"), _ins("ISETP.GE.AND"), _ins("MUFU.EX2"), _ins("SHFL.BFLY")]
    code += [_ins("LDG.E.128"), _ins("ULDC.64"), _ins("NOP")]
    cycles = schedule.pipe_cycles(code, warps=4)
    assert cycles["dispatch"] == 4 * 8 / 4  # every instruction but the NOP
    # fp32 and IMAD share the two FMA pipes (4 per clock); IMAD alone has FMA-heavy's 2.
    assert cycles["fma"] == 4 * 3 / 4 and cycles["fmaheavy"] == 4 / 2 and cycles["alu"] == 4 / 2
    assert cycles["mufu"] == 4 / 0.5 and cycles["shfl"] == 4 / 1 and cycles["lsu"] == 4 / 1
    # All IMAD: FMA-heavy binds at half the fp32 rate. A half2 FMA takes both FMA pipes at once.
    assert schedule.pipe_cycles([_ins("IMAD")] * 8, warps=1)["fmaheavy"] == 4.0
    assert schedule.pipe_cycles([_ins("IMAD")] * 8, warps=1)["fma"] == 2.0
    assert schedule.pipe_cycles([_ins("HFMA2")] * 4, warps=1) == {
        **dict.fromkeys(schedule.PIPE_RATES, 0.0),
        "dispatch": 1.0,
        "fma": 2.0,
        "fmaheavy": 2.0,
    }


def test_equal_programs_refill_the_slots_in_whole_waves():
    gpu = roofline.GPU()
    pipes = {"dispatch": 1000.0, "alu": 4000.0}
    # Greedy sampling at [256, 151936]: 1024 programs in 132 x 5 = 660 slots are two waves, the
    # second 55% full, so the latency bound is two program times, not 1024 / 660 of one.
    row = roofline.predict(gpu, 1024, 5, pipes, program_cycles=24000.0, bytes=int(18e-6 * 4.3e12))
    assert row["waves"] == 2 and row["last_wave"] == pytest.approx(364 / 660)
    assert row["latency_us"] == pytest.approx(2 * 24000 / 1.98e3)
    # The busiest SM runs ceil(1024 / 132) = 8 programs: its pipes bound the issue time.
    assert row["issue_us"] == pytest.approx(8 * 4000 / 1.98e3) and row["busiest_pipe"] == "alu"
    # 330 rows of 4 splits fill exactly two waves: the same latency bound.
    assert roofline.predict(gpu, 1320, 5, pipes, 24000.0, 1)["latency_us"] == pytest.approx(row["latency_us"])


def test_bounds_within_20_percent_compete_and_give_a_range():
    gpu = roofline.GPU()
    clock = gpu.clock_ghz * 1e3  # cycles per us
    # latency 30 us, issue 27 us (within 20%), memory 10 us: a range from 30 to 57 us.
    row = roofline.predict(gpu, 132, 1, {"alu": 27 * clock}, 30 * clock, bytes=int(10e-6 * 4.3e12))
    assert row["bound"] == "latency" and row["competing"] == ["latency", "issue"]
    assert row["predicted_us"] == pytest.approx(30) and row["predicted_upper_us"] == pytest.approx(57)
    assert row["copy_share"] == pytest.approx(10 / 30) and row["copy_share_low"] == pytest.approx(10 / 57)
    us, bound, share = roofline.predicted(row)
    assert us == "**30.0-57.0**" and "latency ~ issue" in bound and share == "**18%-33%**"
    # issue at 23 us is more than 20% below: one bound, one figure.
    alone = roofline.predict(gpu, 132, 1, {"alu": 23 * clock}, 30 * clock, bytes=int(10e-6 * 4.3e12))
    assert alone["competing"] == [] and roofline.predicted(alone) == ("30.0", "latency", "33%")


def test_resident_programs_are_limited_by_warps_registers_and_shared_memory():
    gpu = roofline.GPU()
    assert roofline.resident_programs(gpu, registers=32, shared_bytes=0, warps=4) == 16  # 64 warps
    assert roofline.resident_programs(gpu, registers=32, shared_bytes=0, warps=1) == 32  # 32 programs
    # 90 registers round up to 96 per thread: 3072 per warp, 21 warps, 5 programs of 4 warps.
    assert roofline.resident_programs(gpu, registers=90, shared_bytes=0, warps=4) == 5
    assert roofline.resident_programs(gpu, registers=32, shared_bytes=100 * 1024, warps=4) == 2


def test_resources_are_read_from_res_usage():
    text = " Function _k:\n  REG:48 STACK:0 SHARED:1024 LOCAL:8 CONSTANT[0]:640 TEXTURE:0\n"
    assert sass.resources(text) == sass.Resources(registers=48, local_bytes=8, shared_bytes=1024)


def test_from_hidden_model_charges_what_each_plan_moves():
    gpu = roofline.GPU()
    N, H, V = 8192, 4096, 151936

    def ratio(chunk, in_place, half, recompute=False):
        return roofline.from_hidden_model(gpu, N, H, V, chunk, in_place, half, recompute)["ratio"]

    assert ratio(256, False, False) > ratio(256, True, False) > ratio(256, True, True) > ratio(1024, True, True) > 1
    # Rebuilding the logits in the backward is a fourth matmul: at least 4/3 of the bare three.
    assert ratio(1024, True, True, recompute=True) > 4 / 3
    bare = roofline.from_hidden_model(gpu, N, H, V, N, True, True, False)["bare_ms"]
    assert bare == pytest.approx(3 * 2 * N * H * V / 788e12 * 1e3)


@pytest.mark.slow
@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="compiles for sm_90 on a CPU machine")
def test_sass_report_runs_and_names_its_figures(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "sass.json"
    result = subprocess.run(
        [sys.executable, "-m", "fastppo", "bench", "--sass", "--gpu-copy-tbs", "4.0", "--json", str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "an estimate, not a measurement" in result.stdout
    report = json.loads(out.read_text())
    assert report["gpu"]["copy_tbs"] == 4.0 and report["gpu"]["name"] == "H200"
    names = {row["kernel"] for row in report["kernels"]}
    assert {"token_logprobs forward", "token_logprobs backward", "sample_tokens", "gae"} <= names
    for row in report["kernels"]:
        assert row["registers"] > 0 and row["instructions_per_element"] > 0 and row["resident"] >= 1, row
        assert 0 < row["copy_share"] <= 1 and row["bound"].split()[0] in ("issue", "latency", "memory"), row
        assert row["predicted_us"] == max(row["issue_us"], row["latency_us"], row["memory_us"]), row
    rows = {(r["kernel"], r["shape"]): r for r in report["kernels"]}
    backward = rows["token_logprobs backward", "bf16 [8192, 151936]"]
    assert backward["load_bits"] == [128] and 128 in backward["store_bits"]  # streamed 16 bytes at a time
    # Rows of 1000 bf16 logits are 16-byte aligned, and the launcher says so (strides in units of 8).
    small = rows["token_logprobs forward", "bf16 [65536, 1000]"]
    assert small["load_bits"] == [128] and small["loads_per_trip"] == 4
    # The PPO loss loads each of its 7 token tensors in a few vector loads, all issued up front.
    loss = next(r for r in report["kernels"] if r["kernel"].startswith("ppo_loss forward"))
    assert loss["loads_per_trip"] <= 13 and loss["shuffles"] > 0 and loss["barriers"] == 0
    # The sampling loop is pipelined: a trip is shorter than the DRAM latency it hides.
    greedy = rows["sample_tokens (greedy)", "bf16 [256, 151936], 4 splits"]
    assert greedy["trip_cycles"] < report["gpu"]["latency_us"] * report["gpu"]["clock_ghz"] * 1e3
    # ... yet its 1024 programs take two whole waves, and 330 rows' 1320 programs the same two.
    probe = rows["sample_tokens (greedy)", "bf16 [330, 151936], 4 splits"]
    assert greedy["waves"] == probe["waves"] == 2 and greedy["latency_us"] == probe["latency_us"]
    # GPT-2's odd vocabulary: rows between vectors, their bodies read 16 bytes at a time (drawn
    # rows excepted: kernels/sample_tokens.py says why).
    for name in ("token_logprobs forward", "token_logprobs backward", "sample_tokens (greedy)", "sample_tokens"):
        odd = next(r for r in report["kernels"] if r["kernel"] == name and "50257" in r["shape"])
        assert max(odd["load_bits"]) == (16 if name == "sample_tokens" else 128), odd
    assert any(r["kernel"] == "sample_tokens combine" for r in report["kernels"])
    assert any(m["default"] for m in report["from_hidden"])
    # Decode attention at Qwen2.5-7B's heads: 16-byte loads of the keys, at its 80% target; the cascade
    # reads a group of 8's prompt once (1/8 of the plain kernel's prompt bytes, the target 1/6).
    decode = next(r for r in report["kernels"] if r["kernel"] == "decode_attention")
    assert 128 in decode["load_bits"] and decode["copy_share"] >= decode["target"] == 0.8, decode
    assert {"decode_attention cascade: shared prefix", "decode_attention cascade: combine"} <= names
    shared = next(d for d in report["decode_bytes"] if d["cascade"])
    assert shared["prompt_share"] <= 1 / 6 and shared["cascade"] < shared["kernel"] < shared["gather"]


@pytest.mark.skipif(not TRITON_INSTALLED, reason="without triton --sass refuses before reading the figures")
def test_sass_refuses_a_gpu_figure_that_is_not_positive():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "fastppo", "bench", "--sass", "--gpu-sms", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 2 and "--gpu-sms must be positive" in result.stderr
    assert "Traceback" not in result.stderr


def test_sass_refuses_the_interpreter_in_one_line():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "fastppo", "bench", "--sass"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 2 and "unset TRITON_INTERPRET" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # every section in the interpreter: about a minute on 2 cores
@pytest.mark.skipif(not TRITON_INSTALLED, reason="the kernel check runs the Triton kernels")
@pytest.mark.skipif(torch.cuda.is_available(), reason="bench/gpu_check.sh runs it for real on a GPU")
def test_the_gpu_kernel_check_runs_every_section_in_the_interpreter(tmp_path):
    # bench/kernel_check.py settles the model above on a GPU; --dry runs its own code on CPU at toy
    # shapes, so a GPU's few minutes are not spent finding a typo.
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "bench/kernel_check.py", str(tmp_path), "--dry"],
        cwd=root,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "kernel_check.jsonl").read_text().splitlines()]
    # What settles the claims runs first: the calibration, the kernels against a copy, the oracles.
    order = list(dict.fromkeys(line["section"] for line in lines))
    assert order == ["budget", "calibrate", "bandwidth", "ppo_loss_vs_oracle", "gae_vs_oracle"] + [
        "logprobs_past_2_31", "misaligned", "peaked", "distribution", "occupancy", "from_hidden", "paged_decode"
    ]  # fmt: skip
    # Every section wrote its seconds and its allowance (how long it took on this machine is not the
    # GPU's, and not asserted), and the budget line says the allowances fit the whole.
    timed = [line for line in lines if line["name"] == "seconds"]
    assert len(timed) == len(order) - 1 and all(line["seconds"] >= 0 and line["allowed"] > 0 for line in timed)
    assert lines[0]["section"] == "budget" and lines[0]["ok"]
    checks = [line for line in lines if line["ok"] is not None]
    assert len(checks) >= 29 and all(line["ok"] for line in checks)
    assert not any(line["name"] == "raised" or line["name"].startswith("skipped") for line in lines)
    names = " ".join(line["name"] for line in lines)
    rows = ("sample_tokens combine", "4097]", "[10, 4096]", "NaN/inf/-inf", "[6, 1]", "chi-square", "paged cache")
    rows += ("decode_attention cascade: combine", "the kernel (cascade", "the kernel, paged: against float64")
    for row in rows:  # combine kernels, odd V, the wave probe, poisoned oracles, draws, paged attention
        assert row in names, row
    assert any("latency_us" in line for line in lines) and any("GBps" in line for line in lines)
    assert "| peaked |" in (tmp_path / "kernel_check.md").read_text()


@pytest.mark.skipif(not TRITON_INSTALLED, reason="the calibration runs a Triton kernel")
def test_the_pointer_chase_follows_one_cycle_through_every_node():
    from fastppo.bench import calibrate

    chain = calibrate.pointer_chain(1 << 16, 512, torch.device("cpu"))  # 8192 entries, a node every 512
    at, seen = 0, []
    for _ in range(16):
        seen.append(at)
        at = int(chain[at])
    assert at == 0 and sorted(seen) == list(range(0, 8192, 512))  # back at the start, every node once
    # The kernel walks the same chain, each load waiting for the one before.
    out = torch.empty(1, dtype=torch.int64)
    calibrate._chase_kernel[(1,)](chain, out, 0, 5, num_warps=1)
    assert int(out) == seen[5]
