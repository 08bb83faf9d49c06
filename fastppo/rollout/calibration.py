"""Choosing by timing here, once per machine: the rollout copy's layout (``weight_layouts.py``), and for a
family with a hand-written forward whether it or the model's own modules decode faster.

Which layout a decode step reads fastest depends on the CPU or GPU, the math library's small-M
paths, the dtype and the batch, so the sampler times each layout that runs here on the model's
own matrices at its decode batch when it starts, keeps the fastest, and logs the times. Enough
matrices are timed (the first layers', up to ``SAMPLE_BYTES``) that they stream from memory as
a whole step's do, not from a core's cache; each layout is stored, multiplied once to warm up,
then timed over ``PASSES`` passes, the best pass counting. That is a few hundred milliseconds
at most, and the choice is kept in ``layouts.json`` under :func:`~fastppo.machine.cache_root`, by
machine, torch version, thread count, dtype, rows and shapes, so the next sampler on this machine
reads it instead.

The decoders (``decoders.py``) are timed the same way, at whole decode steps: each over a short
static cache of the sampler's rows, warmed once, the best of ``PASSES`` steps counting, plus what a
decoder runs once a rollout (the packed copy's refresh) spread over a rollout of as many steps as
the sampler's context; kept under the model's shapes as well. The hand-written forward stays where
it is faster; on a GPU both are timed eagerly, where the CUDA graphs they decode with would shorten
both.
"""

import json
import logging
import os
import tempfile
import time
from typing import Callable, Optional

import torch

from ..machine import cache_root, device_name
from .weight_layouts import LAYOUTS, layouts_for

SAMPLE_BYTES = 64 << 20  # the matrices timed: more than any core's cache holds
PASSES = 3
TIMED_SPAN = 64  # the positions of the decoders' timing cache: a step's cost is then mostly its weights

logger = logging.getLogger(__name__)


def _where(device) -> str:
    """The machine a measurement holds for: the device, torch and the threads it runs on."""
    return f"{device_name(device)} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def _key(device, dtype, rows: int, matrices: list) -> str:
    shapes = sorted({tuple(m.shape) for m in matrices})
    return f"{_where(device)} | {dtype} | {rows} rows | {shapes}"


def _cache_file():
    return cache_root() / "layouts.json"


def _read() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measure again
        return {}


def _write(key: str, choice: dict) -> None:
    """Add one choice to the cache file, atomically; a cache that cannot be written is skipped."""
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = {**_read(), key: choice}
        fd, staging = tempfile.mkstemp(dir=path.parent, prefix=".layouts-")
        with os.fdopen(fd, "w") as out:
            json.dump(table, out, indent=1)
        os.replace(staging, path)
    except OSError as error:
        logger.debug("rollout layout not cached (%s)", error)


def seconds(device, run) -> float:
    """Wall seconds of ``run()``, the device's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@torch.no_grad()
def time_layout(name: str, matrices: list, rows: int) -> float:
    """Seconds of the best of ``PASSES`` passes of ``rows`` rows times each of ``matrices``
    ``(out, in)`` stored in layout ``name``."""
    layout = LAYOUTS[name]
    device, dtype = matrices[0].device, matrices[0].dtype
    stored = [layout.store(m, rows) for m in matrices]
    inputs = {m.shape[1]: torch.randn(rows, m.shape[1], device=device, dtype=dtype) for m in matrices}

    def run():
        for s, m in zip(stored, matrices):
            layout.apply(inputs[m.shape[1]], s, m, None)

    run()
    return min(seconds(device, run) for _ in range(PASSES))


def sample(matrices) -> list:
    """The first of ``matrices`` (any iterable, taken in order) up to ``SAMPLE_BYTES``, at least one."""
    taken, size = [], 0
    for m in matrices:
        if taken and size + m.numel() * m.element_size() > SAMPLE_BYTES:
            break
        taken.append(m)
        size += m.numel() * m.element_size()
    return taken


def choose_layout(matrices, rows: int) -> str:
    """The fastest layout for products of ``rows`` rows with ``matrices`` ``(out, in)`` (an
    iterable in the order a step reads them, taken only as far as the timing needs), from the
    cache or measured now."""
    timed = sample(matrices)
    device, dtype = timed[0].device, timed[0].dtype
    names = layouts_for(device, dtype)
    if len(names) == 1:
        return names[0]
    key = _key(device, dtype, rows, timed)
    cached = _read().get(key, {}).get("layout")
    if cached in names:
        return cached
    start = time.perf_counter()
    seconds = {name: time_layout(name, timed, rows) for name in names}
    best = min(seconds, key=seconds.get)
    size = sum(m.numel() * m.element_size() for m in timed)
    logger.info(
        "rollout weights: %s layout for %d rows of %s on %s (per %.0f MB: %s; measured in %.2f s)",
        best,
        rows,
        dtype,
        device_name(device),
        size / 1e6,
        ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in seconds.items()),
        time.perf_counter() - start,
    )
    _write(key, {"layout": best, "ms": {name: round(s * 1e3, 3) for name, s in seconds.items()}})
    return best


@torch.no_grad()
def choose_decoder(timed: Callable[[], Optional[dict]], default: str, device, rows: int, steps: int, key: str) -> str:
    """The name of the faster decoder on ``device`` over a rollout of ``steps`` decode steps of ``rows``
    rows, from the cache file under ``key`` (the model's shapes and dtype) or measured now. ``timed()``
    builds what is measured, only then: name -> ``(decoder, refresh)``, a cached decoder over a static
    cache of ``rows`` rows and ``TIMED_SPAN`` positions and what it runs once a rollout (or None); or
    None when only ``default`` can serve, which is then chosen and not kept. The cost: a step's best
    time, plus the refresh's over ``steps``."""
    key = f"decoder | {_where(device)} | {rows} rows, {steps} steps | {key}"
    cached = _read().get(key, {}).get("decoder")
    if cached is not None:
        return cached
    decoders = timed()
    if decoders is None:
        return default
    tokens = torch.zeros(rows, dtype=torch.long, device=device)
    positions = torch.full((rows,), TIMED_SPAN - 1, dtype=torch.long, device=device)
    start = time.perf_counter()
    for decoder, _ in decoders.values():
        decoder.decode(tokens, positions, TIMED_SPAN)  # warm-up
    step = {name: float("inf") for name in decoders}
    for _ in range(PASSES):  # by turns, so that a drift of the machine's speed falls on both
        for name, (decoder, _) in decoders.items():
            step[name] = min(step[name], seconds(device, lambda d=decoder: d.decode(tokens, positions, TIMED_SPAN)))
    refresh = {name: 0.0 if run is None else seconds(device, run) for name, (_, run) in decoders.items()}
    cost = {name: step[name] + refresh[name] / steps for name in decoders}
    choice = min(cost, key=cost.get)
    logger.info(
        "rollout decoder: %s for %d rows on %s (a step: %s; once a rollout: %s; measured in %.2f s)",
        choice,
        rows,
        device_name(device),
        ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in step.items()),
        ", ".join(f"{name} {s * 1e3:.0f} ms" for name, s in refresh.items()),
        time.perf_counter() - start,
    )
    _write(key, {"decoder": choice, "step_ms": {n: round(s * 1e3, 3) for n, s in step.items()}})
    return choice
