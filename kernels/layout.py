"""Memory layouts the kernels share with their PyTorch twins, in a module that imports no triton.

The twins run where triton is not installed (a CPU-only machine), so what both sides must agree
on lives here, once, and the kernels derive their constants from it.
"""

# The columns of the PPO loss's per-program partial sums, in the order both implementations
# store them: a (programs, len(PARTIALS)) fp32 tensor that ``fastppo.ops.ppo_loss`` sums.
PARTIALS = ("pg", "kl", "entropy", "clipped", "half_lr_sq", "ratio", "ratio_max", "dual_clipped", "count")


def row_unit(*sizes) -> int:
    """The largest power of two up to 16 that divides every one of ``sizes`` (row strides and V).

    Triton marks an integer argument divisible by 16 or not at all, so rows of a vocabulary of
    1000 (16-byte aligned in bf16: 2000 bytes apart) would be read 2 bytes at a time. Launchers
    pass the row strides and V in units of this instead, and the kernels multiply by it as a
    constant, which tells the compiler every row starts at a multiple of it.
    """
    unit = 16
    while unit > 1 and any(size % unit for size in sizes):
        unit //= 2
    return unit
