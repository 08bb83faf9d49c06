"""How the bench suite measures: time, memory and the machine's copy bandwidth.

* Time on CUDA is ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs, medians
  after warm-up); on CPU, wall-clock over repeated calls after one warm-up call.
* Memory is the peak allocated above what was allocated before the call: the caching allocator's
  on CUDA; on CPU the peak of live tensor storage created during the call, seen through a dispatch
  mode that also looks inside fastppo's custom ops.
* The copy bandwidth (bytes read plus written by a large device copy, in the same run) is the
  ceiling a memory-bound op is compared with.
"""

import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float


def time_call(call, device: torch.device, *, quick: bool = False, smoke: bool = False) -> Timing:
    """Median, min and max milliseconds of ``call()``; ``smoke`` runs it once (a test of the suite)."""
    if smoke:
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        return Timing(ms, ms, ms)
    if device.type == "cuda":
        from triton.testing import do_bench

        median, low, high = do_bench(
            call, warmup=10 if quick else 25, rep=40 if quick else 100, quantiles=[0.5, 0.0, 1.0]
        )
        return Timing(median, low, high)
    call()  # warm-up
    budget = 0.2 if quick else 1.0
    times = []
    deadline = time.perf_counter() + budget
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 100):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return Timing(times[len(times) // 2], times[0], times[-1])


def _storage_address(t):
    """The address of ``t``'s storage; None for what is not a plain tensor with memory (a DTensor
    wrapper, a storage FSDP has freed)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        storage = t.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else None
    except RuntimeError:
        return None


class LiveBytes(TorchDispatchMode):
    """The peak bytes of tensors created inside the mode and alive at once (``peak``; the CPU's
    counterpart of the CUDA allocator's peak), and the largest one (``largest``), looking inside
    fastppo's custom ops.

    Storages, not tensors, are counted (a view, or an in-place op's result, adds nothing: it is
    its input's memory), each until its last tensor is freed (a weak reference to the storage
    tells). The Triton interpreter stages each kernel argument as a byte tensor of the same size,
    which is not a second buffer of the op's own: under it ``peak`` overcounts.
    """

    def __init__(self):
        super().__init__()
        self.live = {}  # storage address -> (weak reference, bytes)
        self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        kwargs = kwargs or {}
        if func.namespace == "fastppo":
            # Run the op's CPU implementation with this mode active, so its inner ops are seen too.
            with self:
                out = func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        self.live = {key: entry for key, entry in self.live.items() if not entry[0].expired()}
        inputs = {_storage_address(t) for t in tree_flatten((args, kwargs))[0]}
        for t in tree_flatten(out)[0]:
            if _storage_address(t) is not None and t.device.type == "cpu":
                self.largest = max(self.largest, t.numel() * t.element_size())
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs:  # an in-place op's or a view's output is its input's memory
                    self.live.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


def storage_bytes(tensors) -> int:
    """Bytes of storage held for ``tensors`` in this process (a DTensor's by its local shard), each
    storage once; an opaque tensor (oneDNN's blocked format) by its logical size."""
    from torch.distributed.tensor import DTensor

    from ..rollout.weight_layouts import stored_bytes

    storages = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        storages[("opaque", id(t)) if t.is_mkldnn else t.untyped_storage().data_ptr()] = stored_bytes(t)
    return sum(storages.values())


def peak_memory_bytes(call, device: torch.device) -> int:
    """Peak bytes allocated above the starting point during ``call()``: from the CUDA caching
    allocator on CUDA, from :class:`LiveBytes` on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with LiveBytes() as mode:
        call()
    return mode.peak


def copy_bandwidth_gbps(device: torch.device, *, quick: bool = False, smoke: bool = False) -> float:
    """GB/s of a large device copy, counting bytes read plus bytes written."""
    # Large enough to leave the caches (except for the quick and smoke runs, which are tests).
    nbytes = (1 << 24) if quick or smoke else (1 << 30) if device.type == "cuda" else (1 << 28)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    timing = time_call(lambda: dst.copy_(src), device, quick=quick, smoke=smoke)
    return 2 * nbytes / (timing.median_ms * 1e-3) / 1e9
