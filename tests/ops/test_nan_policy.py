"""The NaN policy, op by op, on both backends.

Whatever sits at a masked or ignored position (NaN, inf, garbage) changes neither the values nor
the gradients of anything, and the gradient there is exactly 0. A NaN or out-of-range input at a
valid position (a NaN log-prob, an out-of-range label, a device temperature <= 0, a mask value that is
not 0 or 1) gives NaN, never a finite number; with ``FASTPPO_CHECK=1`` the bad values that need
a look at the data are a ``ValueError`` naming the argument instead.
"""

import pytest
import torch

import fastppo

B, T, V, H = 3, 6, 29, 8
POISONS = [float("nan"), float("inf"), float("-inf")]


def batch():
    mask = torch.rand(B, T) > 0.4
    mask[0, :2] = True
    mask[2] = False  # a fully masked row
    logp = -torch.rand(B, T) * 3
    return dict(
        mask=mask,
        logp=logp,
        old=logp + torch.randn(B, T) * 0.3,
        adv=torch.randn(B, T),
        ref=logp + torch.randn(B, T) * 0.5,
        entropy=torch.rand(B, T) * 2,
        values=torch.randn(B, T),
        returns=torch.randn(B, T),
        rewards=torch.randn(B, T),
        labels=torch.randint(0, V, (B, T)),
        logits=torch.randn(B, T, V),
        hidden=torch.randn(B, T, H),
        weight=torch.randn(V, H) / H**0.5,
        scores=torch.randn(B),
    )


def poisoned(t: dict, poison: float) -> dict:
    """``t`` with every token tensor's masked positions replaced by ``poison`` (labels by -7)."""
    masked = ~t["mask"]
    out = dict(t)
    for name, x in t.items():
        if name in ("mask", "weight", "scores"):
            continue
        where = masked.view(B, T, *([1] * (x.dim() - 2))).expand_as(x)
        out[name] = x.masked_fill(where, -7 if name == "labels" else poison)
    return out


def with_grads(t: dict, names) -> dict:
    return {k: v.clone().requires_grad_() if k in names else v for k, v in t.items()}


# op name -> (call(t, backend) -> tuple of outputs, the inputs that get gradients)
OPS = {
    "ppo_policy_loss": (
        lambda t, b: fastppo.ppo_policy_loss(
            t["logp"],
            t["old"],
            t["adv"],
            t["mask"],
            ref_logprobs=t["ref"],
            entropy=t["entropy"],
            kl_coef=0.1,
            entropy_coef=0.01,
            dual_clip=3.0,
            backend=b,
        )[:1],
        ["logp", "entropy"],
    ),
    "ppo_loss_from_logits": (
        lambda t, b: fastppo.ppo_loss_from_logits(
            t["logits"],
            t["labels"],
            t["old"],
            t["adv"],
            t["mask"],
            ref_logprobs=t["ref"],
            kl_coef=0.1,
            entropy_coef=0.01,
            backend=b,
        )[:1],
        ["logits"],
    ),
    "ppo_loss_from_hidden": (
        lambda t, b: fastppo.ppo_loss_from_hidden(
            t["hidden"],
            t["weight"],
            t["labels"],
            t["old"],
            t["adv"],
            t["mask"],
            ref_logprobs=t["ref"],
            kl_coef=0.1,
            entropy_coef=0.01,
            chunk_size=4,
            backend=b,
        )[:1],
        ["hidden", "weight"],
    ),
    "token_logprobs": (
        lambda t, b: fastppo.token_logprobs(
            t["logits"], t["labels"].masked_fill(~t["mask"], -100), return_entropy=True, backend=b
        ),
        ["logits"],
    ),
    "token_logprobs_from_hidden": (
        lambda t, b: fastppo.token_logprobs_from_hidden(
            t["hidden"],
            t["weight"],
            t["labels"].masked_fill(~t["mask"], -100),
            return_entropy=True,
            chunk_size=4,
            backend=b,
        ),
        ["hidden", "weight"],
    ),
    "value_loss": (lambda t, b: fastppo.value_loss(t["values"], t["old"], t["returns"], t["mask"])[:1], ["values"]),
    "gae": (lambda t, b: fastppo.gae(t["rewards"], t["values"], t["mask"], gamma=0.9, lam=0.8, backend=b), []),
    "masked_whiten": (lambda t, b: (fastppo.masked_whiten(t["adv"], t["mask"]),), []),
    "token_rewards": (
        lambda t, b: (
            fastppo.token_rewards(t["scores"], t["logp"], t["ref"], t["mask"], kl_coef=0.1, kl_estimator="k3"),
        ),
        ["logp"],
    ),
}


def run(name, t, backend):
    call, grad_names = OPS[name]
    t = with_grads(t, grad_names)
    outs = call(t, backend)
    if grad_names:
        torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
    return [o.detach() for o in outs], {k: t[k].grad for k in grad_names}


@pytest.mark.parametrize("poison", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", list(OPS))
def test_masked_positions_change_nothing(name, poison, backend):
    clean = batch()
    values, grads = run(name, clean, backend)
    poisoned_values, poisoned_grads = run(name, poisoned(clean, poison), backend)
    for a, b in zip(values, poisoned_values):
        assert torch.isfinite(b).all(), f"{name}: a masked {poison} leaked into the values"
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    for k, g in poisoned_grads.items():
        assert torch.isfinite(g).all(), f"{name}: a masked {poison} leaked into d/d{k}"
        torch.testing.assert_close(g, grads[k], rtol=1e-6, atol=1e-6)
        if k != "weight":  # a token tensor: its masked positions get exactly zero gradient
            masked = ~clean["mask"].view(B, T, *([1] * (g.dim() - 2))).expand_as(g)
            assert (g[masked] == 0).all()


# op name -> how to put one bad value at a valid position (the first token, valid in batch())
VALID_NAN = {
    "ppo_policy_loss": [("logp", float("nan")), ("old", float("nan")), ("adv", float("nan")), ("ref", float("nan"))],
    # -100 is ignore_index only where the mask is off: the mask decides
    "ppo_loss_from_logits": [
        ("labels", V),
        ("labels", -1),
        ("labels", -100),
        ("old", float("nan")),
        ("ref", float("nan")),
        ("logits", float("nan")),
    ],
    "ppo_loss_from_hidden": [
        ("labels", V),
        ("labels", -100),
        ("old", float("nan")),
        ("ref", float("nan")),
        ("hidden", float("nan")),
    ],
    "token_logprobs": [("logits", float("nan")), ("labels", V)],
    "token_logprobs_from_hidden": [("hidden", float("nan")), ("labels", V)],
    "value_loss": [("values", float("nan")), ("old", float("nan")), ("returns", float("nan"))],
    "gae": [("rewards", float("nan")), ("values", float("nan"))],
    "masked_whiten": [("adv", float("nan"))],
    "token_rewards": [("logp", float("nan")), ("ref", float("nan"))],
}


@pytest.mark.parametrize("name,field,bad", [(n, f, v) for n, cases in VALID_NAN.items() for f, v in cases])
def test_a_bad_value_at_a_valid_position_is_nan(name, field, bad, backend):
    t = batch()
    x = t[field].clone()
    x[0, 0] = bad  # the whole row of logits or hidden states for those fields
    t[field] = x
    values, _ = run(name, t, backend)
    assert torch.isnan(values[0]).any(), f"{name}: {field}={bad} at a valid position gave a finite result"


@pytest.mark.parametrize("name", ["ppo_loss_from_logits", "ppo_loss_from_hidden"])
def test_ignore_index_at_a_valid_position_is_an_error_under_checks(name, backend, monkeypatch):
    t = batch()
    t["labels"] = t["labels"].clone()
    t["labels"][0, 0] = -100  # valid in batch()
    monkeypatch.setenv("FASTPPO_CHECK", "1")
    with pytest.raises(ValueError, match=r"labels holds -100 \(ignore_index\) at 1 position\(s\) the mask says"):
        run(name, t, backend)


MASKED_OPS = [
    "ppo_policy_loss",
    "ppo_loss_from_logits",
    "ppo_loss_from_hidden",
    "value_loss",
    "gae",
    "masked_whiten",
    "token_rewards",
]


@pytest.mark.parametrize("value", [0.5, float("nan"), -1.0, 2.0])
@pytest.mark.parametrize("name", MASKED_OPS)
def test_a_mask_that_is_not_0_or_1(name, value, backend, monkeypatch):
    t = batch()
    mask = t["mask"].float()
    mask[0, 0] = value
    t["mask"] = mask
    call, _ = OPS[name]
    values = call(t, backend)
    assert torch.isnan(values[0]).any(), f"{name}: mask value {value} gave a finite result"
    monkeypatch.setenv("FASTPPO_CHECK", "1")
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        call(t, backend)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64, torch.bool])
def test_masks_of_0_and_1_in_any_dtype_agree(mask_dtype, backend):
    t = batch()
    expected = run("ppo_loss_from_hidden", t, backend)
    t["mask"] = t["mask"].to(mask_dtype)
    got = run("ppo_loss_from_hidden", t, backend)
    torch.testing.assert_close(got[0][0], expected[0][0])


@pytest.mark.parametrize("temperature", [0.0, -0.5, float("nan"), float("inf")])
def test_a_temperature_that_is_not_positive_and_finite_is_refused_where_checking_is_free(temperature, backend):
    logits, labels = torch.randn(3, V), torch.randint(0, V, (3,))
    per_row = torch.tensor([1.0, temperature, 0.7])  # on the CPU: no device to wait for
    with pytest.raises(ValueError, match="temperature must be positive and finite everywhere"):
        fastppo.token_logprobs(logits, labels, temperature=per_row, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, -0.5, float("nan"), float("inf")])
def test_on_a_device_such_a_temperature_gives_nan_in_its_row_and_an_error_on_request(temperature, monkeypatch):
    logits, labels = torch.randn(3, V, device="cuda"), torch.randint(0, V, (3,), device="cuda")
    per_row = torch.tensor([1.0, temperature, 0.7], device="cuda")
    logp = fastppo.token_logprobs(logits, labels, temperature=per_row)
    assert torch.isnan(logp[1]) and torch.isfinite(logp[[0, 2]]).all()
    monkeypatch.setenv("FASTPPO_CHECK", "1")
    with pytest.raises(ValueError, match="temperature must be positive and finite everywhere"):
        fastppo.token_logprobs(logits, labels, temperature=per_row)
