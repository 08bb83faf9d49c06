"""On the CPU, freed tensor memory goes back to the operating system at once.

glibc's malloc serves a large allocation with ``mmap`` and unmaps it when it is freed, until the
first large block is freed: it then raises its mmap threshold to that block's size (up to 32 MiB
on 64-bit), so later tensors up to that size come from its heap, which keeps the space they free.
A PPO update allocates and frees tensors of many sizes (activations, blocks recomputed by
gradient checkpointing, LoRA's low-rank products and scalings) and the heap only grows: on a
2-core CPU, SmolLM2-135M with LoRA and gradient checkpointing peaked at 4.8 GB of resident
memory, above full fine-tuning's 4.6-4.9 GB, though it holds 1.5 GB less of tensors.

``mallopt(M_MMAP_THRESHOLD, 128 KiB)`` fixes the threshold at glibc's own default, which also
stops the raising: every large tensor is mapped and returned when freed. The same runs then peak
at 1.9 GB (LoRA) and 3.0 GB (full), what the memory plan counts. The price is a fresh mapping,
and its page faults, per large tensor: about 30% more wall time for those runs, and 40% for the
shipped tiny model, which gains nothing. So it is on by default for LoRA runs, whose point is
memory, and a choice (``cpu_release_memory``) for the others. It is the process's setting, for
good: the test suite leaves its own process's allocator alone. Elsewhere (macOS, musl) there is
no ``mallopt`` and nothing is changed; CUDA memory is torch's caching allocator's and is not
concerned.
"""

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 128 * 1024  # glibc's default, held fixed


def release_freed_memory() -> bool:
    """Fix glibc's mmap threshold (see above); False where the C library has no ``mallopt``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD))
