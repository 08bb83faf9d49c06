"""What one bench table row is measured on: a case (an op at one shape) and its contenders."""

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class Contender:
    """One implementation of a case's computation.

    ``fn(inputs)`` returns a tensor or a tuple of tensors (their sum is differentiated for the
    forward+backward timing). Without ``fn``, ``status`` says why (``not installed``, ...).
    """

    name: str
    fn: Optional[Callable] = None
    status: str = "ok"
    baseline: bool = False  # the naive PyTorch version that speedups are relative to
    note: Optional[Callable] = None  # note(inputs) -> a remark on the last call, shown beside the name


@dataclass
class Case:
    """An op at one shape: fresh inputs, contenders, and the fewest bytes the op must move."""

    op: str
    label: str
    make_inputs: Callable[[], dict]
    contenders: list
    bytes_fwd: int
    bytes_fwd_bwd: Optional[int] = None  # None when the op has no backward
    grad_inputs: tuple = field(default_factory=tuple)  # names of the inputs to differentiate
    items: Optional[int] = None  # work items per call (generated tokens), for a rate column


def unavailable(op: str, label: str, names: list, why) -> Case:
    """A case whose every contender's row says why it cannot run (``why``)."""
    return Case(op, label, dict, [Contender(n, status=f"unavailable: {why}") for n in names], bytes_fwd=1)


def compiled(name: str, fn: Callable, device: torch.device) -> Contender:
    """``torch.compile`` of a naive version: on CUDA only, where users reach for it."""
    if device.type != "cuda":
        return Contender(name, status="CUDA only")
    return Contender(name, torch.compile(fn, dynamic=True))


def random_tokens(*shape, device, dtype=torch.float32, requires_grad=False):
    """Random, never zero, data: zeros hide unwritten outputs and run faster than real data."""
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(requires_grad)
