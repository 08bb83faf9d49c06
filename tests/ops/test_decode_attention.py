"""``decode_attention`` against its float64 oracle on both backends: paged and static caches, GQA
ratios 1, 4 and 7, windows shorter and longer than the rows, sinks, rows of one position and rows
ending on block boundaries, NaN in everything a row does not own; the kernel's splits, tiles and
cascade change nothing; bad input is refused by name."""

import pytest
import torch

from fastppo.kernels.contract import Cascade
from fastppo.ops.decode_attention import decode_attention
from tests.oracles import decode_attention_oracle

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def paged_cache(lengths, KVH, D, page, dtype, shared=None, poison=True):
    """A pool whose blocks are handed out at random (block 0 the trash, never held), a table row per
    length, and NaN in every position no row holds: the trash, free blocks, and the tail of each
    row's last block. ``shared``: groups of rows ``(rows, positions)`` whose first full blocks are
    one group's (the paged cache's prompt sharing)."""
    per_row = [-(-L // page) for L in lengths]
    pool = 1 + sum(per_row) + 3  # three free blocks besides
    k = torch.full((pool, page, KVH, D), float("nan") if poison else 0.0, dtype=dtype)
    v = k.clone()
    order = (torch.randperm(pool - 1) + 1).tolist()
    table = torch.zeros(len(lengths), max(per_row) + 1, dtype=torch.int32)  # one spare column, unheld
    for b, n in enumerate(per_row):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    for rows, positions in shared or []:
        full = positions // page
        for b in rows[1:]:
            table[b, :full] = table[rows[0], :full]
    for b, L in enumerate(lengths):
        for p in range(L):
            block = table[b, p // page]
            k[block, p % page] = torch.randn(KVH, D).to(dtype)
            v[block, p % page] = torch.randn(KVH, D).to(dtype)
    return k, v, table


def static_cache(lengths, KVH, D, dtype, head_major):
    """Slots of ``max(lengths) + 3`` positions, NaN past each row's length; head-major storage is
    read through its transposed view, as the sampler keeps it where SDPA attends."""
    B, max_len = len(lengths), max(lengths) + 3
    shape = (B, KVH, max_len, D) if head_major else (B, max_len, KVH, D)
    k, v = (torch.randn(shape).to(dtype) for _ in range(2))
    if head_major:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    for b, L in enumerate(lengths):
        k[b, L:], v[b, L:] = float("nan"), float("nan")
    return k, v


def check(out, q, k, v, lengths, scale, **kwargs):
    ref = decode_attention_oracle(q, k, v, lengths, scale, **kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    tolerance = TOLERANCE[q.dtype]
    assert (out.double() - ref).abs().max() <= tolerance * max(1.0, ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "G, window, page", [(1, None, 16), (4, None, 32), (7, None, 16), (4, 5, 16), (1, 40, 16), (7, 1000, 24)]
)
def test_paged_rows_match_the_oracle(backend, dtype, G, window, page):
    KVH, D = 2, 32
    lengths = [1, page, 2 * page, 3 * page + 5, 40]  # one position, block boundaries, a partial block
    k, v, table = paged_cache(lengths, KVH, D, page, dtype)
    q = torch.randn(len(lengths), KVH * G, D).to(dtype)
    lengths = torch.tensor(lengths)
    out = decode_attention(q, k, v, lengths, scale=0.2, block_table=table, window=window, backend=backend)
    check(out, q, k, v, lengths, 0.2, block_table=table, window=window)


def test_layers_mixing_sliding_and_full_windows_over_one_step_each_get_their_own(backend):
    """A decode step's layers pass one ``lengths`` tensor (the twin builds its mask once a step):
    alternating windows, as Gemma 3 and GPT-OSS layers do, each attend with their own."""
    lengths_list, KVH, D, page = [7, 30, 41], 2, 16, 16
    k, v, table = paged_cache(lengths_list, KVH, D, page, torch.float32, poison=False)  # SDPA's path, not NaN's
    q, lengths = torch.randn(3, 4, D), torch.tensor(lengths_list)
    for window in (None, 4, None, 9, 4):
        out = decode_attention(q, k, v, lengths, scale=0.3, block_table=table, window=window, backend=backend)
        check(out, q, k, v, lengths, 0.3, block_table=table, window=window)


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_static_rows_match_the_oracle(backend, head_major, window):
    lengths = [1, 9, 33]
    k, v = static_cache(lengths, 2, 16, torch.float32, head_major)
    q = torch.randn(3, 8, 16)
    lengths = torch.tensor(lengths)
    out = decode_attention(q, k, v, lengths, scale=0.25, window=window, max_length=34, backend=backend)
    check(out, q, k, v, lengths, 0.25, window=window)


@pytest.mark.parametrize("D", [64, 80, 96, 128])
def test_head_sizes_of_the_lean_families(backend, D):
    lengths = [3, 21]
    k, v, table = paged_cache(lengths, 1, D, 16, torch.bfloat16)
    q = torch.randn(2, 4, D).to(torch.bfloat16)
    lengths = torch.tensor(lengths)
    out = decode_attention(q, k, v, lengths, scale=D**-0.5, block_table=table, backend=backend)
    check(out, q, k, v, lengths, D**-0.5, block_table=table)


@pytest.mark.parametrize("window", [None, 6])
def test_sinks_join_the_softmax_with_no_value(backend, window):
    lengths = [1, 7, 30]
    k, v, table = paged_cache(lengths, 2, 16, 16, torch.float32)
    q = torch.randn(3, 4, 16)
    sinks = torch.tensor([0.0, 3.0, -2.0, 30.0])  # the last dominates: its heads' outputs near 0
    lengths = torch.tensor(lengths)
    out = decode_attention(q, k, v, lengths, scale=0.3, block_table=table, window=window, sinks=sinks, backend=backend)
    check(out, q, k, v, lengths, 0.3, block_table=table, window=window, sinks=sinks)
    assert out[:, 3].abs().max() < 1e-6


@pytest.mark.parametrize("window, splits", [(None, 1), (6, 1), (None, 3)])
def test_softcap_bounds_the_scores_before_the_softmax(backend, window, splits):
    lengths = [1, 9, 40]
    k, v, table = paged_cache(lengths, 2, 16, 16, torch.float32)
    q = 8 * torch.randn(3, 4, 16)  # scores of tens: a cap of 5 changes the weights a lot
    lengths = torch.tensor(lengths)
    if backend == "triton" and splits > 1:  # the launcher's split-K, its partial states merged
        out = kernel(q, k, v, lengths, table, window=window, softcap=5.0, splits=splits, block_n=16)
    else:
        out = decode_attention(
            q, k, v, lengths, scale=0.3, block_table=table, window=window, softcap=5.0, backend=backend
        )
    check(out, q, k, v, lengths, 0.3, block_table=table, window=window, softcap=5.0)
    uncapped = decode_attention_oracle(q, k, v, lengths, 0.3, block_table=table, window=window)
    assert (out.double() - uncapped).abs().max() > 0.1


def test_a_strided_query_and_a_cache_in_another_dtype(backend):
    lengths = torch.tensor([5, 18])
    k, v, table = paged_cache(lengths.tolist(), 2, 16, 16, torch.bfloat16)
    q = torch.randn(4, 2, 16).transpose(0, 1)  # (B, H, D) with strides (16, 32, 1)
    out = decode_attention(q, k, v, lengths, scale=0.5, block_table=table, backend=backend)
    check(out, q, k.float(), v.float(), lengths, 0.5, block_table=table)
    assert out.is_contiguous()


def kernel(q, k, v, lengths, table, **options):
    """The Triton launcher itself, for its tuning arguments."""
    from fastppo.kernels import decode_attention as kernels

    out = torch.empty_like(q)
    window, cascade, softcap = options.pop("window", None), options.pop("cascade", None), options.pop("softcap", None)
    kernels.decode_attention(
        q, k, v, table, None, lengths, int(lengths.max()), 0.3, window, softcap, None, cascade, out, **options
    )
    return out


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("splits, block_n", [(1, 16), (2, 16), (3, 32), (5, 16)])
def test_splits_and_tiles_change_nothing(window, splits, block_n):
    lengths = torch.tensor([1, 16, 70, 33])
    k, v, table = paged_cache(lengths.tolist(), 2, 32, 16, torch.float32)
    q = torch.randn(4, 8, 32)
    out = kernel(q, k, v, lengths, table, window=window, splits=splits, block_n=block_n)
    check(out, q, k, v, lengths, 0.3, block_table=table, window=window)


def grouped_cache(page=16):
    """Six rows: three samples of a 40-token prompt (its two full blocks shared), two of a 20-token
    one (one block shared), one alone; their cascade in entries of two members, the first group
    over two entries, one entry naming a row past the batch and one unused."""
    lengths = [45, 58, 41, 21, 30, 12]
    k, v, table = paged_cache(lengths, 2, 32, page, torch.float32, shared=[([0, 1, 2], 40), ([3, 4], 20)])
    members = torch.tensor([[0, 1], [2, -1], [3, 4], [9, -1], [-1, -1]], dtype=torch.int32)
    shared = torch.tensor([32, 32, 16, 32, 0], dtype=torch.int32)
    starts = torch.tensor([32, 32, 32, 16, 16, 0], dtype=torch.int32)
    return torch.tensor(lengths), k, v, table, Cascade(members, shared, starts, 32)


@pytest.mark.parametrize("window", [None, 5, 25])
@pytest.mark.parametrize("prefix_splits, splits", [(1, 1), (2, 1), (3, 2)])
def test_cascade_equals_plain(window, prefix_splits, splits):
    lengths, k, v, table, cascade = grouped_cache()
    q = torch.randn(6, 8, 32)
    plain = kernel(q, k, v, lengths, table, window=window)
    out = kernel(q, k, v, lengths, table, window=window, cascade=cascade, prefix_splits=prefix_splits, splits=splits)
    check(out, q, k, v, lengths, 0.3, block_table=table, window=window)
    assert (out - plain).abs().max() < 1e-5


def test_a_nan_at_a_live_position_gives_nan(backend):
    lengths = torch.tensor([4, 20])
    k, v, table = paged_cache(lengths.tolist(), 1, 16, 16, torch.float32)
    v[table[1, 1], 2] = float("nan")  # row 1's position 18: live
    out = decode_attention(torch.randn(2, 2, 16), k, v, lengths, scale=0.3, block_table=table, backend=backend)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()


def _arguments():
    lengths = torch.tensor([3, 9])
    k, v, table = paged_cache(lengths.tolist(), 2, 16, 16, torch.float32)
    return dict(q=torch.randn(2, 4, 16), k_cache=k, v_cache=v, lengths=lengths, scale=0.25, block_table=table)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=torch.randn(2, 4, 1, 16)), "q must have shape"),
        (dict(q=torch.randn(2, 3, 16)), "not a multiple of the cache's 2 KV heads"),
        (dict(q=torch.randint(0, 3, (2, 4, 16))), "q must be float32"),
        (dict(v_cache=torch.zeros(3, 16, 2, 16)), "v_cache .* differs from k_cache"),
        (dict(k_cache=torch.zeros(20, 16, 2, 32)[..., ::2]), "k_cache's last dimension must be contiguous"),
        (dict(lengths=torch.tensor([3.0, 9.0])), "lengths must be an integer tensor"),
        (dict(lengths=torch.tensor([3, 9, 1])), r"lengths must have shape \(B,\)"),
        (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), "block_table must be int32"),
        (dict(max_length=40), "cannot hold max_length 40"),
        (dict(max_length=0), "max_length must be >= 1"),
        (dict(max_length=2.5), "max_length must be an int"),
        (dict(window=0), "window must be an int >= 1"),
        (dict(sinks=torch.zeros(3)), r"sinks must have shape \(H,\)"),
        (dict(scale="0.1"), "scale must be a real number"),
        (dict(softcap=0.0), "softcap must be a finite number > 0"),
        (dict(softcap=float("inf")), "softcap must be a finite number > 0"),
        (dict(softcap="30"), "softcap must be a finite number > 0"),
        (dict(cascade=(1, 2)), "cascade must be a fastppo.kernels.contract.Cascade"),
        (dict(block_table=None, cascade=Cascade(*[torch.zeros(1, dtype=torch.int32)] * 3, 0)), "needs a paged cache"),
        (dict(cascade=Cascade(torch.zeros(1, 2), torch.zeros(1), torch.zeros(2), 0)), "cascade.members must be int32"),
        (dict(rows=torch.tensor([0.0, 1.0])), "rows must be an integer tensor"),
        (dict(rows=torch.tensor([0, 1, 1])), r"rows must have shape \(B,\)"),
        (dict(rows=torch.tensor([0, 1]), cascade=Cascade(*[torch.zeros(1, dtype=torch.int32)] * 3, 0)), "with rows"),
        (dict(backend="cuda"), "backend must be one of"),
    ],
)
def test_bad_input_names_the_argument(change, match):
    arguments = {**_arguments(), **change}
    with pytest.raises((ValueError, TypeError), match=match):
        decode_attention(**arguments)


def test_lengths_past_max_length_are_caught_when_checking(monkeypatch):
    monkeypatch.setenv("FASTPPO_CHECK", "1")
    with pytest.raises(ValueError, match=r"lengths must be in \[1, max_length=5\]"):
        decode_attention(**_arguments(), max_length=5)


@pytest.mark.parametrize("entry", [-1, 10**6], ids=["-1", "past the pool"])
def test_a_block_table_entry_no_row_reads_may_hold_anything(backend, entry):
    arguments = _arguments()  # row 0 reads 1 block of 16, row 1 reads 1: columns 1 and on are read by none
    expected = decode_attention(**arguments, max_length=20, backend=backend)  # both rows gather 2 columns
    arguments["block_table"][:, 1:] = entry
    assert torch.equal(decode_attention(**arguments, max_length=20, backend=backend), expected)


@pytest.mark.parametrize("entry", [-1, 10**6], ids=["-1", "past the pool"])
def test_a_block_table_entry_a_row_reads_out_of_the_pool_gives_nan_or_names_the_argument(backend, monkeypatch, entry):
    arguments = _arguments()
    arguments["block_table"][1, 0] = entry  # row 1's only block: never read out of the pool
    out = decode_attention(**arguments, backend=backend)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()
    monkeypatch.setenv("FASTPPO_CHECK", "1")
    with pytest.raises(ValueError, match=rf"block_table must name blocks of the pool in \[0, \d+\) .*got \[{entry}\]"):
        decode_attention(**arguments)


def test_a_block_before_a_rows_window_is_not_read_nor_checked(backend, monkeypatch):
    monkeypatch.setenv("FASTPPO_CHECK", "1")
    lengths = torch.tensor([20, 40])
    k, v, table = paged_cache(lengths.tolist(), 2, 16, 8, torch.float32, poison=False)
    q = torch.randn(2, 4, 16)
    expected = decode_attention(q, k, v, lengths, scale=0.25, block_table=table, window=6, backend=backend)
    table[:, 0] = -1  # positions 0-7: before both windows (14-19, 34-39)
    out = decode_attention(q, k, v, lengths, scale=0.25, block_table=table, window=6, backend=backend)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)  # the twin's NaN path rounds otherwise


@pytest.mark.gpu
def test_8192_rows_over_a_pool_past_2_31_elements():
    """Offsets in int64: the rows' blocks lie at the end of a bf16 pool of more than 2**31 elements
    (4.3 GB each for keys and values), 8192 rows of 1 to 16 positions."""
    B, page, KVH, D = 8192, 16, 8, 128
    blocks = 2**31 // (page * KVH * D) + 64
    k = torch.randn(blocks, page, KVH, D, dtype=torch.bfloat16)
    v = torch.randn(blocks, page, KVH, D, dtype=torch.bfloat16)
    table = (blocks - 1 - torch.arange(B) % 64).view(B, 1).to(torch.int32)
    lengths = torch.arange(B) % page + 1
    q = torch.randn(B, 4 * KVH, D, dtype=torch.bfloat16)
    out = decode_attention(q, k, v, lengths, scale=D**-0.5, block_table=table)
    assert torch.isfinite(out).all()
    rows = [0, 15, 4097, B - 1]
    ref = decode_attention_oracle(q[rows], k, v, lengths[rows], D**-0.5, table[rows])
    assert (out[rows].double() - ref.to(out.device)).abs().max() < 2e-2


@pytest.mark.parametrize("paged", [False, True])
def test_queries_naming_their_rows_each_read_to_their_own_length(backend, paged):
    """A continuation's tokens: several queries on one cache row, each to its own position, rows in
    any order and some not read at all."""
    held = [9, 30, 17]
    if paged:
        k, v, table = paged_cache(held, 2, 16, 16, torch.float32)
    else:
        (k, v), table = static_cache(held, 2, 16, torch.float32, head_major=True), None
    rows = torch.tensor([1, 1, 1, 2, 0, 2])
    lengths = torch.tensor([28, 29, 30, 17, 1, 16])
    q = torch.randn(6, 4, 16)
    out = decode_attention(q, k, v, lengths, scale=0.3, block_table=table, rows=rows, window=12, backend=backend)
    check(out, q, k, v, lengths, 0.3, block_table=table, rows=rows, window=12)
