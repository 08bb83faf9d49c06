"""What the roofline model (``roofline.py``) assumes, measured on the GPU at hand.

``fastppo bench --sass`` predicts each kernel from its machine code with two figures it cannot
know without a GPU: the DRAM latency and the copy bandwidth. ``bench/kernel_check.py`` measures
both here and re-runs the model with them, next to each kernel's measured time:

* :func:`dram_latency_us`: one thread follows a chain of pointers laid out in a random cycle
  through a buffer far larger than the L2, so each load waits for the one before; the time per
  hop, with the launch subtracted (two chain lengths), is the latency of an unloaded DRAM access
  (TLB misses included). The model's ``latency_us`` is the latency *under load*, which is higher:
  this is its floor.
* :func:`rotating_ms`: a kernel of a few tens of microseconds moves a few tens of MB, which the
  H200's 50 MB L2 can hold between back-to-back launches, and whose writes may still sit in the
  L2 when its timer stops. So each launch gets its own copy of every tensor, enough copies to
  exceed twice the L2, and the copies are launched back to back between two events: the time
  per launch includes reading from and writing back to DRAM. The median of several such rounds.
"""

import math
import statistics
import time

import torch
import triton
import triton.language as tl

from .launches import Launch


@triton.jit
def _chase_kernel(next_ptr, out_ptr, start, hops):
    at = start.to(tl.int64)
    for _ in range(hops):
        at = tl.load(next_ptr + at)
    tl.store(out_ptr, at)


def pointer_chain(buffer_bytes: int, spacing: int, device) -> torch.Tensor:
    """An int64 buffer whose entries every ``spacing`` elements form one random cycle: each holds
    the index of the next."""
    n = buffer_bytes // 8
    nodes = torch.randperm(n // spacing, device=device) * spacing  # the cycle's order
    chain = torch.zeros(n, dtype=torch.int64, device=device)
    chain[nodes] = torch.roll(nodes, -1)
    return chain


def dram_latency_us(device, *, buffer_bytes: int = 1 << 30, hops: int = 20000) -> float:
    """Microseconds per dependent load over a random cycle through ``buffer_bytes`` (4 KB apart:
    a new page and a new DRAM row each time)."""
    chain = pointer_chain(buffer_bytes, 512, device)
    out = torch.empty(1, dtype=torch.int64, device=device)

    def seconds(n):
        times = []
        for _ in range(3):
            start = _now(device)
            _chase_kernel[(1,)](chain, out, 0, n, num_warps=1)
            times.append(_now(device) - start)
        return min(times)

    seconds(2)  # compile
    short, long = max(1, hops // 10), hops
    return (seconds(long) - seconds(short)) / (long - short) * 1e6


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _fresh_copy(arg):
    """A new tensor like ``arg`` with harmless contents: random floats, valid flags, zero indices."""
    if not isinstance(arg, torch.Tensor):
        return arg
    copy = torch.empty_like(arg)
    if copy.is_floating_point():
        return copy.normal_()
    return copy.fill_(True) if copy.dtype == torch.bool else copy.zero_()


def rotating_ms(launch: Launch, nbytes: int, *, l2_bytes: int, rounds: int = 7, memory_cap: int = 8 << 30) -> float:
    """Median milliseconds of one ``launch`` over fresh copies of its tensors, launched back to back
    (enough copies to exceed twice ``l2_bytes``, at most ``memory_cap`` bytes of them)."""
    copies = max(1, min(math.ceil(2 * l2_bytes / max(nbytes, 1)), memory_cap // max(nbytes, 1), 64))
    fresh = [
        Launch(launch.kernel, launch.grid, tuple(_fresh_copy(a) for a in launch.args), launch.kwargs)
        for _ in range(copies)
    ]
    for one in fresh:  # compiled and warm
        one.run()
    device = next(a.device for a in launch.args if isinstance(a, torch.Tensor))
    per_launch = []
    for _ in range(rounds):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for one in fresh:
                one.run()
            end.record()
            end.synchronize()
            per_launch.append(begin.elapsed_time(end) / copies)
        else:
            start = _now(device)
            for one in fresh:
                one.run()
            per_launch.append((_now(device) - start) * 1e3 / copies)
    return statistics.median(per_launch)
