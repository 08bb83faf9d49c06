"""Compile every kernel variant the launchers can pick for Hopper (sm_90), with no GPU present.

Triton's NVIDIA backend and ptxas ship in the triton wheel, so the whole pipeline (Triton IR,
LLVM, PTX, cubin) runs on a CPU machine. That catches what the interpreter cannot: code the
compiler rejects, and loads that are not vectorised. Run as a script, without TRITON_INTERPRET
(under the interpreter the kernels are not compilable objects); prints one line per variant and
exits non-zero on the first failure. The variants include every one ``fastppo bench --sass``
reports, so that report then reads them from Triton's cache.
"""

import itertools
import os
import re
import sys

assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET"

from fastppo.bench import kernel_cases as signatures  # noqa: E402
from fastppo.bench.sass import compile_sm90  # noqa: E402
from fastppo.kernels import gae, logprobs, ppo_loss, sampling  # noqa: E402


def build(kernel, types: dict, constexprs: dict, num_warps: int, aligned=()):
    compiled = compile_sm90(kernel, types, constexprs, num_warps, aligned)
    print(f"ok  {kernel.__name__} {constexprs} warps={num_warps}")
    return compiled.asm["ptx"]


def logprob_kernels():
    for V, dtype, has_temp in itertools.product((1, 17, 1000, 151936), ("bf16", "fp32"), (False, True)):
        BLOCK_N, BLOCK_V, warps = logprobs._tiling(V, None)
        tiles = {"stride_v": 1, "HAS_TEMP": has_temp, "UNIT": 1, "BLOCK_N": BLOCK_N, "BLOCK_V": BLOCK_V}
        for has_stats in (False, True) if dtype == "fp32" else (False,):  # fp32 chunks from hidden states
            ptx = build(
                logprobs._logprobs_fwd_kernel,
                signatures.logprob_fwd_types(dtype),
                {**tiles, "HAS_STATS": has_stats},
                warps,
                aligned=signatures.LOGPROB_ALIGNED,
            )
            if V >= 1000:
                # 16-byte loads of the logits when rows are 16-element aligned (every real vocabulary)
                assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "forward logits loads are not vectorised"
        for has_g_ent in (False, True):
            build(
                logprobs._logprobs_bwd_kernel,
                signatures.logprob_bwd_types(dtype),
                {**tiles, "gstride_v": 1, "HAS_G_ENT": has_g_ent},
                warps,
                aligned=signatures.LOGPROB_BWD_ALIGNED,
            )


def gae_kernels():
    for (B, T), values, contiguous in itertools.product(
        ((512, 8192), (3, 5), (100, 37)), ("bf16", "fp32"), (False, True)
    ):
        BLOCK_B, BLOCK_T, warps = gae._tiling(B, T, None)
        unit_strides = {"srt": 1, "svt": 1, "smt": 1} if contiguous else {}
        ptx = build(
            gae._gae_kernel,
            signatures.gae_types(values),
            {**unit_strides, "BLOCK_B": BLOCK_B, "BLOCK_T": BLOCK_T},
            warps,
            aligned=signatures.GAE_ALIGNED if contiguous else (),
        )
        if contiguous and T >= 1024:
            # forward-ordered blocks of contiguous rows: 16-byte loads and stores
            assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "GAE loads are not vectorised"
            assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx), "GAE stores are not vectorised"


def ppo_loss_kernels():
    for ref, ent, dual, estimator in itertools.product((False, True), (False, True), (False, True), (1, 2, 3)):
        if not ref and estimator != 1:
            continue  # without a reference the estimator is never read
        build(
            ppo_loss._ppo_loss_fwd_kernel,
            signatures.PPO_LOSS_TYPES,
            {
                "HAS_REF": ref,
                "HAS_ENTROPY": ent,
                "DUAL_CLIP": dual,
                "KL_ESTIMATOR": estimator,
                "BLOCK": ppo_loss._BLOCK,
            },
            ppo_loss._WARPS,
        )


def sampling_kernels():
    for (B, V), dtype, greedy in itertools.product(
        ((64, 1), (64, 1000), (256, 151936), (1024, 151936)), ("bf16", "fp32"), (False, True)
    ):
        BLOCK_N, BLOCK_V, warps = sampling._sample_tiling(V, None)
        splits = sampling._splits(B, V, BLOCK_N, BLOCK_V)
        tiles = {"stride_v": 1, "GREEDY": greedy, "SPLITS": splits, "BLOCK_N": BLOCK_N, "BLOCK_V": BLOCK_V}
        ptx = build(
            sampling._sample_kernel, signatures.sample_types(dtype), tiles, warps, aligned=signatures.SAMPLE_ALIGNED
        )
        if V >= 1000:
            # pipelined into shared memory 16 bytes at a time (tl.range's stages), or loaded so
            assert re.search(r"cp\.async\.\w+\.shared\.global[^;]*, 0x10\b|ld\.global(\.\w+)*\.v4\.b32", ptx), (
                "sampling logits loads are not vectorised"
            )
        if splits > 1:
            types = {k: v for k, v in signatures.sample_types(dtype).items() if k not in ("seed", "V", "split_cols")}
            build(sampling._combine_kernel, types, {"stride_v": 1, "SPLITS": splits, "BLOCK_N": 32}, 1)


if __name__ == "__main__":
    logprob_kernels()
    gae_kernels()
    ppo_loss_kernels()
    sampling_kernels()
    sys.exit(0)
