"""What this machine is, and where fastppo keeps what it learns of it.

Speed on a CPU depends on the model of CPU and its units (a Xeon with AMX multiplies bf16 several
times faster than fp32; one without multiplies it slower), so every measurement names the CPU by
its model, not by its architecture, and what the rollout measures once per machine (the weight
layout, ``rollout/calibration.py``) is kept under :func:`cache_root` with that name in its key.
"""

import os
import platform
from pathlib import Path

import torch

CPU_UNITS = ("avx512f", "avx512_bf16", "amx_bf16", "avx2", "neon", "sve")  # flags named beside the model


def cpu_name() -> str:
    """The CPU's model name and its vector and matrix units, e.g. ``Intel(R) Xeon(R) Processor
    (avx512f, avx512_bf16, amx_bf16), 2 cores``."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model"):
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags = set(value.split())
    except OSError:  # not Linux: the platform's own name
        pass
    units = ", ".join(unit for unit in CPU_UNITS if unit in flags)
    return f"{model} ({units}), {os.cpu_count()} cores" if units else f"{model}, {os.cpu_count()} cores"


def device_name(device: torch.device) -> str:
    """The GPU's name, or :func:`cpu_name` for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def cache_root() -> Path:
    """Where fastppo keeps what it converts or measures once per machine: ``$FASTPPO_CACHE``, by
    default ``~/.cache/fastppo``."""
    return Path(os.environ.get("FASTPPO_CACHE", "~/.cache/fastppo")).expanduser()
