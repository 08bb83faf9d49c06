"""How a rollout copy's weight matrix is stored and multiplied: the layouts a decode step can read.

A decode step multiplies a few rows (the batch) by every weight matrix once, so its speed is how
fast the math library reads a matrix at small M, and that depends on the layout and the library's
path for it, not on the FLOPs. On one 2-core Xeon, ``F.linear(x, W)`` at 16 rows runs MKL's
small-M path 2-6x slower than ``x @ W.T.contiguous()`` on some shapes, while another CPU is
fastest with MKL's own packed format. So the layout is measured where it runs (``calibration.py``),
never assumed. Each layout here gives bit-for-bit or near (within fp32 rounding) the products of
``F.linear``:

* ``linear``: the matrix ``(out, in)`` as the module holds it, ``F.linear`` (cuBLAS on CUDA).
* ``transposed``: a contiguous ``(in, out)`` copy, ``x @ Wt``.
* ``mkl``: MKL's packed GEMM format (``cblas_sgemm_pack``), the format inductor's CPU freezing
  pass uses; fp32 only.
* ``onednn``: oneDNN's blocked format for its inner-product primitive (on CPUs with AMX it tiles
  the bf16 matrix for the AMX units); bf16 only where oneDNN can store it (:func:`onednn_bf16`).

A layout stores a matrix with :meth:`Layout.store` and multiplies with :meth:`Layout.apply`;
:meth:`Layout.store_into` refreshes a stored matrix in place where the layout can (``linear`` and
``transposed``: the addresses a CUDA graph replays stay), else stores anew.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


class Layout:
    name = ""

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return True

    def store(self, weight: Tensor, rows: int) -> Tensor:
        """``weight`` ``(out, in)`` in this layout, for products of about ``rows`` rows."""
        raise NotImplementedError

    def store_into(self, stored: Tensor, weight: Tensor, rows: int) -> Tensor:
        """``stored`` brought up to ``weight``: in place where the layout allows, else a new one."""
        return self.store(weight, rows)

    def apply(self, x: Tensor, stored: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        """``x`` ``(M, in)`` times the matrix, plus ``bias`` ``(out,)``: ``(M, out)``. ``weight`` is
        the ``(out, in)`` matrix itself (MKL's packed product reads its shape from it)."""
        raise NotImplementedError


class Linear(Layout):
    name = "linear"

    def store(self, weight, rows):
        return weight.contiguous()

    def store_into(self, stored, weight, rows):
        return stored.copy_(weight)

    def apply(self, x, stored, weight, bias):
        return F.linear(x, stored, bias)


class Transposed(Layout):
    name = "transposed"

    def store(self, weight, rows):
        return weight.t().contiguous()  # (in, out)

    def store_into(self, stored, weight, rows):
        return stored.copy_(weight.t())

    def apply(self, x, stored, weight, bias):
        return x @ stored if bias is None else torch.addmm(bias, x, stored)


class MKLPacked(Layout):
    name = "mkl"

    @staticmethod
    def available(device, dtype):
        return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()

    def store(self, weight, rows):
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), rows)

    def apply(self, x, stored, weight, bias):
        return torch.ops.mkl._mkl_linear(x, stored, weight, bias, x.shape[0])


class OneDNNBlocked(Layout):
    name = "onednn"

    @staticmethod
    def available(device, dtype):
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16())

    def store(self, weight, rows):
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows)

    def apply(self, x, stored, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, stored, bias, "none", [], "")


def onednn_bf16() -> bool:
    """Whether oneDNN stores bf16 matrices on this CPU: its reorder needs avx512bw/vl/dq or
    avx_ne_convert (or Arm's bf16 extension), and refuses the matrix without them (an AVX2-only
    x86 CPU), where the other layouts still multiply bf16."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


#: name -> layout: every way a rollout copy can hold a matrix.
LAYOUTS = {layout.name: layout for layout in (Linear(), Transposed(), MKLPacked(), OneDNNBlocked())}


def stored_bytes(stored: Tensor) -> int:
    """Bytes a stored matrix holds: its storage's, or an opaque oneDNN tensor's logical size (it has
    no storage to ask)."""
    return stored.numel() * stored.element_size() if stored.is_mkldnn else stored.untyped_storage().nbytes()


def layouts_for(device: torch.device, dtype: torch.dtype) -> list:
    """The names of the layouts that run on ``device`` in ``dtype``, ``linear`` first."""
    return [name for name, layout in LAYOUTS.items() if layout.available(device, dtype)]
