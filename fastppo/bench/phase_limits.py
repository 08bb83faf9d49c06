"""How far each phase of an iteration is from this machine's limit: the machine's rates, measured,
and the least time a phase's work could take at them.

:func:`measure` times this machine's dense matmul per dtype (``2048^3`` products, the best of a
few; smaller where a dtype is so slow here that one such product would take over
``MATMUL_SECONDS``, as bf16 is on a CPU without bf16 units, emulated at about 1% of its fp32 rate)
and its read bandwidth (a sum over a buffer of several times any cache, filled first so its pages
are real). ``fastppo bench --limits`` prints them; the end-to-end reports set each phase's
seconds beside its limit:

* **rollout**: a decode step reads every weight matrix once and each live row's keys and values
  once, and multiplies each row by every matrix, so its least time is the larger of its bytes over
  the read bandwidth and its FLOPs over the matmul rate; the prefill's is its FLOPs (2 per
  parameter of the matrices per prompt token) over the matmul rate. Steps are counted as an ideal
  scheduler would need them: the longest row's length, or the rows' tokens over the slots if more.
* **update**: 6 FLOPs per matrix parameter per token a forward and backward process (each prompt
  once for its samples, as the update lays them out), over the matmul rate. Attention's own FLOPs
  (a few percent at these lengths) are left out, so both limits are a little optimistic.

The *share* is the limit over the measured seconds: 100% is the machine's limit.
"""

from dataclasses import dataclass

import torch
from torch import nn

from ..machine import device_name
from ..rollout.calibration import seconds

MATMUL = 2048
MATMUL_PROBE = 256  # the product that sizes each dtype's timed one
MATMUL_SECONDS = 0.25  # the longest one timed product may take
READ_BYTES = {"cpu": 2 << 30, "cuda": 4 << 30}


@dataclass
class MachineLimits:
    machine: str
    matmul_flops: dict  # dtype name -> FLOP/s
    read_bytes_per_s: float
    read_buffer: int  # bytes the read bandwidth was measured over
    matmul_sizes: dict = None  # dtype name -> n of the n^3 product timed (default: MATMUL each)

    def rate(self, dtype: torch.dtype) -> float:
        return self.matmul_flops[str(dtype).removeprefix("torch.")]


def _best(device, run, repeats: int = 3) -> float:
    run()
    return min(seconds(device, run) for _ in range(repeats))


def _matmul_rate(device, dtype, largest: int) -> tuple:
    """``(FLOP/s, n)``: the best rate of ``n^3`` products in ``dtype``, ``n`` the largest multiple of
    the probe up to ``largest`` whose product takes at most ``MATMUL_SECONDS`` at the probe's rate."""

    def rate(n: int) -> float:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        return 2 * n**3 / _best(device, lambda: a @ b)

    n = min(MATMUL_PROBE, largest)
    probe = rate(n)
    fits = int((probe * MATMUL_SECONDS / 2) ** (1 / 3)) // MATMUL_PROBE * MATMUL_PROBE
    if min(fits, largest) > n:
        n = min(fits, largest)
        return rate(n), n
    return probe, n


@torch.no_grad()
def measure(device: torch.device, read_bytes: int = None, matmul: int = MATMUL) -> MachineLimits:
    """This machine's rates; ``read_bytes`` and ``matmul`` smaller than the defaults only to test it."""
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [])
    rates, sizes = {}, {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        rates[name], sizes[name] = _matmul_rate(device, dtype, matmul)
    buffer = torch.ones((read_bytes or READ_BYTES[device.type]) // 4, device=device)
    read = buffer.numel() * 4 / _best(device, buffer.sum)
    return MachineLimits(device_name(device), rates, read, buffer.numel() * 4, sizes)


def matrix_parameters(model) -> int:
    """Parameters of the model's matrices (linear layers, GPT-2's Conv1D, the LM head), tied ones once."""
    seen = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            seen[id(module.weight)] = module.weight.numel()
    return sum(seen.values())


def kv_bytes_per_position(model, dtype: torch.dtype) -> int:
    """Bytes of one position's keys and values over every layer."""
    c = model.config
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def rollout_seconds(
    limits: MachineLimits, model, dtype, prompt_lens: list, response_lens: list, slots: int, prefill: int
) -> float:
    """The least time of a rollout of rows with these prompt and response lengths in ``slots``
    slots, ``prefill`` tokens prefilled, weights and KV cache in ``dtype``."""
    params, kv = matrix_parameters(model), kv_bytes_per_position(model, dtype)
    steps = max(max(response_lens), -(-sum(response_lens) // slots))
    kv_read = sum(kv * (p * n + n * (n - 1) // 2) for p, n in zip(prompt_lens, response_lens))  # each step's live keys
    decode_bytes = steps * params * dtype.itemsize + kv_read
    decode_flops = 2 * params * sum(response_lens)
    rate = limits.rate(dtype)
    return max(decode_bytes / limits.read_bytes_per_s, decode_flops / rate) + 2 * params * prefill / rate


def update_seconds(limits: MachineLimits, model, dtype, tokens: int) -> float:
    """The least time of a forward and backward over ``tokens`` tokens in ``dtype``."""
    return 6 * matrix_parameters(model) * tokens / limits.rate(dtype)


def gflops(flops: float) -> str:
    """A rate in GFLOP/s, to two significant figures below 10 (an emulated dtype's is below 1)."""
    return f"{flops / 1e9:,.0f} GFLOP/s" if flops >= 1e10 else f"{flops / 1e9:.2g} GFLOP/s"


def markdown(limits: MachineLimits) -> str:
    sizes = limits.matmul_sizes or {}
    lines = [
        f"## This machine's limits: {limits.machine}",
        "",
        "| measure | rate |",
        "| --- | --- |",
        *(
            f"| {dtype} matmul ({sizes.get(dtype, MATMUL)}^3) | {gflops(flops)} |"
            for dtype, flops in limits.matmul_flops.items()
        ),
        f"| read bandwidth (a sum over {limits.read_buffer >> 30} GiB) | {limits.read_bytes_per_s / 1e9:,.1f} GB/s |",
    ]
    return "\n".join(lines) + "\n"
