"""token_logprobs_from_hidden against the float64 oracle, and its O(chunk x V) memory bound."""

import pytest
import torch

import fastppo
from fastppo.bench.measure import LiveBytes
from fastppo.ops.token_logprobs_from_hidden import ChunkBuffers, add_matmul_fp32, default_chunk_size
from tests.conftest import BACKENDS_KERNEL_SLOW
from tests.ops.inputs import DTYPES, make_labels
from tests.oracles import assert_grad_close, assert_values_close, logprobs_from_hidden_oracle

CASES = [  # (leading shape, H, V, chunk_size, bias)
    ((2, 5), 16, 37, 3, True),  # chunks that do not divide N; odd V
    ((7,), 8, 1, None, False),  # V = 1
    ((3, 4), 32, 5000, 5, False),  # V above one kernel block
    ((2, 3), 24, 300, 64, True),  # one chunk larger than N
]


def check_from_hidden(hidden, weight, bias, labels, backend, *, chunk_size=None, temperature=1.0):
    dtype = hidden.dtype
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    hidden, weight, bias = leaves
    logp, entropy = fastppo.token_logprobs_from_hidden(
        hidden,
        weight,
        labels,
        bias=bias,
        temperature=temperature,
        return_entropy=True,
        chunk_size=chunk_size,
        backend=backend,
    )
    refs = [t.detach().double().requires_grad_() if t is not None else None for t in leaves]
    ref_logp, ref_entropy = logprobs_from_hidden_oracle(refs[0], refs[1], labels, refs[2], temperature)
    scale = (refs[0].detach() @ refs[1].detach().T).abs().max().item() / temperature if labels.numel() else 0.0
    assert_values_close(logp, ref_logp, dtype, scale)
    assert_values_close(entropy, ref_entropy, dtype, scale)

    g_logp, g_entropy = torch.randn_like(logp), torch.randn_like(entropy)
    (logp * g_logp + entropy * g_entropy).sum().backward()
    (ref_logp * g_logp.double() + ref_entropy * g_entropy.double()).sum().backward()
    for leaf, ref in zip(leaves, refs):
        if leaf is not None:
            assert_grad_close(leaf.grad, ref.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,H,V,chunk_size,with_bias", CASES, ids=lambda c: str(c))
def test_matches_oracle(backend, device, dtype, lead, H, V, chunk_size, with_bias):
    hidden = torch.randn(*lead, H, device=device).to(dtype)
    weight = (torch.randn(V, H, device=device) / H**0.5 * 3).to(dtype)
    bias = torch.randn(V, device=device).to(dtype) if with_bias else None
    check_from_hidden(
        hidden, weight, bias, make_labels(lead, V, device=device), backend, chunk_size=chunk_size, temperature=0.8
    )


def test_only_weight_needs_grad(backend, device):
    hidden = torch.randn(6, 8, device=device)
    weight = torch.randn(21, 8, device=device, requires_grad=True)
    labels = make_labels((6,), 21, device=device)
    logp = fastppo.token_logprobs_from_hidden(hidden, weight, labels, chunk_size=4, backend=backend)
    logp.sum().backward()
    ref_weight = weight.detach().double().requires_grad_()
    logprobs_from_hidden_oracle(hidden.double(), ref_weight, labels)[0].sum().backward()
    assert_grad_close(weight.grad, ref_weight.grad, torch.float32)


def test_ignored_rows_do_not_touch_gradients(backend, device):
    hidden = torch.randn(4, 8, device=device, requires_grad=True)
    weight = torch.randn(13, 8, device=device, requires_grad=True)
    labels = torch.full((4,), -100, device=device)
    logp, entropy = fastppo.token_logprobs_from_hidden(hidden, weight, labels, return_entropy=True, backend=backend)
    assert (logp == 0).all() and (entropy == 0).all()
    (logp.sum() + entropy.sum()).backward()
    assert (hidden.grad == 0).all() and (weight.grad == 0).all()


def test_per_sequence_temperature(backend, device):
    hidden = torch.randn(3, 4, 8, device=device)
    weight = torch.randn(29, 8, device=device)
    labels = make_labels((3, 4), 29, device=device)
    temperature = torch.tensor([[0.5], [1.0], [2.0]], device=device)
    logp = fastppo.token_logprobs_from_hidden(
        hidden, weight, labels, temperature=temperature, chunk_size=5, backend=backend
    )
    ref_logp, _ = logprobs_from_hidden_oracle(hidden, weight, labels, temperature=temperature.double())
    assert_values_close(logp, ref_logp, torch.float32, logit_scale=50)


@pytest.mark.parametrize("backend", BACKENDS_KERNEL_SLOW)  # the interpreter: ~20 s
def test_memory_is_bounded_by_the_chunk(backend, device):
    if device.type == "cuda":
        pytest.skip("measured with the CUDA allocator in test_gpu.py")
    N, H, V, chunk = 512, 16, 1000, 32
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    bias = torch.randn(V, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    with LiveBytes() as mode:
        logp, entropy = fastppo.token_logprobs_from_hidden(
            hidden, weight, labels, bias=bias, return_entropy=True, chunk_size=chunk, backend=backend
        )
        (logp.sum() + entropy.sum()).backward()
    assert hidden.grad is not None and weight.grad is not None and bias.grad is not None
    assert mode.largest == chunk * V * 4  # the fp32 chunk buffer is the largest tensor ...
    assert mode.largest * 10 < N * V * 4  # ... and it is far from the full logits

    # The same mode does see a full-logits implementation: the check can fail.
    with LiveBytes() as naive:
        torch.log_softmax(hidden @ weight.T, dim=-1)
    assert naive.largest == N * V * 4


def test_default_chunk_size():
    assert default_chunk_size(10, 151936) == 10  # never more rows than there are
    assert default_chunk_size(100_000, 151936) == 256  # 2**26 // 151936 = 441 -> 256
    assert default_chunk_size(100_000, 49152) == 1024  # 2**26 // 49152 = 1365 -> 1024
    assert default_chunk_size(100_000, 10**9) == 1
    # On CUDA chunks are 4x larger: 1024 rows of a 152k head, where its matmuls are compute-bound.
    assert default_chunk_size(100_000, 151936, "cuda") == 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_gradient_accumulates_in_place_in_fp32(dtype):
    acc = torch.randn(7, 5)
    a, b = torch.randn(7, 3).to(dtype), torch.randn(3, 5).to(dtype)
    expected = acc + a.float() @ b.float()
    where = acc.data_ptr()
    add_matmul_fp32(acc, a, b)
    assert acc.data_ptr() == where and acc.dtype == torch.float32
    torch.testing.assert_close(acc, expected)
    # The first chunk writes the accumulator: whatever it held (here NaN) is not added.
    acc.fill_(float("nan"))
    add_matmul_fp32(acc, a, b, first=True)
    assert acc.data_ptr() == where
    torch.testing.assert_close(acc, a.float() @ b.float())


def test_the_weight_gradient_of_no_rows_is_zero(backend, device):
    hidden = torch.randn(0, 8, device=device, requires_grad=True)
    weight = torch.randn(11, 8, device=device, requires_grad=True)
    logp = fastppo.token_logprobs_from_hidden(hidden, weight, torch.zeros(0, dtype=torch.long), backend=backend)
    logp.sum().backward()
    assert weight.grad is not None and (weight.grad == 0).all()


def test_the_logit_gradient_buffer_is_the_logits_unless_the_matmuls_take_half():
    hidden = torch.randn(4, 3)
    buffers = ChunkBuffers(10, torch.randn(9, 3), chunk_size=4)
    logits = buffers.chunk_logits(hidden, None).unsqueeze(0)
    assert buffers.logit_grad(logits) is logits
    half = ChunkBuffers(10, torch.randn(9, 3).bfloat16(), chunk_size=4).logit_grad(logits)
    assert half.dtype == torch.bfloat16 and half.shape == logits.shape


@pytest.mark.parametrize("op", ["token_logprobs_from_hidden", "ppo_loss_from_hidden"])
def test_every_chunk_writes_its_logits_into_one_buffer(op, monkeypatch):
    # One chunk's logits alive at a time, as the memory plan counts them: a chunk making its own
    # would hold the previous one's too at the moment it is made, so two chunks' addresses differ.
    from fastppo.ops import token_logprobs_torch

    seen = []
    for name in ("logprobs_forward", "logprobs_backward"):
        launcher = getattr(token_logprobs_torch, name)

        def recording(logits, *args, launcher=launcher, name=name):
            seen.append((name, logits.data_ptr()))
            return launcher(logits, *args)

        monkeypatch.setattr(token_logprobs_torch, name, recording)
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(21, 8, requires_grad=True)
    labels = torch.randint(0, 21, (10,))
    if op == "token_logprobs_from_hidden":
        out = fastppo.token_logprobs_from_hidden(hidden, weight, labels, chunk_size=4, backend="torch")
    else:
        out, _ = fastppo.ppo_loss_from_hidden(
            hidden,
            weight,
            labels,
            None,
            torch.randn(10),
            torch.ones(10, dtype=torch.bool),
            chunk_size=4,
            backend="torch",
        )
    out.sum().backward()
    for name in ("logprobs_forward", "logprobs_backward"):
        addresses = [address for called, address in seen if called == name]
        assert len(addresses) == 3 and len(set(addresses)) == 1, (name, addresses)


def test_only_hidden_needs_grad(backend, device):
    # A frozen LM head (adapters train the body only): the weight and bias get no gradient work.
    hidden = torch.randn(6, 8, device=device, requires_grad=True)
    weight, bias = torch.randn(21, 8, device=device), torch.randn(21, device=device)
    labels = make_labels((6,), 21, device=device)
    fastppo.token_logprobs_from_hidden(
        hidden, weight, labels, bias=bias, chunk_size=4, backend=backend
    ).sum().backward()
    ref_hidden = hidden.detach().double().requires_grad_()
    logprobs_from_hidden_oracle(ref_hidden, weight.double(), labels, bias.double())[0].sum().backward()
    assert_grad_close(hidden.grad, ref_hidden.grad, torch.float32)


def stats_oracle(hidden, weight, bias, labels, temperature, ignore_index=-100):
    """float64: log sum p^2, mean z and first-argmax == label, of z = (hidden @ weight.T + bias) / T."""
    z = hidden.double() @ weight.double().T
    z = (z if bias is None else z + bias.double()) / temperature
    log_p = torch.log_softmax(z, dim=-1)
    ignored = labels == ignore_index
    top1 = (z.argmax(dim=-1) == labels) & ~ignored
    return {
        "log_sum_sq_probs": torch.logsumexp(2 * log_p, dim=-1).masked_fill(ignored, 0.0),
        "mean_logits": z.mean(dim=-1).masked_fill(ignored, 0.0),
        "is_top1": top1,
    }


@pytest.mark.parametrize("V,block_v", [(37, None), (1, None), (300, 64)], ids=["odd", "V=1", "several-blocks"])
def test_head_stats_from_the_same_pass(backend, device, monkeypatch, V, block_v):
    if block_v is not None and backend == "triton":  # blocks narrower than V, so the statistics cross blocks
        from fastppo.kernels import token_logprobs as kernels

        monkeypatch.setattr(kernels, "_TILE", block_v)
    N, H = 11, 1
    hidden = torch.rand(N, H, device=device) + 0.5  # positive: the two largest weights tie for the argmax
    weight = torch.randn(V, H, device=device)
    first, second = V // 4, V // 2  # past the first block when there are several: the running max moves
    if V > 5:
        weight[first] = weight[second] = 5.0
    bias = torch.randn(V, device=device) * 0.1 if V > 5 else None
    if bias is not None:
        bias[first] = bias[second] = 0.0
    labels = torch.randint(0, V, (N,), device=device)
    if V > 5:
        labels[:4] = torch.tensor([first, second, first, second])
    labels[-1] = -100
    logp, entropy, stats = fastppo.token_logprobs_from_hidden(
        hidden,
        weight,
        labels,
        bias=bias,
        temperature=0.7,
        return_entropy=True,
        return_stats=True,
        chunk_size=4,
        backend=backend,
    )
    expected = stats_oracle(hidden, weight, bias, labels, 0.7)
    assert set(stats) == set(expected) and stats["is_top1"].dtype == torch.bool
    assert torch.equal(stats["is_top1"].cpu(), expected["is_top1"].cpu())
    if V > 5:
        assert stats["is_top1"][:4].tolist() == [True, False, True, False]  # a tie goes to the first index
    for name in ("log_sum_sq_probs", "mean_logits"):
        assert stats[name].dtype == torch.float32 and not stats[name].requires_grad
        torch.testing.assert_close(stats[name].double(), expected[name], rtol=1e-5, atol=2e-6)
    only = fastppo.token_logprobs_from_hidden(hidden, weight, labels, bias=bias, temperature=0.7, backend=backend)
    torch.testing.assert_close(only, logp)  # asking for the statistics changes nothing else
