"""Runs bench cases: every contender of a case on the same inputs, forward and forward+backward."""

import datetime
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

import fastppo

from ..machine import device_name
from .advantages import gae_cases, whiten_cases
from .decoders import decoder_cases
from .logprobs import logprobs_cases, logprobs_from_hidden_cases
from .losses import ppo_loss_cases, ppo_loss_hidden_cases, ppo_loss_tokens_cases, value_loss_cases
from .measure import copy_bandwidth_gbps, peak_memory_bytes, time_call
from .paged import paged_cases
from .sampler import sampler_cases, sampling_cases
from .tool_latency import tool_latency_cases
from .trainer import trainer_cases, trainer_options_cases

# op family -> cases(device, quick). A time budget cuts the end of the list, so one family of
# each kind comes first and the matmul-bound ones, whose naive contenders take longest, last.
FAMILIES = {
    "logprobs": logprobs_cases,
    "ppo_loss": ppo_loss_cases,
    "gae": gae_cases,
    "sampler": sampler_cases,
    "rollout": paged_cases,
    "decoders": decoder_cases,
    "tools": tool_latency_cases,
    "sampling": sampling_cases,
    "trainer": trainer_cases,
    "trainer_options": trainer_options_cases,
    "ppo_loss_tokens": ppo_loss_tokens_cases,
    "value_loss": value_loss_cases,
    "whiten": whiten_cases,
    "ppo_loss_hidden": ppo_loss_hidden_cases,
    "logprobs_from_hidden": logprobs_from_hidden_cases,
}


@dataclass
class Row:
    op: str
    case: str
    contender: str
    mode: str  # "fwd" or "fwd+bwd"
    status: str  # "ok", or why there is no measurement
    bytes: int
    median_ms: Optional[float] = None
    min_ms: Optional[float] = None
    max_ms: Optional[float] = None
    speedup: Optional[float] = None  # naive median / this median, same mode
    gbps: Optional[float] = None
    pct_copy: Optional[float] = None
    memory_bytes: Optional[int] = None
    rate: Optional[float] = None  # items per second, for cases that count items
    note: Optional[str] = None  # the contender's remark on its last call


def make_call(fn, inputs: dict, mode: str, grad_inputs: tuple):
    """A no-argument callable running one pass (``"fwd"`` or ``"fwd+bwd"``) of ``fn`` on ``inputs``."""
    if mode == "fwd":
        return lambda: fn(inputs)
    leaves = [inputs[name] for name in grad_inputs]

    def forward_backward():
        out = fn(inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(sum(o.float().sum() for o in outs), leaves)

    return forward_backward


def _measure(row: Row, call, device, *, quick, smoke, copy_gbps, items) -> None:
    timing = time_call(call, device, quick=quick, smoke=smoke)
    row.median_ms, row.min_ms, row.max_ms = timing.median_ms, timing.min_ms, timing.max_ms
    row.gbps = row.bytes / (timing.median_ms * 1e-3) / 1e9
    row.rate = None if items is None else items / (timing.median_ms * 1e-3)
    row.pct_copy = 100.0 * row.gbps / copy_gbps
    row.memory_bytes = peak_memory_bytes(call, device)


def run_case(case, device, *, quick, smoke, copy_gbps, deadline) -> list:
    """Rows for every contender and pass of ``case``; failures become rows, never exceptions."""
    modes = [("fwd", case.bytes_fwd)] + ([("fwd+bwd", case.bytes_fwd_bwd)] if case.bytes_fwd_bwd else [])
    inputs = None
    rows = []
    for mode, nbytes in modes:
        mode_rows = []
        for contender in case.contenders:
            row = Row(case.op, case.label, contender.name, mode, contender.status, nbytes)
            if contender.fn is not None and time.monotonic() > deadline:
                row.status = "skipped: time budget"
            elif contender.fn is not None:
                try:
                    inputs = inputs or case.make_inputs()
                    _measure(
                        row,
                        make_call(contender.fn, inputs, mode, case.grad_inputs),
                        device,
                        quick=quick,
                        smoke=smoke,
                        copy_gbps=copy_gbps,
                        items=case.items,
                    )
                    row.note = contender.note and contender.note(inputs)
                except Exception as error:  # an OOM or a broken peer is a row, not the end of the run
                    row.status = f"error: {type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            mode_rows.append(row)
        baseline = [r for r, c in zip(mode_rows, case.contenders) if c.baseline and r.status == "ok"]
        for row in mode_rows:
            if baseline and row.status == "ok":
                row.speedup = baseline[0].median_ms / row.median_ms
        rows += mode_rows
    return rows


def commit() -> str:
    """The checkout's commit, ``+changes`` when its working tree differs from it."""
    root = Path(__file__).parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return (head + ("+changes" if changed else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and units (``machine.py``)."""
    return device_name(device) if device.type == "cuda" else f"CPU ({device_name(device)})"


def run_suite(
    ops,
    device: torch.device,
    *,
    quick: bool = False,
    smoke: bool = False,
    time_budget_s: float = float("inf"),
    on_case=None,
) -> tuple:
    """Run the families ``ops`` on ``device``; return ``(meta, rows)``.

    ``on_case(meta, rows)``, if given, sees the rows so far after every case, so a run that is
    killed still leaves what it measured.
    """
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    meta = {
        "machine": machine(device),
        "device": device.type,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "fastppo": fastppo.__version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "quick": quick,
        "copy_gbps": copy_bandwidth_gbps(device, quick=quick, smoke=smoke),
    }
    deadline = time.monotonic() + time_budget_s
    rows = []
    for op in ops:
        for case in FAMILIES[op](device, quick):
            rows += [
                asdict(r)
                for r in run_case(
                    case, device, quick=quick, smoke=smoke, copy_gbps=meta["copy_gbps"], deadline=deadline
                )
            ]
            if on_case is not None:
                on_case(meta, rows)
    return meta, rows
