"""The ops are custom ops with fake implementations: torch.compile(fullgraph=True) traces them."""

import torch

import fastppo


def loss_fn(logits, labels, hidden, weight):
    logp, entropy = fastppo.token_logprobs(logits, labels, temperature=0.9, return_entropy=True)
    hlogp, hentropy = fastppo.token_logprobs_from_hidden(hidden, weight, labels, return_entropy=True, chunk_size=4)
    mask = labels != -100
    old = logp.detach() - 0.1
    ppo, _ = fastppo.ppo_loss_from_logits(
        logits, labels, old, torch.ones_like(old), mask, kl_coef=0.1, ref_logprobs=old, entropy_coef=0.01
    )
    vf, _ = fastppo.value_loss(hlogp, old, logp.detach(), mask)
    hppo, _ = fastppo.ppo_loss_from_hidden(
        hidden, weight, labels, old, torch.ones_like(old), mask, chunk_size=4, entropy_coef=0.01
    )
    return (logp * 0.5 + entropy * 0.1 + hlogp - hentropy * 0.2).sum() + ppo + vf + hppo


def test_fullgraph_compile_matches_eager():
    labels = torch.randint(0, 31, (2, 5))
    labels[0, 0] = -100
    inputs = [torch.randn(2, 5, 31), labels, torch.randn(2, 5, 8), torch.randn(31, 8)]
    eager_leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    compiled_leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]

    eager = loss_fn(*eager_leaves)
    eager.backward()
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True)(*compiled_leaves)
    compiled.backward()

    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_leaves, eager_leaves):
        if a.is_floating_point():
            torch.testing.assert_close(a.grad, b.grad)


def test_fake_tensors_give_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(3, 4, 50, dtype=torch.bfloat16)
        labels = torch.empty(3, 4, dtype=torch.long)
        logp, entropy = fastppo.token_logprobs(logits, labels, return_entropy=True)
        hlogp = fastppo.token_logprobs_from_hidden(torch.empty(3, 4, 8), torch.empty(50, 8), labels)
    assert logp.shape == entropy.shape == hlogp.shape == (3, 4)
    assert logp.dtype == hlogp.dtype == torch.float32
