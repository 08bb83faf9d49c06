"""Choosing the next token from logits: greedy, temperature, top-k, top-p, with its log-prob.

Sampling is Gumbel-max: ``argmax(z + g)`` with ``g = -log(-log(u))`` draws exactly from
``softmax(z)``, needs no normalisation or host sync, and reproduces from a seeded generator.
Top-k and top-p mask the scaled logits before the draw; the returned log-prob is always that of
the full-vocabulary ``softmax(logits / temperature)``, which is what PPO's ratio needs.
"""

from typing import Optional

import torch
from torch import Tensor


def _top_k(z: Tensor, k: int) -> Tensor:
    kth = torch.topk(z, min(k, z.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
    return z.masked_fill(z < kth, float("-inf"))


def _top_p(z: Tensor, p: float) -> Tensor:
    # Keep the smallest set of most likely tokens whose probability reaches p (at least one).
    sorted_z, order = torch.sort(z, dim=-1, descending=True)  # (B, V)
    probs = torch.softmax(sorted_z, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
    drop_sorted = before >= p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return z.masked_fill(drop, float("-inf"))


def sample_tokens(logits: Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  generator: Optional[torch.Generator] = None) -> tuple:
    """``(tokens (B,) int64, logprobs (B,) fp32)`` from ``logits (B, V)``; temperature 0 is greedy."""
    z = logits.float()
    if temperature == 0:
        tokens = z.argmax(dim=-1)
    else:
        z = z / temperature
        candidates = z
        if top_k > 0:
            candidates = _top_k(candidates, top_k)
        if top_p < 1.0:
            candidates = _top_p(candidates, top_p)
        u = torch.rand(z.shape, device=z.device, generator=generator).clamp_(min=1e-20)
        tokens = (candidates - torch.log(-torch.log(u))).argmax(dim=-1)
    logprobs = torch.log_softmax(z, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, logprobs
