"""Base-2 exponentials and logarithms as single special-function instructions.

``tl.exp`` compiles to a multiply by log2(e) and ``ex2.approx.f32``, which ptxas guards for
denormal results with a compare and two multiplies per element; ``tl.log`` is the accurate
software ``logf``. The hot loops here work in the log2 domain instead (log2(e) folded into the
logits' scale once per row) and call the flush-to-zero forms, ``ex2.approx.ftz.f32`` and
``lg2.approx.ftz.f32``, one MUFU instruction each: a result below 2**-126 becomes 0, far below
anything a softmax over 10**6 entries can resolve in fp32.

Triton's interpreter, which runs the kernels on CPU in the tests, has no libdevice; there the
same functions are ``tl.exp2`` / ``tl.log2`` (which keep denormals, the only difference), and
``tanh`` is written out with ``tl.exp2`` (within ~1e-7 absolute of libdevice's).
"""

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def exp2(x):
    if _INTERPRETED:
        return tl.exp2(x)
    else:
        return libdevice.exp2(x)


@triton.jit
def log2(x):
    if _INTERPRETED:
        return tl.log2(x)
    else:
        return libdevice.fast_log2f(x)


@triton.jit
def tanh(x):
    if _INTERPRETED:
        # 1 - 2 / (e^2x + 1): +-1 where e^2x overflows or vanishes, NaN kept
        return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)
    else:
        return libdevice.tanh(x)
