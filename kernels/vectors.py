"""Rows that start between 16-byte vectors, read as an aligned body of whole vectors and two edges.

A row of an odd vocabulary (GPT-2's 50,257) starts wherever the previous one ended, so no power
of two divides the row offsets and the compiler reads the logits 2 bytes at a time (8 load
instructions where one would do, and the issue slots with them). Each row instead starts its
body at its first 16-byte boundary, ``head`` columns in, and the kernel says so
(``tl.multiple_of``): the body's ``body`` columns, a multiple of the tile and the same count for
every row, are read in whole vectors with no column mask. The ``head`` columns before it and the
ragged end after it, fewer than a tile plus a vector in all, are read apart, masked.
"""

import triton
import triton.language as tl

VECTOR_BYTES = 16  # the widest global load or store of one thread
# The edges' tile: narrower than a body's, so their scalar loads and 8-byte addresses do not set
# the registers of the whole kernel (triton 3.6 gave the log-prob backward 194 with full tiles).
EDGE_TILE = 1024


def row_shift(tensor, unit: int) -> tuple:
    """``(VEC, first)`` for the rows of ``tensor`` (its last dimension the vocabulary) when
    ``unit`` (``layout.row_unit`` of its row strides and V) leaves them starting between vectors.

    ``VEC`` is the elements per vector, or 1 when the rows are already vector-aligned (or strided
    along the vocabulary) and read as they are. ``first`` is how many elements the data pointer lies
    past a 16-byte boundary: a row at offset ``o`` has ``(-(o + first)) % VEC`` head columns.
    """
    vec = VECTOR_BYTES // tensor.element_size()
    if tensor.stride(-1) != 1 or unit >= vec:
        return 1, 0
    return vec, tensor.data_ptr() // tensor.element_size() % vec


def shared_shift(logits, grad, unit: int) -> tuple:
    """``(VEC, GRAD_VEC, first)`` for a kernel that reads rows of ``logits`` and writes the same rows
    of ``grad``: when both start on 16-byte boundaries and their rows lie alike modulo the wider
    vector (in place; or fp32 logits and a half gradient, as the ops from hidden states write on
    CUDA), each row's head is counted in the wider vector and the gradient's body is stored in
    vectors too. Otherwise the gradient is stored as it comes (``GRAD_VEC`` 1)."""
    vec, first = row_shift(logits, unit)
    if vec == 1:
        return 1, 1, 0
    wide = max(vec, VECTOR_BYTES // grad.element_size())
    aligned = logits.data_ptr() % VECTOR_BYTES == 0 and grad.data_ptr() % VECTOR_BYTES == 0 and grad.stride(-1) == 1
    if aligned and all((g - x) % wide == 0 for g, x in zip(grad.stride()[:-1], logits.stride()[:-1])):
        return wide, wide, 0
    return vec, 1, first


def body_columns(V: int, vec: int, block: int) -> int:
    """Columns every row reads in whole tiles of ``block`` after its head (at most ``vec - 1``)."""
    return max(0, V - (vec - 1)) // block * block


@triton.jit
def body_start(row_offset, first, VEC: tl.constexpr):
    # row_offset (BLOCK_N,) int64 -> (head, start): the columns before each row's first whole
    # vector, and the offset of that vector, which the compiler is told is vector-aligned.
    head = (-(row_offset + first)) & (VEC - 1)
    return head, tl.multiple_of(row_offset + head, VEC)


@triton.jit
def edge_columns(r0, head, body, V, row_ok, BLOCK_V: tl.constexpr):
    # The columns a row's body leaves out, ``head`` (BLOCK_N,) of them before it and the rest after
    # it, V - body in all for every row, numbered r = r0, r0 + 1, ...:
    # -> (BLOCK_N, BLOCK_V) int64 columns, and the mask of those that exist in rows row_ok.
    r = (r0 + tl.arange(0, BLOCK_V))[None, :].to(tl.int64)  # (1, BLOCK_V)
    cols = tl.where(r < head[:, None], r, r + body)
    return cols, row_ok[:, None] & (r < V - body)
