"""``sample_tokens``: the next token of every row and its log-prob, from logits ``(B, V)``.

The last op of a rollout step. The log-prob returned is always the full-vocabulary
``log_softmax(logits / temperature)[token]``, whatever top-k or top-p allowed, because that is the
behaviour policy PPO's ratio divides by. On CUDA, plain temperature sampling and greedy decoding
run the fused Triton kernel (one read of the logits, no fp32 copies); top-k and top-p, which need
a sort, and every CPU call run the PyTorch twin. Draws are Gumbel-max, keyed by ``seed``: no host
sync, and the same seed on the same backend and device gives the same tokens. The draw is exact
up to fp32's resolution of the uniforms (steps of 2**-24 near 1, which cap the Gumbel noise at
16.6 in natural units): each token's probability is its softmax's but for that cut of the noise's
tail, and the kernel's noise stays finite and accurate there on the GPU's approximate log.
"""

import math

import torch
from torch import Tensor

from . import checks, sample_tokens_torch
from .dispatch import implementation, resolve_backend

SEED_LIMIT = 2**63


def check_sampling_options(temperature, top_k, top_p) -> None:
    """Raise ``ValueError`` naming the first of ``temperature``, ``top_k``, ``top_p`` out of range."""
    if not checks.is_real(temperature) or not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    if not checks.is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def _check_arguments(logits, temperature, top_k, top_p, seed) -> None:
    checks.check_float(logits, "logits", min_dim=2)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must have shape (B, V) with V >= 1, got {tuple(logits.shape)}")
    check_sampling_options(temperature, top_k, top_p)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")


def sample_tokens(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    backend: str = "auto",
) -> tuple:
    """Draw one token per row of ``logits`` ``(B, V)`` from ``softmax(logits / temperature)``.

    Args:
        temperature: 0 decodes greedily (lowest index on ties), and the log-prob is then at
            temperature 1.
        top_k: sample among the k most likely tokens only (0: all).
        top_p: sample among the smallest set of most likely tokens whose probability reaches
            ``top_p`` (1: all).
        seed: keys the draw; use a new one for every step.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``fastppo.ops.dispatch``); the
            Triton kernel does neither top-k nor top-p.

    Returns:
        ``(tokens (B,) int64, logprobs (B,) fp32)``, not differentiable.
    """
    _check_arguments(logits, temperature, top_k, top_p, seed)
    temperature, top_p = float(temperature), float(top_p)  # NumPy's numbers too
    greedy = temperature == 0
    filtered = not greedy and (top_k > 0 or top_p < 1)
    resolved = resolve_backend(backend, logits.device)
    if resolved == "triton" and filtered:
        if backend == "triton":
            raise ValueError("backend='triton' samples without top-k or top-p; use backend='auto' or 'torch'")
        resolved = "torch"
    B = logits.shape[0]
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    inv_temperature = 1.0 if greedy else 1.0 / temperature
    with torch.no_grad():
        if filtered:  # a sort: the twin's alone
            sample_tokens_torch.sample_filtered(
                logits.detach(), inv_temperature, greedy, seed, tokens, logprobs, top_k, top_p
            )
        else:
            implementation(resolved, "sample_tokens").sample_forward(
                logits.detach(), inv_temperature, greedy, seed, tokens, logprobs
            )
    return tokens, logprobs
