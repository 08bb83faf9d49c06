"""The compiled kernels on a real GPU: bandwidth against a copy next to the model, then float64 oracles.

Run by ``bench/gpu_check.sh`` as ``python bench/kernel_check.py OUT_DIR``. A lent GPU may be taken
back at any minute, so the sections run in the order of what they settle, each written out as it
finishes (OUT_DIR/kernel_check.jsonl, one JSON line per check, and OUT_DIR/kernel_check.md):

1. ``calibrate``: the copy bandwidth and a pointer-chase DRAM latency, the two figures the
   roofline model (``fastppo bench --sass``) assumes; the command that re-runs it with them.
2. ``bandwidth``: each kernel at the ``--sass`` shapes (odd vocabulary, combine kernel and the
   wave probe included) as a share of the copy, timed over fresh buffers launched back to back
   (more than twice the L2, ``calibrate.rotating_ms``), next to the share the model predicts from
   this machine's compiler with the measured bandwidth, at the assumed and the measured latency.
3. The float64 oracles at full size: ``ppo_loss_vs_oracle`` (4,194,304 + 77 tokens, NaN and
   infinities at masked positions, whose gradient must be exactly 0), ``gae_vs_oracle``
   (T = 8,191 and T = 1, the same poison), ``logprobs_past_2_31`` (bf16 ``[65536, 151936]``, rows
   across the 2**31-element boundary), ``misaligned`` (logits 2 bytes past aligned, padded rows,
   odd vocabularies), ``peaked`` (a +40 peak must always be drawn).
4. ``distribution``: a chi-square of many draws of a known row against its softmax, for an
   aligned and an odd vocabulary (the shifted rows' uniforms).
5. ``occupancy``: greedy sampling forced to 1 to 16 splits (one to several waves of programs),
   measured against predicted: how far the model's waves and latency hold.
6. ``from_hidden``: ``ppo_loss_from_hidden`` against its three bare matmuls and the FLOP/byte model.
7. ``paged_decode``: the sampler's decode attention over the paged KV cache (a group's prompt
   blocks shared) against the static one holding the same keys: SDPA, fastppo's kernel (the cascade
   over the paged cache) and (where flash-attn is installed) flash-attn: equal outputs, the kernel
   against float64, and the time of each with its share of a copy of the keys and values it reads.

Every section declares the seconds it may take on the GPU; one that would not fit in what is left
of ``--budget-s`` is skipped and says so, and one that raises is recorded and the next one runs.
``--dry`` runs every section on CPU in the Triton interpreter at toy shapes (how the test suite
checks this script), and there each section must also finish within ``DRY_SECONDS``.
"""

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.oracles

import torch  # noqa: E402

import fastppo  # noqa: E402
from fastppo.bench.calibrate import dram_latency_us, rotating_ms  # noqa: E402
from fastppo.bench.measure import copy_bandwidth_gbps, time_call  # noqa: E402
from fastppo.kernels import sample_tokens, token_logprobs  # noqa: E402
from tests.oracles import (  # noqa: E402
    chi2_critical,
    gae_oracle,
    logprobs_grad_oracle,
    logprobs_oracle,
    ppo_loss_oracle,
    relative_error,
)

DEFAULT_BUDGET_S = 240.0  # what bench/gpu_check.sh gives the whole check
DRY_SECONDS = 90.0  # what one section may take in the interpreter at toy shapes


class Check:
    """The run's state: device, sizes, the measured figures, the output files, the deadline."""

    def __init__(self, out: Path, dry: bool, budget_s: float):
        self.out, self.dry = out, dry
        self.device = torch.device("cpu" if dry else "cuda")
        self.deadline = time.time() + budget_s
        self.lines = []
        self.copy_gbps = self.latency_us = None
        props = None if dry else torch.cuda.get_device_properties(self.device)
        # In the interpreter one copy of each buffer: rotating copies past an L2 is for the GPU.
        self.l2_bytes = 0 if dry else getattr(props, "L2_cache_size", 0) or 50 << 20
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "kernel_check.jsonl", "a")

    def size(self, full, toy):
        return toy if self.dry else full

    def record(self, section: str, name: str, ok=None, **fields):
        line = {"section": section, "name": name, "ok": ok, **fields}
        self.lines.append(line)
        text = json.dumps(line, default=float)
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def ms(self, call) -> float:
        """Median milliseconds: do_bench on CUDA (the L2 flushed before each run), wall-clock on CPU."""
        return time_call(call, self.device, quick=self.dry).median_ms

    def copy(self) -> float:
        """GB/s of a device copy (read + written), measured once."""
        if self.copy_gbps is None:
            self.copy_gbps = copy_bandwidth_gbps(self.device, quick=self.dry)
        return self.copy_gbps

    def timed(self, case) -> dict:
        """``case`` launched over fresh buffers past the L2: microseconds, and its share of a copy."""
        ms = rotating_ms(case.launch, case.bytes, l2_bytes=self.l2_bytes, rounds=3 if self.dry else 7)
        return {"us": round(ms * 1e3, 1), "share": round(case.bytes / ms / 1e6 / self.copy(), 3)}

    def gpu(self, measured_latency: bool = False):
        """The model's GPU with this machine's copy bandwidth (and DRAM latency, when asked)."""
        from fastppo.bench.roofline import GPU

        latency = self.latency_us if measured_latency and self.latency_us else GPU().latency_us
        return GPU(copy_tbs=self.copy() / 1e3, latency_us=latency)

    def predicted(self, case) -> dict:
        """The model's copy share for ``case`` on this machine, at the assumed and the measured
        latency (a range where its bounds compete); nothing in the interpreter, which cannot
        compile for sm_90."""
        if self.dry:
            return {}
        from fastppo.bench.roofline import estimate, machine_code

        code, figures = machine_code(case.launch), {}
        for key, measured in (("predicted", False), ("predicted_at_measured_latency", True)):
            row = estimate(case, self.gpu(measured), code)
            low, high = row["copy_share_low"], row["copy_share"]
            figures[key] = round(high, 3) if low == high else f"{low:.2f}-{high:.2f}"
        figures["waves"] = row["waves"]
        return figures

    def bf16(self, *shape, scale=3.0):
        x = torch.randn(shape, device=self.device, dtype=torch.bfloat16)
        return x.mul_(scale)

    def f32(self, n):
        return torch.empty(n, device=self.device, dtype=torch.float32)


def calibrate(c: Check):
    c.record("calibrate", "torch copy (read + written)", GBps=round(c.copy()))
    buffer = c.size(1 << 30, 1 << 16)
    c.latency_us = dram_latency_us(c.device, buffer_bytes=buffer, hops=c.size(20000, 50))
    c.record(
        "calibrate",
        f"pointer chase over {buffer / 2**20:g} MB, 4 KB apart: one dependent load (unloaded; the model assumes "
        "0.8 us under load)",
        latency_us=round(c.latency_us, 3),
    )
    c.record(
        "calibrate",
        f"the model with these figures: fastppo bench --sass --gpu-copy-tbs {c.copy() / 1e3:.2f} "
        f"--gpu-latency-us {c.latency_us:.2f}",
    )


def bandwidth(c: Check):
    """Each kernel as ``fastppo bench --sass`` compiles it (the same recorded launch, its tensors on
    the GPU), as a share of the copy bandwidth, beside the share the model predicts."""
    from fastppo.bench.kernel_cases import all_cases

    for case in all_cases(c.device, toy=c.dry):
        c.record("bandwidth", f"{case.name} {case.shape}", **c.timed(case), **c.predicted(case))


def poison(x, invalid):
    """``x`` with NaN, inf and -inf in turn at the ``invalid`` positions."""
    values = torch.tensor([float("nan"), float("inf"), float("-inf")], device=x.device, dtype=x.dtype)
    where = invalid.nonzero(as_tuple=True)
    x = x.clone()
    x[where] = values[torch.arange(where[0].numel(), device=x.device) % 3]
    return x


def ppo_loss_vs_oracle(c: Check):
    N = c.size(512 * 8192 + 77, 4096 + 77)
    mask = torch.rand(N, device=c.device) > 0.1
    clean_logp = -torch.rand(N, device=c.device) * 5
    old = poison(clean_logp + 0.2 * torch.randn(N, device=c.device), ~mask)
    ref = poison(clean_logp + 0.2 * torch.randn(N, device=c.device), ~mask)
    advantages = poison(torch.randn(N, device=c.device), ~mask)
    entropy = poison(torch.rand(N, device=c.device) * 3, ~mask)
    logp = poison(clean_logp, ~mask).requires_grad_()
    options = dict(dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01)
    loss, _ = fastppo.ppo_policy_loss(
        logp, old, advantages, mask, ref_logprobs=ref, entropy=entropy, backend="triton", **options
    )
    (grad,) = torch.autograd.grad(loss, logp)
    logp64 = logp.detach().double().requires_grad_()
    expected, _ = ppo_loss_oracle(logp64, old, advantages, mask, ref=ref, entropy=entropy, **options)
    (expected_grad,) = torch.autograd.grad(expected, logp64)
    error = abs(loss.item() - expected.item()) / abs(expected.item())
    grad_error = relative_error(grad, expected_grad)
    masked_grad = grad[~mask].abs().max().item()  # exactly 0 whatever sits there
    c.record(
        "ppo_loss_vs_oracle",
        f"loss and gradient, {N} tokens, NaN/inf/-inf at the masked ones",
        ok=error < 1e-5 and grad_error < 1e-5 and masked_grad == 0,
        error=error,
        grad_error=grad_error,
        masked_grad=masked_grad,
    )


def gae_vs_oracle(c: Check):
    B = c.size(512, 6)
    for T in (c.size(8191, 301), 1):
        mask = torch.rand(B, T, device=c.device) > 0.2
        rewards = poison(torch.randn(B, T, device=c.device), ~mask)
        values = poison(torch.randn(B, T, device=c.device), ~mask)
        advantages, returns = fastppo.gae(rewards, values, mask, gamma=0.99, lam=0.95, backend="triton")
        rows = torch.tensor([0, 1, B // 2, B - 1], device=c.device)
        ref_adv, ref_ret = gae_oracle(rewards[rows].double(), values[rows].double(), mask[rows], 0.99, 0.95)
        error = max(relative_error(advantages[rows], ref_adv), relative_error(returns[rows], ref_ret))
        finite = bool(torch.isfinite(advantages).all() and torch.isfinite(returns).all())
        c.record(
            "gae_vs_oracle",
            f"[{B}, {T}], NaN/inf/-inf where masked, 4 rows against the float64 loop",
            ok=error < 1e-5 and finite,
            error=error,
        )


def logprobs_past_2_31(c: Check):
    N, V = c.size(65536, 24), c.size(151936, 1000)
    x = c.bf16(1, N, V)
    labels = torch.randint(0, V, (N,), device=c.device)
    labels[::97] = -100
    boundary = c.size(2**31 // V, N // 2)  # the row holding element 2**31
    rows = torch.tensor(sorted({*range(4), *range(boundary - 2, boundary + 3), *range(N - 4, N)}), device=c.device)
    kept = x[0, rows].clone()
    logp, entropy, lse = c.f32(N), c.f32(N), c.f32(N)
    token_logprobs.logprobs_forward(x, labels, None, 1.0, -100, logp, entropy, lse)
    ref_logp, ref_entropy = logprobs_oracle(kept, labels[rows])
    error = max((logp[rows] - ref_logp).abs().max().item(), (entropy[rows] - ref_entropy).abs().max().item())
    c.record(
        "logprobs_past_2_31", f"forward bf16 [{N}, {V}], rows {rows.tolist()[:3]}...", ok=error < 1e-4, error=error
    )
    g_lp, g_ent = torch.randn(N, device=c.device), torch.randn(N, device=c.device)
    # in place, as from hidden
    token_logprobs.logprobs_backward(x, x, labels, None, 1.0, -100, lse, entropy, g_lp, g_ent)
    expected = logprobs_grad_oracle(kept, labels[rows], g_lp[rows], g_ent[rows])
    error = relative_error(x[0, rows], expected)
    c.record("logprobs_past_2_31", "backward in place, relative error", ok=error < 1e-2, error=error)


def misaligned(c: Check):
    N = c.size(2048, 12)
    for V, pad, offset in ((50257, 0, 1), (50257, 0, 0), (1000, 0, 0), (1000, 4, 1), (151936, 8, 1)):
        V = c.size(V, min(V, 1003))
        storage = c.bf16(N * (V + pad) + offset)
        x = storage[offset:].view(N, V + pad)[:, :V]  # rows V + pad apart, starting `offset` elements in
        labels = torch.randint(0, V, (N,), device=c.device)
        logp, entropy, lse = c.f32(N), c.f32(N), c.f32(N)
        token_logprobs.logprobs_forward(x.unsqueeze(0), labels, None, 1.0, -100, logp, entropy, lse)
        ref_logp, ref_entropy = logprobs_oracle(x, labels)
        error = max((logp - ref_logp).abs().max().item(), (entropy - ref_entropy).abs().max().item())
        name = f"V={V}, rows {V + pad} apart, {2 * offset} bytes past aligned"
        c.record("misaligned", f"forward, {name}", ok=error < 1e-4, error=error)
        g_lp = torch.randn(N, device=c.device)
        expected = logprobs_grad_oracle(x, labels, g_lp, torch.zeros_like(g_lp))
        padded = torch.zeros(N, V + pad + 8, device=c.device, dtype=x.dtype)[:, :V]
        # Into rows laid out otherwise, then in place (a shifted row's body then stored in vectors).
        for grad, into in ((padded, f"into rows {V + pad + 8} apart"), (x, "in place")):
            token_logprobs.logprobs_backward(
                x.unsqueeze(0), grad.unsqueeze(0), labels, None, 1.0, -100, lse, entropy, g_lp, None
            )
            error = relative_error(grad, expected)
            c.record("misaligned", f"backward {into}, {name}", ok=error < 1e-2, error=error)
        # Greedy draws from the rows (holding their gradient now: any values do).
        tokens, token_logp = torch.empty(N, dtype=torch.long, device=c.device), c.f32(N)
        sample_tokens.sample_forward(x, 1.0, True, 0, tokens, token_logp)
        best = x.float().max(dim=1, keepdim=True).values
        ties_ok = (x.gather(1, tokens[:, None]).float() == best).all().item()
        c.record("misaligned", f"greedy draw is a row's max, {name}", ok=bool(ties_ok))


def peaked(c: Check):
    B, V = c.size(65536, 16), c.size(151936, 1000)
    x = torch.zeros(B, V, device=c.device, dtype=torch.bfloat16)
    peak = (torch.arange(B, device=c.device) * 7919) % V
    x[torch.arange(B, device=c.device), peak] = 40.0
    tokens, token_logp = torch.empty(B, dtype=torch.long, device=c.device), c.f32(B)
    off_peak, worst = 0, 0.0
    for seed in range(4):
        sample_tokens.sample_forward(x, 1.0, False, 1234 + seed, tokens, token_logp)
        off_peak += int((tokens != peak).sum())
        worst = min(worst, token_logp.min().item())
    c.record(
        "peaked",
        f"draws off a +40 peak in 4 x {B} rows of {V} (exact: ~6e-13 per row)",
        ok=off_peak == 0 and -1e-6 < worst <= 0,
        off_peak=off_peak,
        lowest_logprob=worst,
    )


def distribution(c: Check):
    """Draws of one known row, repeated: the counts of K marked columns and of the rest against
    the softmax of the row at temperature 0.8, by chi-square (a draw per row per seed)."""
    B, K, seeds, T = c.size(4096, 128), c.size(32, 8), c.size(16, 8), 0.8
    for V in (c.size(151936, 1024), c.size(50257, 1003)):
        marked = torch.linspace(0, V - 1, K, device=c.device).long()  # the first and last column among them
        row = torch.full((V,), -2.0, device=c.device)
        row[marked] = torch.linspace(3.0, 6.0, K, device=c.device)
        row = row.bfloat16()
        x = row.expand(B, V).contiguous()  # rows of an odd V start between vectors: the shifted path
        p = torch.softmax(row.double() / T, dim=0)
        expected = torch.cat([p[marked], (1 - p[marked].sum()).reshape(1)]) * B * seeds
        bucket = torch.full((V,), K, device=c.device, dtype=torch.long)
        bucket[marked] = torch.arange(K, device=c.device)
        counts = torch.zeros(K + 1, device=c.device, dtype=torch.float64)
        tokens, token_logp = torch.empty(B, dtype=torch.long, device=c.device), c.f32(B)
        for seed in range(seeds):
            sample_tokens.sample_forward(x, 1 / T, False, 99 + seed, tokens, token_logp)
            counts += torch.bincount(bucket[tokens], minlength=K + 1).double()
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        c.record(
            "distribution",
            f"{B * seeds} draws of a bf16 row of {V}: {K} marked columns and the rest, chi-square with {K} df",
            ok=chi2 < chi2_critical(K) and expected.min().item() >= 5,  # a valid test, and passed
            chi2=round(chi2, 1),
            critical=round(chi2_critical(K), 1),
            smallest_expected=round(expected.min().item(), 1),
        )


def occupancy(c: Check):
    """Greedy sampling of 256 rows, its vocabulary split in 1 to 16: from one partial wave of
    programs to several, the measured time beside the model's."""
    from fastppo.bench.kernel_cases import sample_cases

    B, V = c.size(256, 8), c.size(151936, 4096)
    for splits in (1, 2, 4, 8, 16) if not c.dry else (1, 2):
        (case,) = sample_cases(B, V, c.device, greedy_only=True, splits=splits)
        name = f"greedy [{B}, {V}], {splits} splits: {case.launch.programs} programs"
        c.record("occupancy", name, **c.timed(case), **c.predicted(case))


def from_hidden(c: Check):
    from fastppo.bench.kernel_cases import from_hidden_plans

    N, H, V = c.size(8192, 64), c.size(4096, 32), c.size(151936, 1000)
    hidden = torch.randn(N, H, device=c.device, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, device=c.device, dtype=torch.bfloat16) * H**-0.5).requires_grad_()
    labels = torch.randint(0, V, (N,), device=c.device)
    old, advantages = -torch.rand(N, device=c.device) * 5, torch.randn(N, device=c.device)
    mask = torch.ones(N, dtype=torch.bool, device=c.device)

    def fused():
        hidden.grad = weight.grad = None
        loss, _ = fastppo.ppo_loss_from_hidden(hidden, weight, labels, old, advantages, mask, entropy_coef=0.01)
        loss.backward()

    g = torch.randn(N, V, device=c.device, dtype=torch.bfloat16)
    h, w = hidden.detach(), weight.detach()

    def bare():
        torch.mm(h, w.t())  # (N, V) logits
        torch.mm(g, w)  # (N, H) hidden gradient
        torch.mm(g.t(), h)  # (V, H) weight gradient

    fused_ms, bare_ms = c.ms(fused), c.ms(bare)
    model = None
    if not c.dry:
        plans = from_hidden_plans(c.gpu(), N, H, V)
        model = next(round(p["ratio"], 3) for p in plans if p["default"] and not p["recompute"])
    c.record(
        "from_hidden",
        f"ppo_loss_from_hidden forward + backward, {N} x {H} x {V} bf16, against its three bare matmuls",
        fused_ms=round(fused_ms, 3),
        bare_ms=round(bare_ms, 3),
        ratio=round(fused_ms / bare_ms, 3),
        predicted=model,
    )


def paged_decode(c: Check):
    """One layer's decode step, Qwen2.5-7B's attention shape (28 heads, 4 KV heads of 128), rows at
    ragged positions in groups of 8 sharing a prompt of half the context, over a static cache and a
    paged one (blocks of 16 for SDPA and the kernel, 256 for flash, the prompt's blocks shared by its
    group): SDPA, fastppo's kernel (plain over the static cache, the cascade over the paged one) and
    (where installed) flash-attn. Each is timed with its share of a copy of the keys and values its
    rows attend (the cascade reads fewer: its share is an effective rate); each agrees with SDPA over
    the static cache, and the kernel with a float64 oracle on some rows."""
    import math

    from fastppo.rollout.attention import CacheAttention, LayerAttention
    from fastppo.rollout.flash import flash_decode
    from fastppo.rollout.paged import PagedKVCache
    from fastppo.rollout.static_cache import StaticKVCache

    B, H, KVH, D, L, group = c.size(256, 4), 28, 4, 128, c.size(4096, 40), c.size(8, 2)
    prompt = L // 2
    dtype = torch.bfloat16 if not c.dry else torch.float32
    positions = torch.randint(L // 2, L, (B,), device=c.device)
    span = int(positions.max()) + 1
    q = torch.randn(B, H, 1, D, device=c.device, dtype=dtype)
    k, v = (torch.randn(B, KVH, 1, D, device=c.device, dtype=dtype) for _ in range(2))
    keys, values = (torch.randn(B, L, KVH, D, device=c.device, dtype=dtype) for _ in range(2))
    for x in (keys, values):  # a group's rows hold its prompt's keys
        x.view(B // group, group, L, KVH, D)[:, 1:, :prompt] = x.view(B // group, group, L, KVH, D)[:, :1, :prompt]
    read = 2 * int(positions.sum() + B) * KVH * D * keys.element_size()  # each row's live keys and values
    rows = torch.arange(B, device=c.device).repeat_interleave(L)
    at = torch.arange(L, device=c.device).repeat(B)
    outputs = {}
    for attention in ("sdpa", "triton", "flash"):
        backend = "triton" if attention == "triton" else "torch"
        try:
            flash = flash_decode(attention, c.device, dtype, dtype, D, 256 if attention == "flash" else None)
        except ValueError as why:
            c.record("paged_decode", f"{attention}: skipped ({why})")
            continue
        for layout, block in (("static", None), ("paged", 256 if flash else 16)):
            if block is None:
                cache = StaticKVCache(
                    1, B, KVH, L, D, dtype, c.device, head_major=flash is None
                )  # as the sampler holds it
            else:
                cache = PagedKVCache(
                    1, B, KVH, L, D, dtype, c.device, block_size=block, num_blocks=1 + B * math.ceil(L / block)
                )
                for first in range(0, B, group):
                    assert cache.claim(list(range(first, first + group)), prompt_len=prompt, cap=L, positions=L)
            cache.write(0, rows, at, keys.flatten(0, 1), values.flatten(0, 1))
            attend = CacheAttention(cache, flash, backend)
            context = attend.decode_context(positions)

            def step(attend=attend, context=context):
                return attend.decode(0, q, k, v, positions, span, context, LayerAttention(D**-0.5))

            outputs[attention, layout] = step().float()
            ms = c.ms(step)
            how = {"sdpa": "SDPA", "triton": "the kernel", "flash": "flash-attn"}[attention]
            if attention == "triton" and layout == "paged":
                how += " (cascade: a group's prompt read once)"
            name = f"{how} over a {layout} cache" + (f" (blocks of {block})" if block else "")
            name += f", [{B} rows up to {span}, {H} heads, {KVH} KV heads of {D}]"
            c.record("paged_decode", name, us=round(ms * 1e3, 1), share=round(read / ms / 1e6 / c.copy(), 3))
    reference = outputs.get(("sdpa", "static"))
    for (attention, layout), out in outputs.items():
        if (attention, layout) != ("sdpa", "static"):
            diff = (out - reference).abs().max().item()
            c.record(
                "paged_decode",
                f"{attention}, {layout}: against SDPA over the static cache",
                ok=diff < 2e-2,
                max_abs_diff=diff,
            )
    # The kernel against float64 on a few rows: their keys, the step's new one at its position included.
    checked = min(B, 8)
    for layout in ("static", "paged"):
        if ("triton", layout) not in outputs:
            continue
        worst = 0.0
        for b in range(checked):
            n = int(positions[b]) + 1
            kk = torch.cat((keys[b, : n - 1], k[b, :, 0][None])).double()  # (n, KVH, D)
            vv = torch.cat((values[b, : n - 1], v[b, :, 0][None])).double()
            qq = q[b, :, 0].double().view(KVH, H // KVH, D)
            weights = torch.softmax(torch.einsum("hgd,nhd->hgn", qq, kk) * D**-0.5, dim=-1)
            expected = torch.einsum("hgn,nhd->hgd", weights, vv).reshape(H, D)
            worst = max(worst, (outputs["triton", layout][b, :, 0].double() - expected).abs().max().item())
        c.record(
            "paged_decode",
            f"the kernel, {layout}: against float64 on {checked} rows",
            ok=worst < 2e-2,
            max_abs_diff=worst,
        )


# Each section and the seconds it may take on the GPU (a cold machine: compiling included), in the
# order that matters when time runs out.
SECTIONS = (
    (calibrate, 15),
    (bandwidth, 75),
    (ppo_loss_vs_oracle, 10),
    (gae_vs_oracle, 10),
    (logprobs_past_2_31, 20),
    (misaligned, 15),
    (peaked, 10),
    (distribution, 15),
    (occupancy, 25),
    (from_hidden, 20),
    (paged_decode, 25),
)


def markdown(c: Check) -> str:
    lines = ["# fastppo kernel check", "", "| section | check | ok | figures |", "| --- | --- | --- | --- |"]
    for line in c.lines:
        figures = ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in line.items()
            if k not in ("section", "name", "ok", "trace") and v is not None
        )
        ok = {True: "yes", False: "**NO**", None: ""}[line["ok"]]
        lines.append(f"| {line['section']} | {line['name']} | {ok} | {figures} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the folder the results are written into")
    parser.add_argument("--dry", action="store_true", help="CPU, Triton interpreter, toy shapes")
    parser.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="skip sections that would not fit in what is left"
    )
    args = parser.parse_args(argv)
    if args.dry and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--dry runs the kernels in the interpreter: set TRITON_INTERPRET=1")
    if not args.dry and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry (and TRITON_INTERPRET=1) to check the script on CPU")
    c = Check(args.out, args.dry, args.budget_s)
    total = sum(seconds for _, seconds in SECTIONS)
    c.record(
        "budget", f"the sections' seconds add up to {total} of {DEFAULT_BUDGET_S:.0f}", ok=total <= DEFAULT_BUDGET_S
    )
    torch.manual_seed(0)
    for section, seconds in SECTIONS:
        left = c.deadline - time.time()
        if left < seconds:
            c.record(section.__name__, f"skipped: {left:.0f} s left of the budget, it may take {seconds}")
            continue
        start = time.time()
        try:
            section(c)
        except Exception as error:  # recorded; the next section still runs
            c.record(
                section.__name__, "raised", ok=False, error=repr(error)[:300], trace=traceback.format_exc()[-1200:]
            )
        if c.device.type == "cuda":
            torch.cuda.empty_cache()
        took = time.time() - start
        allowed = DRY_SECONDS if c.dry else seconds
        # Over its seconds on a GPU the section still counts (the budget is then shorter for the rest);
        # over them in the interpreter at toy shapes, something in it is far too big.
        fits = took <= allowed
        c.record(
            section.__name__,
            "seconds",
            ok=False if c.dry and not fits else None,
            seconds=round(took, 1),
            allowed=allowed,
        )
        (c.out / "kernel_check.md").write_text(markdown(c))
    failed = [line for line in c.lines if line["ok"] is False]
    print(f"kernel_check: {len(failed)} failed of {sum(line['ok'] is not None for line in c.lines)} checks")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
