"""A kernel compiled for sm_90 exactly as its launcher would launch it on real tensors.

Triton specialises a kernel at run time on its arguments: an integer equal to 1 becomes a
constant, an integer or pointer divisible by 16 is marked so (which is what lets loads and stores
be 16 bytes wide), integers below 2**31 are 32-bit. A compile from hand-written argument types
can differ from that (the PPO loss compiled without the pointer alignment the runtime sees; a
vocabulary of 1000 compiled as if its rows were 16-element aligned). So nothing here declares
types: :func:`launches` runs the real launcher on real tensors with the kernels swapped for
recorders, and :func:`compile_launch` hands the recorded arguments to Triton's own binder for an
sm_90 target, which yields the signature, constants and alignment the runtime would, and compiles
that; on a GPU, ``Launch.run`` replays the launch. Tensors on the CPU come from ``torch.empty``,
whose pages are never touched, so a (8192, 151936) bf16 logits tensor costs address space, not
memory.
"""

import contextlib
import math
from dataclasses import dataclass
from unittest import mock

from .sass import HOPPER_ARCH


@dataclass(frozen=True)
class Launch:
    kernel: object  # the @triton.jit function
    grid: tuple
    args: tuple
    kwargs: dict  # compile-time constants and launch options (num_warps)

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    @property
    def num_warps(self) -> int:
        return self.kwargs.get("num_warps", 4)

    def run(self):
        """Launch it as recorded (on a GPU, or in the interpreter when its tensors are there)."""
        self.kernel[self.grid](*self.args, **self.kwargs)


class _Recorder:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(Launch(self.kernel, grid, args, kwargs))

        return launch


def launches(module, run) -> dict:
    """The first launch of each kernel of ``module`` that ``run()`` (a call of a launcher) makes, by
    kernel name. Every kernel of ``module`` is recorded instead of run while ``run`` runs."""
    from triton.runtime.jit import KernelInterface  # compiled and interpreted kernels alike

    kernels = {name: value for name, value in vars(module).items() if isinstance(value, KernelInterface)}
    recorders = {name: _Recorder(kernel) for name, kernel in kernels.items()}
    with contextlib.ExitStack() as patches:
        for name, recorder in recorders.items():
            patches.enter_context(mock.patch.object(module, name, recorder))
        run()
    return {name: recorder.launches[0] for name, recorder in recorders.items() if recorder.launches}


def launched(module, kernel_name: str, run) -> Launch:
    """The first launch of ``module.<kernel_name>`` that ``run()`` makes."""
    recorded = launches(module, run)
    if kernel_name not in recorded:
        raise RuntimeError(f"the launcher did not launch {kernel_name}")
    return recorded[kernel_name]


def compile_launch(launch: Launch):
    """``triton.compile`` of the launch for sm_90, specialised as the runtime specialises it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", HOPPER_ARCH, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constants, attrs = kernel._pack_args(backend, launch.kwargs, bound, specialization, options)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=target, options=options.__dict__)
