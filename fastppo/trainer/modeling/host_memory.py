"""On the CPU, what glibc's malloc does with the memory freed tensors held: return it at once, or keep it
for the next iteration's tensors.

By default glibc serves a large allocation with ``mmap`` and unmaps it when it is freed, until the
first large block is freed: it then raises its mmap threshold to that block's size (up to 32 MiB
on 64-bit), so later tensors up to that size come from its heap, whose freed top it gives back
past 128 KiB. A PPO iteration allocates and frees the same tensors again and again, and the
default serves it badly either way: it maps afresh (and faults in) what the next iteration will
need again, and it keeps what a LoRA run, short of memory, will never need. So a run sets one of:

* **Release** (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``: the threshold fixed at glibc's own default,
  which also stops the raising): every large tensor is mapped and returned when freed. A LoRA
  update allocates and frees tensors of many sizes (activations, blocks recomputed by gradient
  checkpointing, LoRA's low-rank products) and the default heap only grows: on a 2-core CPU,
  SmolLM2-135M with LoRA and gradient checkpointing peaked at 4.8 GB of resident memory, above full
  fine-tuning's 4.6-4.9 GB, though it holds 1.5 GB less of tensors. Released, the same runs peak at
  1.9 GB (LoRA) and 3.0 GB (full), what the memory plan counts. The price is a fresh mapping, and
  its page faults, per large tensor: about 30% more wall time for those runs.
* **Keep** (the threshold at ``KEEP_BELOW`` and the heap trimmed only past ``KEEP_TOP``): tensors
  come from the heap, and the space they free stays there for the next iteration's. Under the
  default the process faults pages in afresh in every iteration that sets a new peak or outgrows
  the raised threshold: on a 2-core AMD EPYC guest, SmolLM2-135M's chat workload (2 x 8 rows of 280 +
  96 tokens) faulted 0.08-1.25 million pages an iteration, 0.3-8 s of system time; kept, none once
  the run has reached its peak, at the same peak resident memory
  (``bench/results/cpu-2cores-2026-12-07-amd-kept-heap.md``).

Release is on by default for LoRA runs, whose point is memory, and keep for the others
(``cpu_release_memory`` chooses). It is the process's setting, for good: the test suite leaves its
own process's allocator alone and measures each in a process of its own. Elsewhere (macOS, musl)
there is no ``mallopt`` and nothing is changed; CUDA memory is torch's caching allocator's and is
not concerned.
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
RELEASE_BELOW = 128 * 1024  # glibc's default threshold, held fixed
KEEP_BELOW = 1 << 30  # a tensor larger than this is still mapped afresh (and returned when freed)
KEEP_TOP = (1 << 31) - 1  # the most free heap top kept (mallopt takes an int)


def _mallopt(settings: dict) -> bool:
    """Apply ``{parameter: value}`` with glibc's ``mallopt``; False where there is none or it refuses."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return all([bool(mallopt(parameter, value)) for parameter, value in settings.items()])


def release_freed_memory() -> bool:
    """Return freed tensor memory to the OS at once (see above)."""
    return _mallopt({M_MMAP_THRESHOLD: RELEASE_BELOW})


def keep_freed_memory() -> bool:
    """Keep freed tensor memory in the heap for the next tensors (see above)."""
    return _mallopt({M_MMAP_THRESHOLD: KEEP_BELOW, M_TRIM_THRESHOLD: KEEP_TOP})
