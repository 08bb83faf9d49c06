"""ppo_loss_from_logits and ppo_loss_from_hidden: same answers as the unfused path and the oracle."""

import pytest
import torch

import fastppo
from tests.conftest import BACKENDS_KERNEL_SLOW
from tests.ops.inputs import OPTIONS, make_inputs
from tests.oracles import logprobs_oracle, ppo_loss_oracle, relative_error


def oracle(logits, labels, old, adv, ref, mask, temperature=1.0):
    logp, entropy = logprobs_oracle(logits, labels.clamp(min=0), temperature)
    return ppo_loss_oracle(logp, old, adv, mask, ref=ref, entropy=entropy, **OPTIONS)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_three_entry_points_agree_with_the_oracle(backend, temperature):
    hidden, weight, labels, old, adv, ref, mask = make_inputs()
    logits = (hidden @ weight.T).requires_grad_()

    safe_labels = torch.where(mask, labels, -100)
    logp, entropy = fastppo.token_logprobs(
        logits, safe_labels, temperature=temperature, return_entropy=True, backend=backend
    )
    loss_a, stats_a = fastppo.ppo_policy_loss(
        logp, old, adv, mask, ref_logprobs=ref, entropy=entropy, backend=backend, **OPTIONS
    )
    (grad_a,) = torch.autograd.grad(loss_a, logits)

    loss_b, stats_b = fastppo.ppo_loss_from_logits(
        logits, labels, old, adv, mask, ref_logprobs=ref, temperature=temperature, backend=backend, **OPTIONS
    )
    (grad_b,) = torch.autograd.grad(loss_b, logits)

    overwritten = logits.detach().clone().requires_grad_()
    loss_d, _ = fastppo.ppo_loss_from_logits(
        overwritten * 1,
        labels,
        old,
        adv,
        mask,
        ref_logprobs=ref,
        temperature=temperature,
        inplace_backward=True,
        backend=backend,
        **OPTIONS,
    )
    (grad_d,) = torch.autograd.grad(loss_d, overwritten)
    torch.testing.assert_close(loss_d, loss_b, rtol=0, atol=0)
    torch.testing.assert_close(grad_d, grad_b, rtol=0, atol=0)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_c, stats_c = fastppo.ppo_loss_from_hidden(
        h,
        w,
        labels,
        old,
        adv,
        mask,
        ref_logprobs=ref,
        chunk_size=4,
        temperature=temperature,
        backend=backend,
        **OPTIONS,
    )
    loss_c.backward()

    ref_logits = logits.detach().double().requires_grad_()
    ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    expected, expected_stats = oracle(ref_logits, labels, old, adv, ref, mask, temperature)
    expected_from_hidden, _ = oracle(ref_h @ ref_w.T, labels, old, adv, ref, mask, temperature)
    expected.backward()
    expected_from_hidden.backward()

    for loss in (loss_a, loss_b, loss_c):
        torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    for stats in (stats_a, stats_b, stats_c):
        assert set(stats) == set(expected_stats)
        for name in stats:
            torch.testing.assert_close(stats[name].double(), expected_stats[name].double(), rtol=1e-5, atol=1e-6)
    for grad in (grad_a, grad_b):
        assert relative_error(grad, ref_logits.grad) <= 1e-5
    assert relative_error(h.grad, ref_h.grad) <= 1e-5
    assert relative_error(w.grad, ref_w.grad) <= 1e-5


def test_bf16_logits(backend):
    hidden, weight, labels, old, adv, ref, mask = make_inputs()
    logits = (hidden @ weight.T).bfloat16().requires_grad_()
    loss, _ = fastppo.ppo_loss_from_logits(logits, labels, old, adv, mask, ref_logprobs=ref, backend=backend, **OPTIONS)
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    ref_logits = logits.detach().double().requires_grad_()
    expected, _ = oracle(ref_logits, labels, old, adv, ref, mask)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-4, atol=1e-5)
    assert relative_error(logits.grad, ref_logits.grad) <= 1e-2


def test_masked_positions_pass_no_gradient(backend):
    hidden, weight, labels, old, adv, ref, mask = make_inputs()
    logits = (hidden @ weight.T).requires_grad_()
    loss, _ = fastppo.ppo_loss_from_logits(logits, labels, old, adv, mask, backend=backend, entropy_coef=0.1)
    loss.backward()
    assert (logits.grad[~mask] == 0).all() and (logits.grad[mask] != 0).any()


def test_entropy_is_computed_not_passed():
    hidden, weight, labels, old, adv, ref, mask = make_inputs()
    with pytest.raises(TypeError, match="computes the entropy itself"):
        fastppo.ppo_loss_from_logits(hidden @ weight.T, labels, old, adv, mask, entropy=torch.zeros_like(old))
    with pytest.raises(ValueError, match="mask has shape"):
        fastppo.ppo_loss_from_hidden(hidden, weight, labels, old, adv, mask[:, :-1])


def hidden_loss(hidden, weight, labels, old, adv, ref, mask, bias=None, **extra):
    return fastppo.ppo_loss_from_hidden(
        hidden, weight, labels, old, adv, mask, bias=bias, ref_logprobs=ref, **{**OPTIONS, **extra}
    )


def test_from_hidden_bf16_bias_and_upstream_scale(backend):
    hidden, weight, labels, old, adv, ref, mask = make_inputs(dtype=torch.bfloat16)
    bias = torch.randn(weight.shape[0]).bfloat16()
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss, _ = hidden_loss(*leaves[:2], labels, old, adv, ref, mask, bias=leaves[2], chunk_size=5, backend=backend)
    (3.0 * loss).backward()  # the upstream gradient is folded in by the backward
    refs = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    expected, _ = oracle(refs[0] @ refs[1].T + refs[2], labels, old, adv, ref, mask)
    (3.0 * expected).backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-4, atol=1e-5)
    for leaf, want in zip(leaves, refs):
        assert leaf.grad.dtype == torch.bfloat16
        assert relative_error(leaf.grad, want.grad) <= 1e-2


def test_from_hidden_without_autograd_gives_the_same_loss(backend):
    hidden, weight, labels, old, adv, ref, mask = make_inputs()
    with_grad, stats = hidden_loss(hidden.requires_grad_(), weight, labels, old, adv, ref, mask, backend=backend)
    with torch.no_grad():
        without, stats_no_grad = hidden_loss(hidden, weight, labels, old, adv, ref, mask, backend=backend)
    torch.testing.assert_close(with_grad.detach(), without)
    for name in stats:
        torch.testing.assert_close(stats[name], stats_no_grad[name])


@pytest.mark.parametrize("backend", BACKENDS_KERNEL_SLOW)  # the interpreter: ~20 s
def test_from_hidden_memory_is_bounded_by_the_chunk(backend, device):
    from fastppo.bench.measure import LiveBytes

    if device.type == "cuda":
        pytest.skip("the dispatch-mode probe runs the CPU implementation")
    N, H, V, chunk = 512, 8, 1000, 32
    hidden, weight = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    labels, old, adv = torch.randint(0, V, (N,)), -torch.rand(N) * 5, torch.randn(N)
    with LiveBytes() as mode:
        loss, _ = fastppo.ppo_loss_from_hidden(
            hidden,
            weight,
            labels,
            old,
            adv,
            torch.ones(N, dtype=torch.bool),
            chunk_size=chunk,
            entropy_coef=0.01,
            backend=backend,
        )
        loss.backward()
    assert mode.largest == chunk * V * 4 and mode.largest * 10 < N * V * 4
