"""token_logprobs against the float64 oracle: values, entropy and gradients, both backends."""

import pytest
import torch

import fastppo
from fastppo.ops import token_logprobs_torch
from tests.ops.inputs import DTYPES, make_labels
from tests.oracles import assert_grad_close, assert_values_close, logprobs_grad_oracle, logprobs_oracle

CASES = [  # (leading shape, V, temperature)
    ((3,), 1, 1.0),  # V = 1: the label is certain
    ((2, 3), 17, 0.7),  # V not a power of two, temperature < 1
    ((2, 2, 3), 33, 1.3),  # three leading dims
    ((3,), 5000, 1.0),  # V above the kernel's 4096 block and not a multiple of it
    ((2,), 151936, 0.9),  # Qwen2's vocabulary
]


def check_op(logits, labels, backend, *, temperature=1.0, ignore_index=-100, logit_scale=None):
    """Values, entropy and the gradient of ``sum(a * logp + b * entropy)`` match the oracle."""
    dtype = logits.dtype
    logits = logits.detach().requires_grad_()
    logp, entropy = fastppo.token_logprobs(
        logits, labels, temperature=temperature, ignore_index=ignore_index, return_entropy=True, backend=backend
    )
    assert logp.shape == labels.shape and entropy.shape == labels.shape

    ref_logits = logits.detach().double().requires_grad_()
    ref_temperature = temperature.double() if isinstance(temperature, torch.Tensor) else temperature
    ref_logp, ref_entropy = logprobs_oracle(ref_logits, labels, ref_temperature, ignore_index)
    if logit_scale is None:
        logit_scale = (
            ref_logits.detach().abs().amax()
            / (ref_temperature if isinstance(ref_temperature, float) else ref_temperature.min())
        ).item()
    assert_values_close(logp, ref_logp, dtype, logit_scale)
    assert_values_close(entropy, ref_entropy, dtype, logit_scale)

    g_logp, g_entropy = torch.randn_like(logp), torch.randn_like(entropy)
    (logp * g_logp + entropy * g_entropy).sum().backward()
    (ref_logp * g_logp.double() + ref_entropy * g_entropy.double()).sum().backward()
    assert_grad_close(logits.grad, ref_logits.grad, dtype)
    return logp, entropy, logits.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,V,temperature", CASES, ids=lambda c: str(c))
def test_matches_oracle(backend, device, dtype, lead, V, temperature):
    logits = (torch.randn(*lead, V, device=device) * 4).to(dtype)
    check_op(logits, make_labels(lead, V, device=device), backend, temperature=temperature)


def test_entropy_gradient_alone(backend, device):
    logits = torch.randn(4, 37, device=device, requires_grad=True)
    labels = make_labels((4,), 37, device=device)
    _, entropy = fastppo.token_logprobs(logits, labels, return_entropy=True, backend=backend)
    entropy.sum().backward()
    ref_logits = logits.detach().double().requires_grad_()
    logprobs_oracle(ref_logits, labels)[1].sum().backward()
    assert_grad_close(logits.grad, ref_logits.grad, torch.float32)


def test_logp_alone_ignores_entropy(backend, device):
    logits = torch.randn(5, 29, device=device, requires_grad=True)
    labels = make_labels((5,), 29, device=device)
    logp = fastppo.token_logprobs(logits, labels, backend=backend)
    assert isinstance(logp, torch.Tensor) and logp.shape == (5,)
    logp.sum().backward()
    ref_logits = logits.detach().double().requires_grad_()
    logprobs_oracle(ref_logits, labels)[0].sum().backward()
    assert_grad_close(logits.grad, ref_logits.grad, torch.float32)


def test_peaked_row(backend, device):
    # One logit 50 above the rest: log-prob <= 0 and ~0; entropy ~1e-17 and its gradient too.
    logits = torch.randn(4, 1000, device=device)
    labels = torch.tensor([3, 999, 0, 500], device=device)
    logits[torch.arange(4), labels] += 50.0
    x = logits.clone().requires_grad_()
    logp, entropy = fastppo.token_logprobs(x, labels, return_entropy=True, backend=backend)
    ref_logp, ref_entropy = logprobs_oracle(logits, labels)
    assert (logp <= 0).all() and (logp > -1e-6).all()
    assert_values_close(logp, ref_logp, torch.float32, logit_scale=55)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-4, atol=0)
    g_logp, g_entropy = torch.randn(4, device=device), torch.randn(4, device=device)
    (logp * g_logp + entropy * g_entropy).sum().backward()
    assert_grad_close(x.grad, logprobs_grad_oracle(logits, labels, g_logp, g_entropy), torch.float32)


def test_huge_logits(backend, device):
    logits = torch.randn(3, 300, device=device) * 1e4
    check_op(logits, make_labels((3,), 300, device=device), backend)


def test_negative_infinity_logits(backend, device):
    # A vocabulary mask: half of each row is -inf, the labels sit in the allowed half.
    logits = torch.randn(4, 50, device=device)
    logits[:, 25:] = float("-inf")
    labels = torch.tensor([0, 24, 7, 13], device=device)
    logp, entropy, grad = check_op(logits, labels, backend, logit_scale=4.0)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert (grad[:, 25:] == 0).all()


def test_ignored_rows_are_zero_with_zero_gradient(backend, device):
    logits = torch.randn(2, 4, 19, device=device, requires_grad=True)
    labels = torch.randint(0, 19, (2, 4), device=device)
    labels[0, 1] = labels[1, 3] = 7  # a custom ignore_index that is also a valid token id
    logp, entropy = fastppo.token_logprobs(logits, labels, ignore_index=7, return_entropy=True, backend=backend)
    assert logp[0, 1] == 0 and logp[1, 3] == 0 and entropy[0, 1] == 0 and entropy[1, 3] == 0
    (logp.sum() + entropy.sum()).backward()
    assert (logits.grad[0, 1] == 0).all() and (logits.grad[1, 3] == 0).all()
    assert (logits.grad[0, 0] != 0).any()


def test_all_rows_ignored(backend, device):
    logits = torch.randn(3, 11, device=device, requires_grad=True)
    labels = torch.full((3,), -100, device=device)
    logp, entropy = fastppo.token_logprobs(logits, labels, return_entropy=True, backend=backend)
    assert (logp == 0).all() and (entropy == 0).all()
    (logp.sum() + entropy.sum()).backward()
    assert (logits.grad == 0).all()


@pytest.mark.parametrize("shape", [(3, 1), (3, 5)], ids=["per-sequence", "per-token"])
def test_tensor_temperature(backend, device, shape):
    logits = torch.randn(3, 5, 41, device=device) * 3
    temperature = torch.rand(shape, device=device) + 0.5
    check_op(logits, make_labels((3, 5), 41, device=device), backend, temperature=temperature)


def test_non_contiguous_inputs(backend, device):
    # The usual shift: logits[:, :-1] predicts input_ids[:, 1:]; both are strided views.
    full = torch.randn(2, 6, 45, device=device)
    ids = torch.randint(0, 45, (2, 6), device=device)
    check_op(full[:, :-1], ids[:, 1:], backend)
    # Vocabulary not the innermost dimension.
    check_op(torch.randn(3, 45, 4, device=device).transpose(1, 2), torch.randint(0, 45, (3, 4), device=device), backend)


@pytest.mark.slow  # 70,000 rows through the Triton interpreter: about 20 s on 2 cores
def test_more_rows_than_a_grid_dimension(backend, device):
    N = 65_537 + 100
    logits = torch.randn(N, 3, device=device)
    labels = torch.randint(0, 3, (N,), device=device)
    check_op(logits, labels, backend)


def test_empty_input(backend, device):
    logits = torch.randn(0, 7, device=device, requires_grad=True)
    logp = fastppo.token_logprobs(logits, torch.zeros(0, dtype=torch.long, device=device), backend=backend)
    assert logp.shape == (0,)
    logp.sum().backward()
    assert logits.grad.shape == (0, 7)


def test_out_of_range_labels_give_nan(backend, device, monkeypatch):
    logits = torch.randn(4, 10, device=device, requires_grad=True)
    labels = torch.tensor([1, 10, -1, 9], device=device)
    logp = fastppo.token_logprobs(logits, labels, backend=backend)
    assert torch.isnan(logp[1]) and torch.isnan(logp[2])
    assert torch.isfinite(logp[0]) and torch.isfinite(logp[3])
    logp[[0, 3]].sum().backward()
    assert torch.isnan(logits.grad[1]).all() and torch.isfinite(logits.grad[[0, 3]]).all()

    monkeypatch.setenv("FASTPPO_CHECK", "1")
    with pytest.raises(ValueError, match="labels has 2 value"):
        fastppo.token_logprobs(logits, labels, backend=backend)


def test_twin_chunk_boundaries(device, monkeypatch):
    # Chunks smaller than a row, than a sequence, and spanning several sequences.
    logits = torch.randn(3, 7, 23, device=device)
    labels = make_labels((3, 7), 23, device=device)
    for elements in (10, 23 * 3, 23 * 15):
        monkeypatch.setattr(token_logprobs_torch, "ROW_CHUNK_ELEMENTS", elements)
        check_op(logits, labels, "torch", temperature=torch.rand(3, 1, device=device) + 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inplace_backward_writes_the_gradient_over_the_logits(backend, device, dtype):
    torch.manual_seed(0)
    values = (torch.randn(3, 5, 300, device=device) * 3).to(dtype)
    labels = make_labels((3, 5), 300, device=device)
    g_logp, g_entropy = torch.randn(3, 5, device=device), torch.randn(3, 5, device=device)

    def run(inplace):
        leaf = values.clone().requires_grad_()
        logits = leaf * 1  # an intermediate with its own storage, as an LM head's output
        seen = []
        logits.register_hook(seen.append)
        logp, entropy = fastppo.token_logprobs(
            logits, labels, temperature=0.7, return_entropy=True, inplace_backward=inplace, backend=backend
        )
        (logp * g_logp + entropy * g_entropy).sum().backward()
        return logp, entropy, leaf.grad, seen[0].data_ptr() == logits.data_ptr()

    logp, entropy, grad, shared = run(inplace=False)
    logp_in, entropy_in, grad_in, shared_in = run(inplace=True)
    assert shared_in and not shared  # the gradient lives in the logits' own storage
    for a, b in ((logp, logp_in), (entropy, entropy_in), (grad, grad_in)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_inplace_backward_must_be_a_bool():
    with pytest.raises(TypeError, match="inplace_backward"):
        fastppo.token_logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), inplace_backward="yes")
