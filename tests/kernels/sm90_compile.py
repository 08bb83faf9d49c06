"""Compile every kernel variant the launchers can pick for Hopper (sm_90), with no GPU present.

Triton's NVIDIA backend and ptxas ship in the triton wheel, so the whole pipeline (Triton IR,
LLVM, PTX, cubin) runs on a CPU machine. That catches what the interpreter cannot: code the
compiler rejects, and loads that are not vectorised. Each variant is what a launcher launches on
real tensors (recorded, not run: ``fastppo/bench/launches.py``), specialised as the runtime would
specialise it, so alignment, unit strides and constants are the ones a GPU run compiles with.
Run as a script, without TRITON_INTERPRET (under the interpreter the kernels are not compilable
objects); prints one line per variant and exits non-zero on the first failure.
"""

import itertools
import os
import re
import sys

assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET"

import torch  # noqa: E402

from fastppo.bench.launches import compile_launch, launches  # noqa: E402
from fastppo.kernels import decode_attention, gae, ppo_policy_loss, sample_tokens, token_logprobs  # noqa: E402
from fastppo.kernels.contract import PARTIALS, Cascade, LossTerms  # noqa: E402

# 16 bytes per access: a vector load or store of 4 32-bit words, or an asynchronous copy of 16 bytes.
WIDE_LOAD = r"ld\.global(\.\w+)*\.v4\.b32|cp\.async\.\w+\.shared\.global[^;]*, 0x10\b"
WIDE_STORE = r"st\.global(\.\w+)*\.v4\.b32"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(module, run) -> dict:
    """PTX of every kernel ``run()`` (a launcher call) launches in ``module``, compiled for sm_90."""
    ptx = {}
    for name, launch in launches(module, run).items():
        ptx[name] = compile_launch(launch).asm["ptx"]
        constants = {k: v for k, v in launch.kwargs.items() if k != "num_warps"}
        print(f"ok  {name} {constants} warps={launch.num_warps}")
    return ptx


def empty(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype)  # never touched: the launch is recorded, not run


def logprob_kernels():
    N = 64
    for V, dtype, has_temp in itertools.product((1, 17, 1000, 50257, 151936), DTYPES, (False, True)):
        if V == 50257 and has_temp:
            continue  # the temperature's switch is compiled at the other sizes; this one is the row shift
        logits, labels = empty(1, N, V, dtype=DTYPES[dtype]), torch.zeros(N, dtype=torch.long)
        temperature = torch.ones(N) if has_temp else None
        out = [empty(N) for _ in range(3)]
        for stats in (None, empty(N, 3)) if dtype == "fp32" else (None,):  # fp32 chunks from hidden states
            ptx = build(
                token_logprobs,
                lambda: token_logprobs.logprobs_forward(logits, labels, temperature, 1.0, -100, *out, stats),
            )
            if V >= 1000:
                # 16-byte loads of the logits: rows 16-byte aligned (V = 1000 in bf16 too), or for an
                # odd V (50257) each row's aligned body
                assert re.search(WIDE_LOAD, ptx["_logprobs_fwd_kernel"]), "forward logits loads are not vectorised"
        for g_ent in (None, torch.ones(N)):
            ptx = build(
                token_logprobs,
                lambda g_ent=g_ent: token_logprobs.logprobs_backward(
                    logits, logits, labels, temperature, 1.0, -100, out[2], out[1], torch.ones(N), g_ent
                ),
            )["_logprobs_bwd_kernel"]
            if V >= 1000:  # in place: the gradient is written in vectors too
                assert re.search(WIDE_LOAD, ptx), "backward logits loads are not vectorised"
                assert re.search(WIDE_STORE, ptx), "backward gradient stores are not vectorised"
        if dtype == "fp32" and V >= 1000 and not has_temp:  # fp32 chunks, a bf16 gradient: from hidden states on CUDA
            half = empty(1, N, V, dtype=torch.bfloat16)
            ptx = build(
                token_logprobs,
                lambda: token_logprobs.logprobs_backward(
                    logits, half, labels, temperature, 1.0, -100, out[2], out[1], torch.ones(N), None
                ),
            )["_logprobs_bwd_kernel"]
            assert re.search(WIDE_STORE, ptx), "half gradient stores are not vectorised"


def gae_kernels():
    for (B, T), values, contiguous in itertools.product(((512, 8192), (3, 5), (100, 37)), DTYPES, (False, True)):
        # Not contiguous: time-major storage, so each row is read with a stride of B.
        rewards = empty(B, T) if contiguous else empty(T, B).t()
        value = empty(B, T, dtype=DTYPES[values]) if contiguous else empty(T, B, dtype=DTYPES[values]).t()
        mask = torch.ones(B, T, dtype=torch.bool)
        ptx = build(gae, lambda: gae.gae(rewards, value, mask, 1.0, 0.95, empty(B, T), empty(B, T)))["_gae_kernel"]
        if contiguous and T >= 1024:
            # forward-ordered blocks of contiguous rows: 16-byte loads and stores
            assert re.search(WIDE_LOAD, ptx), "GAE loads are not vectorised"
            assert re.search(WIDE_STORE, ptx), "GAE stores are not vectorised"


def ppo_loss_kernels():
    N = 4096
    tokens = [empty(N) for _ in range(4)]  # logp, old, advantages, weights
    valid, grad = torch.ones(N, dtype=torch.bool), empty(N)
    partials = empty(ppo_policy_loss.num_programs(N), len(PARTIALS))
    for ref, ent, dual, estimator in itertools.product((False, True), (False, True), (False, True), (1, 2, 3)):
        if not ref and estimator != 1:
            continue  # without a reference the estimator is never read
        ref_logp, entropy = (empty(N) if ref else None), (empty(N) if ent else None)
        terms = LossTerms(0.2, 0.28, 3.0 if dual else 0.0, 0.01, estimator, 0.01)
        args = (*tokens, valid, ref_logp, entropy, terms, grad, partials)
        ptx = build(ppo_policy_loss, lambda args=args: ppo_policy_loss.ppo_loss_forward(*args))["_ppo_loss_fwd_kernel"]
        # masked by the bounds alone, the token loads are vector loads
        assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "PPO loss loads are not vectorised"


def sampling_kernels():
    for (B, V), dtype, greedy in itertools.product(
        ((64, 1), (64, 1000), (64, 50257), (256, 151936), (1024, 151936)), DTYPES, (False, True)
    ):
        logits = empty(B, V, dtype=DTYPES[dtype])
        tokens, logp = torch.empty(B, dtype=torch.long), empty(B)
        ptx = build(sample_tokens, lambda: sample_tokens.sample_forward(logits, 1.0, greedy, 7, tokens, logp))
        # Rows 16-byte aligned, or greedy rows of an odd V by their bodies (drawn ones are read as they lie:
        # kernels/sample_tokens.py says why).
        if V >= 1000 and (V % 8 == 0 or greedy):
            assert re.search(WIDE_LOAD, ptx["_sample_kernel"]), "sampling logits loads are not vectorised"


def decode_attention_kernels():
    """Qwen2.5-7B's heads (7 query heads to a KV head, 128 wide) in bf16 and fp32, every variant:
    paged in one split (the row finished in place), a window and sinks over splits and a combine,
    a static cache (head-major, as the sampler keeps it), the cascade, queries naming their rows,
    a soft cap (Gemma 2's) over splits;
    and the other head sizes of the lean families with GQA ratios 1 and 4, paged in one split, in
    bf16."""
    B, page, blocks = 64, 16, 256
    lengths = torch.zeros(B, dtype=torch.long)
    shapes = [(128, 7, 4, "bf16", True), (128, 7, 4, "fp32", True), (64, 1, 12, "bf16", False)]
    shapes += [(80, 4, 8, "bf16", False), (96, 7, 4, "bf16", False)]
    for D, G, KVH, dtype, every_variant in shapes:
        q, out = empty(B, KVH * G, D, dtype=DTYPES[dtype]), empty(B, KVH * G, D, dtype=DTYPES[dtype])
        pool = [empty(blocks * 64, page, KVH, D, dtype=DTYPES[dtype]) for _ in range(2)]
        table = torch.zeros(B, blocks, dtype=torch.int32)
        static = [empty(B, KVH, 4096, D, dtype=DTYPES[dtype]).transpose(1, 2) for _ in range(2)]
        cascade = Cascade(torch.zeros(B // 8, 8, dtype=torch.int32), torch.zeros(B // 8, dtype=torch.int32),
                          torch.zeros(B, dtype=torch.int32), 2048)  # fmt: skip
        variants = [(pool, table, None, None, None, None, None, 1)]
        if every_variant:
            variants += [
                (pool, table, None, 128, None, empty(KVH * G), None, 4),
                (static, None, None, None, None, None, None, 2),
                (pool, table, None, None, None, None, cascade, 1),
                (pool, table, torch.zeros(B, dtype=torch.long), None, None, None, None, 1),  # queries naming rows
                (pool, table, None, 4096, 50.0, None, None, 4),
            ]
        for (k, v), tab, rows, window, softcap, sinks, casc, splits in variants:
            ptx = build(
                decode_attention,
                lambda: decode_attention.decode_attention(
                    q, k, v, tab, rows, lengths, 4096, 0.1, window, softcap, sinks, casc, out, splits=splits
                ),
            )
            if D % 64 == 0:  # a head's keys of a position in whole 16-byte vectors
                assert re.search(WIDE_LOAD, ptx["_decode_kernel"]), "decode attention's key loads are not vectorised"


if __name__ == "__main__":
    decode_attention_kernels()
    logprob_kernels()
    gae_kernels()
    ppo_loss_kernels()
    sampling_kernels()
    sys.exit(0)
