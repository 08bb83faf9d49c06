"""``fastppo bench --sass``: the SASS reader on known code, the estimate's arithmetic, and the report end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastppo.bench import roofline, sass
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


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="compiles for sm_90 on a CPU machine")
def test_sass_report_runs_and_names_its_figures(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parents[1]
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
        assert row["registers"] > 0 and row["instructions_per_element"] > 0, row
        assert 0 < row["copy_share"] <= 1 and row["bound"] in ("issue", "MUFU", "memory"), row
        assert row["predicted_us"] == max(row["issue_us"], row["mufu_us"], row["memory_us"]), row
    backward = next(r for r in report["kernels"] if r["kernel"] == "token_logprobs backward")
    assert backward["load_bits"] == [128] and 128 in backward["store_bits"]  # streamed 16 bytes at a time
    assert any(m["default"] for m in report["from_hidden"])


@pytest.mark.skipif(not TRITON_INSTALLED, reason="without triton --sass refuses before reading the figures")
def test_sass_refuses_a_gpu_figure_that_is_not_positive():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "fastppo", "bench", "--sass", "--gpu-sms", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
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
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 2 and "unset TRITON_INTERPRET" in result.stderr
    assert "Traceback" not in result.stderr
