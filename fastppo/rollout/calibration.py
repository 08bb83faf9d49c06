"""Choosing the rollout copy's layout (``layouts.py``) by timing it here, once per machine.

Which layout a decode step reads fastest depends on the CPU or GPU, the math library's small-M
paths, the dtype and the batch, so the sampler times each layout that runs here on the model's
own matrices at its decode batch when it starts, keeps the fastest, and logs the times. Enough
matrices are timed (the first layers', up to ``SAMPLE_BYTES``) that they stream from memory as
a whole step's do, not from a core's cache; each layout is stored, multiplied once to warm up,
then timed over ``PASSES`` passes, the best pass counting. That is a few hundred milliseconds
at most, and the choice is kept in ``layouts.json`` under :func:`~fastppo.machine.cache_root`, by
machine, torch version, thread count, dtype, rows and shapes, so the next sampler on this machine
reads it instead.
"""

import json
import logging
import os
import tempfile
import time

import torch

from ..machine import cache_root, device_name
from .layouts import LAYOUTS, layouts_for

SAMPLE_BYTES = 64 << 20  # the matrices timed: more than any core's cache holds
PASSES = 3

logger = logging.getLogger(__name__)


def _key(device, dtype, rows: int, matrices: list) -> str:
    shapes = sorted({tuple(m.shape) for m in matrices})
    where = f"{device_name(device)} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    return f"{where} | {dtype} | {rows} rows | {shapes}"


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
