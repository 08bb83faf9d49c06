"""A bounds checker for kernels run in the Triton interpreter: every read stays inside its tensor.

On a GPU an out-of-bounds read is an illegal access (or, worse, a silent read of a neighbour);
in the interpreter it is a read of whatever CPU memory lies there, which a test rarely notices.
:func:`reads_within_arguments` watches every load the interpreter performs while it is active: the
addresses a load reads (its mask's true lanes) must all lie within the extent of one tensor
argument of that launch, the extent of a view being the span from its first to its last element.
Passing views into larger buffers then catches a read one element before a row's start.
"""

import contextlib

import numpy as np
import torch


def extent(x: torch.Tensor) -> tuple:
    """``[first, last]`` byte addresses of the elements of the view ``x`` (non-negative strides)."""
    span = sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()) if size > 0)
    return x.data_ptr(), x.data_ptr() + (span + 1) * x.element_size() - 1


@contextlib.contextmanager
def reads_within_arguments():
    """Yield a list that collects a message for every load that leaves its tensor's extent."""
    from triton.runtime import interpreter

    violations, extents = [], []
    builder = interpreter.interpreter_builder
    original_load = builder.create_masked_load
    original_init = interpreter.GridExecutor._init_args_hst

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = original_init(self, args_dev, kwargs)
        extents[:] = [
            extent(a) for a in [*args_hst, *kwargs_hst.values()] if isinstance(a, torch.Tensor) and a.numel() > 0
        ]
        return args_hst, kwargs_hst

    # The load's trailing arguments (cache hints, volatility) differ between triton releases.
    def load(ptrs, mask, other, *hints, **named_hints):
        addresses = np.asarray(ptrs.data, dtype=np.uint64)[np.asarray(mask.data, dtype=bool)]
        if addresses.size and extents:
            inside = [((addresses >= lo) & (addresses <= hi)).sum() for lo, hi in extents]
            lo, hi = extents[int(np.argmax(inside))]
            outside = addresses[(addresses < lo) | (addresses > hi)]
            if outside.size:
                before = int(lo - outside.min()) if outside.min() < lo else 0
                violations.append(
                    f"{outside.size} address(es) outside [{lo:#x}, {hi:#x}], down to {before} bytes before its start"
                )
        return original_load(ptrs, mask, other, *hints, **named_hints)

    builder.create_masked_load = load
    interpreter.GridExecutor._init_args_hst = init_args
    try:
        yield violations
    finally:
        del builder.create_masked_load  # the class's method again
        interpreter.GridExecutor._init_args_hst = original_init
