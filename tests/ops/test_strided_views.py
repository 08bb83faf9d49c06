"""Every op on every backend gives the same values and gradients for views as for dense copies.

Each token tensor is passed as a strided view into a larger buffer of NaN: a 1-D view such as
``x[:, 0]`` of an ``(N, 2)`` buffer (stride 2, which ``reshape(-1)`` keeps), and an N-D view
with every stride doubled. A kernel that assumed stride 1 would read the NaN beside each value.
"""

import pytest
import torch

import fastppo

V, H = 37, 8


def view_of(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a view whose every stride is doubled; the gaps hold NaN (or -1 for ints)."""
    fill = float("nan") if x.is_floating_point() else -1
    buffer = torch.full((*x.shape, 2), fill, dtype=x.dtype)
    buffer[..., 0] = x
    view = buffer[..., 0]
    assert x.numel() <= 1 or not view.is_contiguous()
    return view


def token_inputs(shape):
    """Token tensors of ``shape`` with holes in the mask (and a valid first token)."""
    mask = torch.rand(shape) > 0.3
    mask.view(-1)[0] = True
    logp = -torch.rand(shape) * 3
    return dict(
        logp=logp,
        old=logp + torch.randn(shape) * 0.3,
        adv=torch.randn(shape),
        ref=logp + torch.randn(shape) * 0.5,
        entropy=torch.rand(shape) * 2,
        mask=mask,
        labels=torch.randint(0, V, shape),
    )


def ppo_policy_loss(t, backend):
    return fastppo.ppo_policy_loss(
        t["logp"],
        t["old"],
        t["adv"],
        t["mask"],
        ref_logprobs=t["ref"],
        entropy=t["entropy"],
        kl_coef=0.1,
        entropy_coef=0.01,
        backend=backend,
    )[0]


def ppo_loss_from_logits(t, backend):
    return fastppo.ppo_loss_from_logits(
        t["logits"],
        t["labels"],
        t["old"],
        t["adv"],
        t["mask"],
        ref_logprobs=t["ref"],
        kl_coef=0.1,
        entropy_coef=0.01,
        backend=backend,
    )[0]


def ppo_loss_from_hidden(t, backend):
    return fastppo.ppo_loss_from_hidden(
        t["hidden"],
        t["weight"],
        t["labels"],
        t["old"],
        t["adv"],
        t["mask"],
        ref_logprobs=t["ref"],
        kl_coef=0.1,
        entropy_coef=0.01,
        chunk_size=3,
        backend=backend,
    )[0]


def token_logprobs(t, backend):
    logp, entropy = fastppo.token_logprobs(
        t["logits"], t["labels"], temperature=t["temperature"], return_entropy=True, backend=backend
    )
    return logp, entropy


def token_logprobs_from_hidden(t, backend):
    return fastppo.token_logprobs_from_hidden(
        t["hidden"],
        t["weight"],
        t["labels"],
        temperature=t["temperature"],
        return_entropy=True,
        chunk_size=3,
        backend=backend,
    )


def value_loss(t, backend):
    return fastppo.value_loss(t["logp"], t["old"], t["adv"], t["mask"])[0]


def gae(t, backend):
    return fastppo.gae(t["adv"], t["logp"], t["mask"], gamma=0.9, lam=0.8, backend=backend)


def masked_whiten(t, backend):
    return fastppo.masked_whiten(t["adv"], t["mask"])


def token_rewards(t, backend):
    return fastppo.token_rewards(t["scores"], t["logp"], t["ref"], t["mask"], kl_coef=0.1)


def sample_tokens(t, backend):
    return fastppo.sample_tokens(t["logits"], temperature=0.7, seed=3, backend=backend)


# op -> (token shapes it takes, names of the inputs that get gradients)
OPS = {
    ppo_policy_loss: ([(20,), (4, 5)], ["logp", "entropy"]),
    ppo_loss_from_logits: ([(20,), (4, 5)], ["logits"]),
    ppo_loss_from_hidden: ([(20,), (4, 5)], ["hidden", "weight"]),
    token_logprobs: ([(20,), (4, 5)], ["logits"]),
    token_logprobs_from_hidden: ([(20,), (4, 5)], ["hidden", "weight"]),
    value_loss: ([(20,), (4, 5)], ["logp"]),
    gae: ([(4, 5)], []),
    masked_whiten: ([(20,), (4, 5)], []),
    token_rewards: ([(4, 5)], []),
    sample_tokens: ([(6,)], []),
}


def inputs(shape):
    t = token_inputs(shape)
    t["logits"] = torch.randn(*shape, V) * 2
    t["hidden"] = torch.randn(*shape, H)
    t["weight"] = torch.randn(V, H) / H**0.5
    t["temperature"] = torch.rand(shape) + 0.5
    t["scores"] = torch.randn(shape[0])
    return t


def run(op, t, backend, grad_names):
    t = {k: v.clone().requires_grad_() if k in grad_names else v for k, v in t.items()}
    out = op(t, backend)
    outs = out if isinstance(out, tuple) else (out,)
    if grad_names:
        torch.autograd.backward(
            [o for o in outs if o.requires_grad], [torch.randn_like(o) * 0 + 1 for o in outs if o.requires_grad]
        )
    return [o.detach() for o in outs], [t[k].grad for k in grad_names]


@pytest.mark.parametrize("op", list(OPS), ids=lambda op: op.__name__)
def test_views_give_what_dense_copies_give(op, backend):
    shapes, grad_names = OPS[op]
    for shape in shapes:
        dense = inputs(shape)
        if op is sample_tokens:
            dense["logits"] = dense["logits"].reshape(shape[0], V)
        strided = {k: view_of(v) if k not in ("weight",) else v for k, v in dense.items()}
        # the weight is no token tensor; a transposed copy is still a strided view worth testing
        strided["weight"] = dense["weight"].t().contiguous().t()
        values, grads = run(op, dense, backend, grad_names)
        strided_values, strided_grads = run(op, strided, backend, grad_names)
        for a, b in zip(values, strided_values):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, equal_nan=False, msg=lambda m: f"{shape}: {m}")
        for name, a, b in zip(grad_names, grads, strided_grads):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=lambda m: f"{shape}, d/d{name}: {m}")
