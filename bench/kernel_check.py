"""The compiled kernels on a real GPU: float64 oracles at full size, and bandwidth against a copy.

Run by ``bench/gpu_check.sh`` as ``python bench/kernel_check.py OUT_DIR``. What it settles, by
section, each a few seconds on an H200:

* ``logprobs_past_2_31``: the log-prob forward and backward over bf16 ``[65536, 151936]`` (20 GB,
  element offsets past 2**31), in float64 on rows at the start, across the 2**31-element boundary
  and at the end.
* ``misaligned``: logits starting 2 bytes past an aligned address, rows padded apart, an odd
  vocabulary (50257) and one read in units of 8 (1000): log-probs, gradients and greedy draws.
* ``peaked``: rows whose peak is 40 above every other logit. The sampler must draw the peak in
  every row (any other draw has probability ~6e-13), which fails if the GPU's approximate log2
  turns a uniform near 1 into infinite Gumbel noise; the peak's log-prob must be in (-1e-6, 0].
* ``ppo_loss_vs_oracle`` and ``gae_vs_oracle``: against float64 at the report's sizes (4M tokens; 512 x 8192).
* ``bandwidth``: each kernel at the ``fastppo bench --sass`` shapes, timed with the L2 flushed
  (``triton.testing.do_bench``), as a share of a device copy's bandwidth, next to the share the
  model predicts from its machine code: the measurement that says how far to trust the model.
* ``from_hidden``: ``ppo_loss_from_hidden`` forward and backward at a 7B head against its three
  bare matmuls, next to the FLOP/byte model's ratio.

Each check prints one JSON line and appends it to OUT_DIR/kernel_check.jsonl; the end writes
OUT_DIR/kernel_check.md. A section that raises is recorded and the next one runs; sections past
the time budget (``--budget-s``) are skipped and say so. ``--dry`` runs every section on CPU in the
Triton interpreter at toy shapes, which is how the test suite checks this script without a GPU.
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
from fastppo.bench.measure import copy_bandwidth_gbps, time_call  # noqa: E402
from fastppo.kernels import logprobs, sampling  # noqa: E402
from tests.oracles import gae_oracle, logprobs_grad_oracle, logprobs_oracle, ppo_loss_oracle, relative_error  # noqa: E402


class Check:
    """The run's state: device, sizes, the output file, the deadline."""

    def __init__(self, out: Path, dry: bool, budget_s: float):
        self.out, self.dry = out, dry
        self.device = torch.device("cpu" if dry else "cuda")
        self.deadline = time.time() + budget_s
        self.lines = []
        self.copy_gbps = None
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

    def bf16(self, *shape, scale=3.0):
        x = torch.randn(shape, device=self.device, dtype=torch.bfloat16)
        return x.mul_(scale)

    def f32(self, n):
        return torch.empty(n, device=self.device, dtype=torch.float32)


def logprobs_past_2_31(c: Check):
    N, V = c.size(65536, 24), c.size(151936, 1000)
    x = c.bf16(1, N, V)
    labels = torch.randint(0, V, (N,), device=c.device)
    labels[::97] = -100
    boundary = c.size(2**31 // V, N // 2)  # the row holding element 2**31
    rows = torch.tensor(sorted({*range(4), *range(boundary - 2, boundary + 3), *range(N - 4, N)}), device=c.device)
    kept = x[0, rows].clone()
    logp, entropy, lse = c.f32(N), c.f32(N), c.f32(N)
    logprobs.logprobs_forward(x, labels, None, 1.0, -100, logp, entropy, lse)
    ref_logp, ref_entropy = logprobs_oracle(kept, labels[rows])
    error = max((logp[rows] - ref_logp).abs().max().item(), (entropy[rows] - ref_entropy).abs().max().item())
    c.record(
        "logprobs_past_2_31", f"forward bf16 [{N}, {V}], rows {rows.tolist()[:3]}...", ok=error < 1e-4, error=error
    )
    g_lp, g_ent = torch.randn(N, device=c.device), torch.randn(N, device=c.device)
    logprobs.logprobs_backward(x, x, labels, None, 1.0, -100, lse, entropy, g_lp, g_ent)  # in place, as from hidden
    expected = logprobs_grad_oracle(kept, labels[rows], g_lp[rows], g_ent[rows])
    error = relative_error(x[0, rows], expected)
    c.record("logprobs_past_2_31", "backward in place, relative error", ok=error < 1e-2, error=error)


def misaligned(c: Check):
    N = c.size(2048, 12)
    for V, pad, offset in ((50257, 0, 1), (1000, 0, 0), (1000, 4, 1), (151936, 8, 1)):
        V = c.size(V, min(V, 1003))
        storage = c.bf16(N * (V + pad) + offset)
        x = storage[offset:].view(N, V + pad)[:, :V]  # rows V + pad apart, starting `offset` elements in
        labels = torch.randint(0, V, (N,), device=c.device)
        logp, entropy, lse = c.f32(N), c.f32(N), c.f32(N)
        logprobs.logprobs_forward(x.unsqueeze(0), labels, None, 1.0, -100, logp, entropy, lse)
        ref_logp, ref_entropy = logprobs_oracle(x, labels)
        error = max((logp - ref_logp).abs().max().item(), (entropy - ref_entropy).abs().max().item())
        name = f"V={V}, rows {V + pad} apart, {2 * offset} bytes past aligned"
        c.record("misaligned", f"forward, {name}", ok=error < 1e-4, error=error)
        grad = torch.zeros(N, V + pad + 8, device=c.device, dtype=torch.bfloat16)[:, :V]
        g_lp = torch.randn(N, device=c.device)
        logprobs.logprobs_backward(x.unsqueeze(0), grad.unsqueeze(0), labels, None, 1.0, -100, lse, entropy, g_lp, None)
        error = relative_error(grad, logprobs_grad_oracle(x, labels, g_lp, torch.zeros_like(g_lp)))
        c.record("misaligned", f"backward, {name}", ok=error < 1e-2, error=error)
        tokens, token_logp = torch.empty(N, dtype=torch.long, device=c.device), c.f32(N)
        sampling.sample_forward(x, 1.0, True, 0, tokens, token_logp)
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
        sampling.sample_forward(x, 1.0, False, 1234 + seed, tokens, token_logp)
        off_peak += int((tokens != peak).sum())
        worst = min(worst, token_logp.min().item())
    c.record(
        "peaked",
        f"draws off a +40 peak in 4 x {B} rows of {V} (exact: ~6e-13 per row)",
        ok=off_peak == 0 and -1e-6 < worst <= 0,
        off_peak=off_peak,
        lowest_logprob=worst,
    )


def ppo_loss_vs_oracle(c: Check):
    N = c.size(512 * 8192, 4096)
    logp = (-torch.rand(N, device=c.device) * 5).requires_grad_()
    old = logp.detach() + 0.2 * torch.randn(N, device=c.device)
    ref = logp.detach() + 0.2 * torch.randn(N, device=c.device)
    advantages, mask = torch.randn(N, device=c.device), torch.rand(N, device=c.device) > 0.1
    entropy = torch.rand(N, device=c.device) * 3
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
    c.record(
        "ppo_loss_vs_oracle",
        f"loss and gradient, {N} tokens",
        ok=error < 1e-5 and grad_error < 1e-5,
        error=error,
        grad_error=grad_error,
    )


def gae_vs_oracle(c: Check):
    B, T = c.size(512, 6), c.size(8192, 300)
    rewards, values = torch.randn(B, T, device=c.device), torch.randn(B, T, device=c.device)
    mask = torch.rand(B, T, device=c.device) > 0.2
    advantages, returns = fastppo.gae(rewards, values, mask, gamma=0.99, lam=0.95, backend="triton")
    rows = torch.tensor([0, 1, B // 2, B - 1], device=c.device)
    ref_adv, ref_ret = gae_oracle(rewards[rows].double(), values[rows].double(), mask[rows], 0.99, 0.95)
    error = max(relative_error(advantages[rows], ref_adv), relative_error(returns[rows], ref_ret))
    c.record("gae_vs_oracle", f"[{B}, {T}], 4 rows against the float64 loop", ok=error < 1e-5, error=error)


def bandwidth(c: Check):
    """Each kernel as ``fastppo bench --sass`` compiles it (the same recorded launch, its tensors on
    the GPU), as a share of the copy bandwidth, beside the share the model predicts."""
    from fastppo.bench.kernel_cases import all_cases
    from fastppo.bench.roofline import GPU, estimate

    c.copy_gbps = copy_bandwidth_gbps(c.device, quick=c.dry)
    c.record("bandwidth", "torch copy (read + written)", GBps=round(c.copy_gbps))
    gpu = GPU(copy_tbs=c.copy_gbps / 1e3)
    for case in all_cases(c.device, toy=c.dry):
        for arg in case.launch.args:  # random inputs, every token valid (outputs are overwritten)
            if isinstance(arg, torch.Tensor) and arg.dtype == torch.bool:
                arg.fill_(True)
            elif isinstance(arg, torch.Tensor) and arg.is_floating_point():
                arg.normal_()
        share = case.bytes / c.ms(case.launch.run) / 1e6 / c.copy_gbps
        # The model compiles for sm_90, which needs the compiler, not the interpreter.
        predicted = None if c.dry else round(estimate(case, gpu)["copy_share"], 3)
        c.record("bandwidth", f"{case.name} {case.shape}", share=round(share, 3), predicted=predicted)


def from_hidden(c: Check):
    from fastppo.bench.kernel_cases import from_hidden_plans
    from fastppo.bench.roofline import GPU

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
    if not c.dry and c.copy_gbps:
        plans = from_hidden_plans(GPU(copy_tbs=c.copy_gbps / 1e3), N, H, V)
        model = next(round(p["ratio"], 3) for p in plans if p["default"] and not p["recompute"])
    c.record(
        "from_hidden",
        f"ppo_loss_from_hidden forward + backward, {N} x {H} x {V} bf16, against its three bare matmuls",
        fused_ms=round(fused_ms, 3),
        bare_ms=round(bare_ms, 3),
        ratio=round(fused_ms / bare_ms, 3),
        predicted=model,
    )


SECTIONS = (logprobs_past_2_31, misaligned, peaked, ppo_loss_vs_oracle, gae_vs_oracle, bandwidth, from_hidden)


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
    parser.add_argument("--budget-s", type=float, default=180.0, help="skip sections that start after this")
    args = parser.parse_args(argv)
    if args.dry and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--dry runs the kernels in the interpreter: set TRITON_INTERPRET=1")
    if not args.dry and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry (and TRITON_INTERPRET=1) to check the script on CPU")
    c = Check(args.out, args.dry, args.budget_s)
    torch.manual_seed(0)
    for section in SECTIONS:
        if time.time() > c.deadline:
            c.record(section.__name__, "skipped: past the time budget")
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
        c.record(section.__name__, "seconds", seconds=round(time.time() - start, 1))
    (c.out / "kernel_check.md").write_text(markdown(c))
    failed = [line for line in c.lines if line["ok"] is False]
    print(f"kernel_check: {len(failed)} failed of {sum(line['ok'] is not None for line in c.lines)} checks")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
