"""The weights a lean decoder multiplies by: the model's own modules, or a rollout copy packed for the step.

A decode step of a few rows reads every weight matrix once, so it runs at the speed the math
library reads a matrix at small M. The packed copy helps it twice: the projections a layer runs on
one input are fused into one matrix (q, k and v; gate and up), one product instead of three, and
every matrix is stored in the layout that multiplies fastest on this machine (``weight_layouts.py``,
chosen by ``calibration.py``). The copy is made from the live parameters and made again at the
start of every rollout: one pass over the weights, counted in that rollout's time (about 0.1 s for
a 135M-parameter fp32 model on a 2-core CPU, against seconds of decoding). It cannot be skipped by
asking whether the weights changed: a fused optimizer step (torch's fused AdamW) and writes through
``.data`` leave the parameters' version counters as they were. In the ``linear`` layout the refresh
writes in place, so CUDA graphs captured over the copy stay valid.

A family names its groups (``LeanDecoder.projections``): for each name (``"qkv"``, ``"head"``)
and layer, the modules whose outputs it takes from one input. Only plain ``nn.Linear`` and GPT-2's
``Conv1D`` modules can be packed; a model with anything else in a projection (a LoRA adapter, a
quantized layer) runs its own modules (``weights="live"``), and says so in the log.
"""

import logging
from typing import Optional

import torch
from torch import Tensor, nn

from .calibration import choose_layout
from .weight_layouts import LAYOUTS, stored_bytes

logger = logging.getLogger(__name__)

WEIGHTS = ("packed", "live")


def _matrix(module) -> Optional[tuple]:
    """``(weight (out, in), bias or None)`` of a packable module, else None."""
    if type(module) is nn.Linear:
        return module.weight, module.bias
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # GPT-2's: weight (in, out)
        return module.weight.t(), module.bias
    return None


class LiveGroup:
    """The modules themselves: ``x -> tuple of each module's output``."""

    def __init__(self, modules: list):
        self.modules = modules

    def __call__(self, x: Tensor) -> tuple:
        return tuple(module(x) for module in self.modules)


class PackedGroup:
    """The modules' matrices stacked into one ``(sum of outs, in)`` matrix in ``layout``:
    ``x (..., in) -> tuple of (..., out_i)``, one product."""

    def __init__(self, modules: list, layout: str, rows: int):
        matrices = [_matrix(module) for module in modules]
        self.weights = [w for w, _ in matrices]
        self.biases = None if all(b is None for _, b in matrices) else [b for _, b in matrices]
        if self.biases is not None and any(b is None for b in self.biases):
            self.biases = [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(self.weights, self.biases)]
        self.sizes = [w.shape[0] for w in self.weights]
        self.layout, self.rows = LAYOUTS[layout], rows
        self.stored = self.bias = self.shape = None
        self.refresh()

    def stacked(self) -> Tensor:
        """The group's matrices as one ``(sum of outs, in)`` tensor (a new one)."""
        return torch.cat(self.weights) if len(self.weights) > 1 else self.weights[0].contiguous()

    @torch.no_grad()
    def refresh(self) -> None:
        if self.biases is not None:
            self.bias = torch.cat(self.biases) if self.bias is None else torch.cat(self.biases, out=self.bias)
        if self.stored is not None and self.layout.name == "linear":
            # in place, so a CUDA graph's address stays; a lone contiguous matrix is read as it is
            if self.stored.data_ptr() != self.weights[0].data_ptr():
                torch.cat(self.weights, out=self.stored)
            return
        matrix = self.stacked()
        if self.stored is None:
            self.stored = self.layout.store(matrix, self.rows)
        else:
            self.stored = self.layout.store_into(self.stored, matrix, self.rows)
        # the product reads only the matrix's shape (MKL's packed one); no second copy is kept
        self.shape = matrix if self.layout.name == "linear" else matrix.new_empty(()).expand(matrix.shape)

    def __call__(self, x: Tensor) -> tuple:
        y = self.layout.apply(x.reshape(-1, x.shape[-1]), self.stored, self.shape, self.bias)  # (M, sum of outs)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (y,)


class DecoderWeights:
    """Each group of a lean decoder, by name and layer: ``weights["qkv"][layer](h) -> (q, k, v)``.

    ``weights``: ``"packed"`` (a copy, see the module's docstring) or ``"live"`` (the modules);
    ``layout``: the packed copy's layout, default the fastest measured here for ``rows`` rows.
    """

    def __init__(self, groups: dict, weights: str, rows: int, layout: Optional[str] = None):
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        modules = [m for layers in groups.values() for group in layers for m in group]
        unpackable = sorted({type(m).__name__ for m in modules if _matrix(m) is None})
        if weights == "packed" and unpackable:
            logger.info("rollout weights: live, as %s cannot be packed", ", ".join(unpackable))
            weights = "live"
        self.weights, self.layout = weights, None
        if weights == "live":
            self.groups = {name: [LiveGroup(g) for g in layers] for name, layers in groups.items()}
            return
        first = _matrix(modules[0])[0]
        if layout is None:
            layout = choose_layout(_layer_by_layer(groups), rows)
        elif layout not in LAYOUTS or not LAYOUTS[layout].available(first.device, first.dtype):
            raise ValueError(f"layout {layout!r} does not run on {first.device} in {first.dtype}")
        self.layout = layout
        self.groups = {name: [PackedGroup(g, layout, rows) for g in layers] for name, layers in groups.items()}

    def __getitem__(self, name: str) -> list:
        return self.groups[name]

    @property
    def bytes(self) -> int:
        """Bytes the packed copy holds (0 when live)."""
        if self.weights == "live":
            return 0
        return sum(_nbytes(g) for layers in self.groups.values() for g in layers)

    def refresh(self) -> None:
        """Make the packed copy again from the live parameters (nothing to do when live)."""
        for layers in self.groups.values():
            for group in layers:
                if isinstance(group, PackedGroup):
                    group.refresh()


def _layer_by_layer(groups: dict):
    """Each group's stacked matrix, layer by layer (as a step reads them), made as they are taken."""
    for i in range(max(len(layers) for layers in groups.values())):
        for layers in groups.values():
            if i < len(layers):
                weights = [_matrix(m)[0] for m in layers[i]]
                yield torch.cat(weights) if len(weights) > 1 else weights[0]


def _nbytes(group: PackedGroup) -> int:
    """What the group's stored matrix adds to the model's own memory."""
    stored = group.stored
    if not stored.is_mkldnn and stored.data_ptr() == group.weights[0].data_ptr():  # the live matrix itself
        return 0
    return stored_bytes(stored)
