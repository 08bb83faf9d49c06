"""Bad input raises a clear error naming the argument, before any kernel runs."""

import pytest
import torch

import fastppo
from fastppo.ops.dispatch import resolve_backend

V, H = 11, 6


def logits_call(**overrides):
    args = dict(logits=torch.randn(2, 3, V), labels=torch.randint(0, V, (2, 3)))
    args.update(overrides)
    return fastppo.token_logprobs(args.pop("logits"), args.pop("labels"), **args)


def from_hidden_call(**overrides):
    args = dict(hidden=torch.randn(2, 3, H), weight=torch.randn(V, H), labels=torch.randint(0, V, (2, 3)))
    args.update(overrides)
    return fastppo.token_logprobs_from_hidden(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


@pytest.mark.parametrize(
    "call,overrides,error,match",
    [
        (
            logits_call,
            dict(labels=torch.randint(0, V, (2, 4))),
            ValueError,
            r"labels must have shape \(2, 3\).*\(2, 4\)",
        ),
        (logits_call, dict(labels=torch.randint(0, V, (3,))), ValueError, "labels must have shape"),
        (logits_call, dict(labels=torch.zeros(2, 3)), TypeError, "labels must be an integer tensor"),
        (logits_call, dict(labels=torch.zeros(2, 3, dtype=torch.bool)), TypeError, "labels must be an integer"),
        (logits_call, dict(logits=torch.randn(2, 3, V).double()), TypeError, "logits must be float32"),
        (logits_call, dict(logits=torch.randint(0, 5, (2, 3, V))), TypeError, "logits must be float32"),
        (logits_call, dict(logits=torch.tensor(1.0)), ValueError, "logits must have at least 1"),
        (logits_call, dict(logits=[1.0, 2.0]), TypeError, "logits must be a torch.Tensor"),
        (logits_call, dict(temperature=0.0), ValueError, "temperature must be positive"),
        (logits_call, dict(temperature=float("nan")), ValueError, "temperature must be positive"),
        (logits_call, dict(temperature="hot"), TypeError, "temperature must be"),
        (logits_call, dict(temperature=torch.ones(3, 3)), ValueError, "temperature of shape"),
        (logits_call, dict(temperature=torch.ones(2, 3, 1)), ValueError, "does not broadcast to the token shape"),
        (
            logits_call,
            dict(temperature=torch.ones(2, 1, dtype=torch.long)),
            TypeError,
            "temperature must be a floating",
        ),
        (logits_call, dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
        (logits_call, dict(backend="cuda"), ValueError, "backend must be one of"),
        (from_hidden_call, dict(weight=torch.randn(V, H + 1)), ValueError, r"weight must have shape \(V, 6\)"),
        (from_hidden_call, dict(weight=torch.randn(V)), ValueError, "weight must have at least 2"),
        (from_hidden_call, dict(weight=torch.randn(V, H).half()), TypeError, "weight has dtype torch.float16"),
        (from_hidden_call, dict(bias=torch.randn(V + 1)), ValueError, r"bias must have shape \(11,\)"),
        (from_hidden_call, dict(bias=torch.randn(V).half()), TypeError, "bias has dtype"),
        (from_hidden_call, dict(labels=torch.randint(0, V, (3, 2))), ValueError, "leading dims of hidden"),
        (from_hidden_call, dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
        (from_hidden_call, dict(chunk_size=2.0), ValueError, "chunk_size must be a positive int"),
    ],
)
def test_bad_input(call, overrides, error, match):
    with pytest.raises(error, match=match):
        call(**overrides)


def test_tensors_on_different_devices():
    meta_labels = torch.zeros(2, 3, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="labels is on meta but logits is on "):
        logits_call(labels=meta_labels)
    with pytest.raises(ValueError, match="weight is on meta but hidden is on "):
        from_hidden_call(weight=torch.randn(V, H, device="meta"))
    with pytest.raises(ValueError, match="temperature is on meta"):
        logits_call(temperature=torch.ones(2, 1, device="meta"))


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")) == "torch"


def test_the_interpreter_of_triton_3_6_with_numpy_2_4_is_refused_by_name(monkeypatch):
    from fastppo.ops import dispatch

    assert dispatch.interpreter_problem((3, 6), (2, 3)) is None
    assert dispatch.interpreter_problem((3, 7), (2, 4)) is None
    problem = dispatch.interpreter_problem((3, 6), (2, 4))
    assert "triton 3.6" in problem and "numpy < 2.4" in problem
    if dispatch.TRITON_INSTALLED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(dispatch, "_version", {"triton": (3, 6), "numpy": (2, 4)}.get)
        with pytest.raises(ValueError, match=r"backend='triton' on cpu: the interpreter of triton 3\.6 needs numpy"):
            resolve_backend("triton", torch.device("cpu"))


def test_value_checks_on_request(monkeypatch):
    monkeypatch.setenv("FASTPPO_CHECK", "1")
    with pytest.raises(ValueError, match=r"outside \[0, 11\)"):
        from_hidden_call(labels=torch.full((2, 3), V))
    with pytest.raises(ValueError, match="temperature must be positive and finite everywhere"):
        logits_call(temperature=torch.tensor([[1.0], [-1.0]]))
    logits_call(labels=torch.full((2, 3), -100))  # ignore_index is never out of range


def test_an_empty_vocabulary_is_refused_before_any_kernel(backend):
    with pytest.raises(ValueError, match="logits has a vocabulary of 0 entries"):
        fastppo.token_logprobs(torch.randn(2, 3, 0), torch.zeros(2, 3, dtype=torch.long), backend=backend)
    with pytest.raises(ValueError, match="weight has a vocabulary of 0 entries"):
        from_hidden_call(weight=torch.randn(0, H), labels=torch.zeros(2, 3, dtype=torch.long), backend=backend)


def test_bool_labels_are_no_token_ids():
    mask, x = torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 3)
    labels = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="labels must be an integer tensor, got torch.bool"):
        fastppo.ppo_loss_from_logits(torch.randn(2, 3, V), labels, x, x, mask)
    with pytest.raises(TypeError, match="labels must be an integer tensor, got torch.bool"):
        fastppo.ppo_loss_from_hidden(torch.randn(2, 3, H), torch.randn(V, H), labels, x, x, mask)


def test_missing_or_wrong_kind_of_tensors_in_the_advantage_ops():
    x, mask = torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="ref_logprobs must be a torch.Tensor, got NoneType"):
        fastppo.token_rewards(torch.randn(2), x, None, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef must be a finite number"):
        fastppo.token_rewards(torch.randn(2), x, x, mask, kl_coef=float("nan"))
    with pytest.raises(TypeError, match="logprobs must be a torch.Tensor, got list"):
        fastppo.kl_penalty([0.1, 0.2], x[0, :2])
    with pytest.raises(TypeError, match="ref_logprobs must be a floating tensor"):
        fastppo.kl_penalty(x, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="mask must be bool or hold 0/1 numbers"):
        fastppo.gae(x, x, torch.ones(2, 3, dtype=torch.complex64))


@pytest.mark.parametrize(
    "call",
    [
        lambda: fastppo.masked_whiten(torch.randn(4), torch.ones(4, dtype=torch.bool), eps=float("nan")),
        lambda: fastppo.group_advantages(torch.randn(4), 2, eps=-1.0),
        lambda: fastppo.group_advantages(torch.randn(4), 2, eps=True),
    ],
)
def test_advantage_epsilons_are_finite_and_not_negative(call):
    with pytest.raises(ValueError, match="eps must be"):
        call()


def test_numpy_numbers_are_numbers():
    """``np.float32(0.5)`` is a temperature, a clip range or a discount like 0.5 itself."""
    import numpy

    torch.manual_seed(0)
    logits, labels = torch.randn(4, 7), torch.randint(0, 7, (4,))
    assert torch.equal(
        fastppo.token_logprobs(logits, labels, temperature=numpy.float32(0.5)),
        fastppo.token_logprobs(logits, labels, temperature=0.5),
    )
    drawn = [
        fastppo.sample_tokens(logits, temperature=t, top_p=p, seed=3)[0]
        for t, p in ((numpy.float32(0.5), numpy.float64(0.9)), (0.5, 0.9))
    ]
    assert torch.equal(*drawn)
    logp, old, adv, mask = -torch.rand(2, 3), -torch.rand(2, 3), torch.randn(2, 3), torch.ones(2, 3)
    assert torch.equal(
        fastppo.ppo_policy_loss(logp, old, adv, mask, clip_eps=numpy.float32(0.25))[0],
        fastppo.ppo_policy_loss(logp, old, adv, mask, clip_eps=0.25)[0],
    )
    assert torch.equal(
        fastppo.gae(adv, old, mask, gamma=numpy.float32(0.5), lam=numpy.int64(1))[0],
        fastppo.gae(adv, old, mask, gamma=0.5, lam=1)[0],
    )
