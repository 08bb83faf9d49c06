"""PyTorch twin of ``fastppo.kernels.sample_tokens``: the CPU path, and the only one with top-k and top-p.

Same draw as the kernel, Gumbel-max: ``argmax(z + g)`` with ``g = -log(-log(u))`` is an exact
sample from ``softmax(z)``. Top-k and top-p mask the candidates before the draw; the log-prob is
always the full-vocabulary one. Uniforms come from a ``torch.Generator`` seeded with ``seed``, so
a seed reproduces on this backend, with other numbers than the kernel's Philox stream. Rows are
taken in chunks of about ``ROW_CHUNK_ELEMENTS`` logits, so no fp32 copy of all ``(B, V)`` is held.
"""

import torch
from torch import Tensor

from .token_logprobs_torch import ROW_CHUNK_ELEMENTS


def _top_k(z: Tensor, k: int) -> Tensor:
    kth = torch.topk(z, min(k, z.shape[-1]), dim=-1).values[:, -1:]  # (n, 1)
    return z.masked_fill(z < kth, float("-inf"))


def _top_p(z: Tensor, p: float) -> Tensor:
    # Keep the smallest set of most likely tokens whose probability reaches p (at least one).
    sorted_z, order = torch.sort(z, dim=-1, descending=True)  # (n, V)
    probs = torch.softmax(sorted_z, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
    drop_sorted = before >= p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return z.masked_fill(drop, float("-inf"))


def sample_forward(logits, inv_temperature, greedy, seed, tokens, logprobs):
    """The launcher ``kernels/contract.py`` declares."""
    sample_filtered(logits, inv_temperature, greedy, seed, tokens, logprobs, top_k=0, top_p=1.0)


def sample_filtered(logits, inv_temperature, greedy, seed, tokens, logprobs, top_k, top_p):
    """:func:`sample_forward` among the ``top_k`` most likely tokens (0: all) within the ``top_p``
    nucleus (1: all); the kernel has no such filter, so this is the twin's alone."""
    B, V = logits.shape
    generator = None if greedy else torch.Generator(logits.device).manual_seed(seed)
    rows = max(1, ROW_CHUNK_ELEMENTS // max(V, 1))
    for r0 in range(0, B, rows):
        z = logits[r0 : r0 + rows].float() * inv_temperature  # (n, V)
        if greedy:
            chosen = z.argmax(dim=1)
        else:
            candidates = z
            if top_k > 0:
                candidates = _top_k(candidates, top_k)
            if top_p < 1.0:
                candidates = _top_p(candidates, top_p)
            u = torch.rand(z.shape, device=z.device, generator=generator).clamp_(min=2.0**-32)
            chosen = (candidates - u.log_().neg_().log_()).argmax(dim=1)
        tokens[r0 : r0 + rows] = chosen
        logprobs[r0 : r0 + rows] = z.gather(1, chosen.unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=1)
