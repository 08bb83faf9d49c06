"""Inputs the differential cases are built from: shapes, masks, log-probs, and the adversarial ones.

Every builder draws from the ``torch.Generator`` it is given, so a case rebuilt from its seed is
the same tensors again (the peer and the drop-in each get their own copy).
"""

import itertools

import torch

MASKS = ("random", "full", "empty-row", "all-masked", "spans", "one-token")
# (mask kind, gamma, lambda) for the GAE cases of every peer
GAE_GRID = tuple(
    itertools.product(("random", "full", "spans", "empty-row", "one-token"), (1.0, 0.99, 0.5), (1.0, 0.95, 0.0))
)


def mask(g: torch.Generator, B: int, T: int, kind: str, dtype=torch.float32) -> torch.Tensor:
    """A ``(B, T)`` 0/1 mask: random, all ones, a row with nothing valid, nothing valid at all,
    multi-turn spans (valid runs separated by masked observation spans), or one valid token per row."""
    if kind == "full":
        m = torch.ones(B, T)
    elif kind == "all-masked":
        m = torch.zeros(B, T)
    elif kind == "one-token":
        m = torch.zeros(B, T)
        m[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = 1
    elif kind == "spans":
        m = torch.zeros(B, T)
        for row in range(B):
            t = 0
            while t < T:
                run = int(torch.randint(1, max(2, T // 3), (1,), generator=g))
                gap = int(torch.randint(1, max(2, T // 4), (1,), generator=g))
                m[row, t : t + run] = 1
                t += run + gap
    else:
        m = (torch.rand(B, T, generator=g) > 0.3).float()
        m[:, 0] = 1  # a response starts with a valid token
        if kind == "empty-row":
            m[int(torch.randint(0, B, (1,), generator=g))] = 0
    return m.to(dtype)


def log_probs(g: torch.Generator, *shape, scale: float = 3.0) -> torch.Tensor:
    """Log-probs of sampled tokens: ``-U(0, scale)``."""
    return -torch.rand(*shape, generator=g) * scale


def normal(g: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def with_garbage(x: torch.Tensor, m: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``x`` with NaN, inf and huge values at masked positions (valid ones untouched)."""
    choices = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    junk = choices[torch.randint(0, len(choices), x.shape, generator=g)].to(x.dtype)
    return torch.where(m.bool(), x, junk)


def zero_masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x`` with 0 at masked positions; differentiable (zero gradient there)."""
    return torch.where(m.bool(), x, torch.zeros((), dtype=x.dtype))


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def logits(g: torch.Generator, *shape, kind: str = "random") -> torch.Tensor:
    """Logits with adversarial rows: ``peaked`` (one logit 50 above the rest), ``neg-inf`` (some
    logits -inf), ``large`` (magnitudes in the hundreds), or plain ``random``."""
    z = torch.randn(*shape, generator=g) * 3
    V = shape[-1]
    if kind == "peaked":
        z[..., int(torch.randint(0, V, (1,), generator=g))] += 50.0
    elif kind == "neg-inf" and V > 1:
        z = z.masked_fill(torch.rand(*shape, generator=g) < 0.3, -float("inf"))
        z[..., 0] = 0.0  # at least one finite logit per row
    elif kind == "large":
        z = z * 100
    return z


def labels(g: torch.Generator, *shape, V: int) -> torch.Tensor:
    """Labels, with 0 and V - 1 among them."""
    y = torch.randint(0, V, shape, generator=g)
    flat = y.view(-1)
    flat[0] = 0
    flat[-1] = V - 1
    return y
