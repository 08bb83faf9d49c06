"""Compile every kernel variant the launchers can pick for Hopper (sm_90), with no GPU present.

Triton's NVIDIA backend and ptxas ship in the triton wheel, so the whole pipeline (Triton IR,
LLVM, PTX, cubin) runs on a CPU machine. That catches what the interpreter cannot: code the
compiler rejects, and loads that are not vectorised. Run as a script, without TRITON_INTERPRET
(under the interpreter the kernels are not compilable objects); prints one line per variant and
exits non-zero on the first failure.
"""

import itertools
import os
import re
import sys

assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fastppo.kernels import gae, logprobs, ppo_loss, sampling  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
ALIGNED = [["tt.divisibility", 16]]  # what Triton infers for 16-aligned pointers and strides


def build(kernel, types: dict, constexprs: dict, num_warps: int, aligned=()):
    names = list(kernel.arg_names)
    signature = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    attrs = {(names.index(n),): ALIGNED for n in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=HOPPER, options={"num_warps": num_warps})
    print(f"ok  {kernel.__name__} {constexprs} warps={num_warps}")
    return compiled.asm["ptx"]


def logprob_kernels():
    rows = {"stride_b": "i64", "stride_t": "i64", "labels_ptr": "*i64", "temp_ptr": "*fp32",
            "inv_temp": "fp32", "N": "i32", "T": "i32", "V": "i32", "ignore_index": "i32",
            "lse_ptr": "*fp32", "ent_ptr": "*fp32"}
    for V, dtype, has_temp in itertools.product((1, 17, 1000, 151936), ("bf16", "fp32"), (False, True)):
        BLOCK_N, BLOCK_V, warps = logprobs._tiling(V, None)
        tiles = {"stride_v": 1, "HAS_TEMP": has_temp, "BLOCK_N": BLOCK_N, "BLOCK_V": BLOCK_V}
        for has_stats in (False, True) if dtype == "fp32" else (False,):  # the linear path's fp32 chunks
            types = {**rows, "logits_ptr": f"*{dtype}", "logp_ptr": "*fp32", "stats_ptr": "*fp32"}
            ptx = build(logprobs._logprobs_fwd_kernel, types, {**tiles, "HAS_STATS": has_stats}, warps,
                        aligned=("logits_ptr", "stride_b", "stride_t", "V"))
            if V >= 1000:
                # 16-byte loads of the logits when rows are 16-element aligned (every real vocabulary)
                assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "forward logits loads are not vectorised"
        for has_g_ent in (False, True):
            types = {**rows, "logits_ptr": f"*{dtype}", "grad_ptr": f"*{dtype}", "gstride_b": "i64",
                     "gstride_t": "i64", "g_lp_ptr": "*fp32", "g_ent_ptr": "*fp32"}
            build(logprobs._logprobs_bwd_kernel, types, {**tiles, "gstride_v": 1, "HAS_G_ENT": has_g_ent}, warps)


def gae_kernels():
    types = {"rewards_ptr": "*fp32", "srb": "i64", "srt": "i64", "values_ptr": "*bf16", "svb": "i64",
             "svt": "i64", "mask_ptr": "*i1", "smb": "i64", "smt": "i64", "adv_ptr": "*fp32",
             "ret_ptr": "*fp32", "B": "i32", "T": "i32", "gamma": "fp32", "gamma_lam": "fp32"}
    for B, T in ((512, 8192), (3, 5), (100, 37)):
        BLOCK_B, BLOCK_T = gae._tiling(B, T, None)
        build(gae._gae_kernel, types, {"BLOCK_B": BLOCK_B, "BLOCK_T": BLOCK_T}, 4)


def ppo_loss_kernels():
    types = {"logp_ptr": "*fp32", "old_ptr": "*fp32", "adv_ptr": "*bf16", "weight_ptr": "*fp32",
             "valid_ptr": "*i1", "ref_ptr": "*fp32", "ent_ptr": "*fp32", "grad_ptr": "*fp32",
             "partials_ptr": "*fp32", "N": "i32", "clip_low": "fp32", "clip_high": "fp32",
             "dual_clip": "fp32", "kl_coef": "fp32"}
    for ref, ent, dual, estimator in itertools.product((False, True), (False, True), (False, True), (1, 2, 3)):
        if not ref and estimator != 1:
            continue  # without a reference the estimator is never read
        build(ppo_loss._ppo_loss_fwd_kernel, types, {"HAS_REF": ref, "HAS_ENTROPY": ent, "DUAL_CLIP": dual,
                                                     "KL_ESTIMATOR": estimator, "BLOCK": 1024}, 4)


def sampling_kernels():
    types = {"stride_b": "i64", "tokens_ptr": "*i64", "logp_ptr": "*fp32", "inv_temp": "fp32", "seed": "i64",
             "B": "i32", "V": "i32"}
    for V, dtype, greedy in itertools.product((1, 1000, 151936), ("bf16", "fp32"), (False, True)):
        BLOCK_N, BLOCK_V, warps = sampling._sample_tiling(V, None)
        tiles = {"stride_v": 1, "GREEDY": greedy, "BLOCK_N": BLOCK_N, "BLOCK_V": BLOCK_V}
        ptx = build(sampling._sample_kernel, {**types, "logits_ptr": f"*{dtype}"}, tiles, warps,
                    aligned=("logits_ptr", "stride_b", "V"))
        if V >= 1000:
            assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "sampling logits loads are not vectorised"


if __name__ == "__main__":
    logprob_kernels()
    gae_kernels()
    ppo_loss_kernels()
    sampling_kernels()
    sys.exit(0)
