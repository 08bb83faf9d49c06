"""No kernel reads outside its tensors: every Triton op, on views into NaN-filled buffers, with
sizes that are not multiples of the kernels' blocks, under the interpreter's bounds checker."""

import pytest
import torch

import fastppo
from tests.kernels.bounds import reads_within_arguments

triton = pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("the bounds checker watches the Triton interpreter, which runs without a GPU", allow_module_level=True)


def padded(x: torch.Tensor, before: int = 64, after: int = 64) -> torch.Tensor:
    """``x`` as a view into a larger buffer of NaN (-1 for integers): memory on both sides is poison."""
    fill = float("nan") if x.is_floating_point() else -1
    buffer = torch.full((before + x.numel() + after,), fill, dtype=x.dtype)
    buffer[before : before + x.numel()] = x.reshape(-1)
    return buffer[before : before + x.numel()].view(x.shape)


@triton.jit
def _reads_one_before(x_ptr, out_ptr):
    import triton.language as tl

    tl.store(out_ptr, tl.load(x_ptr - 1))


def test_the_checker_sees_a_read_before_the_tensor():
    x, out = padded(torch.ones(4)), torch.empty(1)
    with reads_within_arguments() as violations:
        _reads_one_before[(1,)](x, out)
    assert violations and "4 bytes before its start" in violations[0]


@pytest.mark.parametrize("B,T", [(3, 1000), (2, 1025), (5, 7), (1, 1)])
def test_gae_reads_only_its_rows(B, T):
    rewards, values = padded(torch.randn(B, T)), padded(torch.randn(B, T))
    mask = padded(torch.rand(B, T) > 0.2)
    with reads_within_arguments() as violations:
        advantages, _ = fastppo.gae(rewards, values, mask, gamma=0.9, lam=0.8, backend="triton")
    assert violations == []
    expected, _ = fastppo.gae(rewards.clone(), values.clone(), mask.clone(), gamma=0.9, lam=0.8, backend="torch")
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-5)


def test_loss_head_kernels_read_only_their_tensors():
    N, V, H = 37, 45, 8
    mask = padded(torch.rand(N) > 0.3)
    labels, old, adv = padded(torch.randint(0, V, (N,))), padded(-torch.rand(N)), padded(torch.randn(N))
    logits = padded(torch.randn(N, V)).requires_grad_()
    hidden, weight = padded(torch.randn(N, H)).requires_grad_(), padded(torch.randn(V, H)).requires_grad_()
    with reads_within_arguments() as violations:
        loss, _ = fastppo.ppo_loss_from_logits(
            logits,
            labels,
            old,
            adv,
            mask,
            ref_logprobs=old,
            kl_coef=0.1,
            temperature=padded(torch.rand(N) + 0.5),
            backend="triton",
        )
        loss.backward()
        loss, _ = fastppo.ppo_loss_from_hidden(hidden, weight, labels, old, adv, mask, chunk_size=16, backend="triton")
        loss.backward()
        logp = fastppo.token_logprobs_from_hidden(hidden, weight, labels, chunk_size=16, backend="triton")
        logp.sum().backward()
        fastppo.sample_tokens(logits.detach()[:5], temperature=0.8, seed=1, backend="triton")
    assert violations == []
