"""Bounds every layer shares: float32's largest value and a GiB.

Float32's largest finite value (scores, config numbers and stats become fp32 tensors, so a larger
number is refused where it enters) and the byte counts memory is planned and given in."""

FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch
GiB = 1 << 30
