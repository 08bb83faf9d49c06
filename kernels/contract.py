"""Memory layouts the kernels share with their PyTorch twins, in a module that imports no triton.

The twins run where triton is not installed (a CPU-only machine), so what both sides must agree
on lives here, once, and the kernels derive their constants from it.
"""

from typing import Any, NamedTuple

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


class Cascade(NamedTuple):
    """How decode attention reads a group's shared prompt once (``kernels/decode_attention.py``).

    ``members`` ``(E, M)`` int32: each entry's rows (the samples sharing one prefix, up to M of
    them, -1 where an entry has fewer); ``shared`` ``(E,)`` int32: the positions ``[0, shared)``
    the entry's rows hold in the same blocks (0: an unused entry); ``starts`` ``(B,)`` int32: each
    row's ``shared`` (0 for a row in no entry), where its own keys begin; ``longest``: an int at
    least every ``shared``. A row is in at most one entry. The math is plain attention's: this
    only says what may be read once.
    """

    members: Any
    shared: Any
    starts: Any
    longest: int
