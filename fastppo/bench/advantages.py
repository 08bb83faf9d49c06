"""Bench cases for the advantage ops: GAE and masked whitening (no backward).

Bytes, the fewest each must move: ``gae`` reads rewards and values (fp32) and the mask (1 byte)
and writes advantages and returns, ``17`` bytes per position; ``whiten`` reads x and the mask
and writes the result, ``9`` bytes per position.
"""

import torch

import fastppo

from .case import Case, Contender, compiled, random_tokens
from .losses import BATCHES, QUICK_BATCHES


def naive_gae(rewards, values, gamma=1.0, lam=0.95):
    """The loop trainers write: T steps of a few small ops each (and no holes in the mask)."""
    T = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    advantages = []
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages.append(last)
    advantages = torch.stack(advantages[::-1], dim=1)
    return advantages, advantages + values


def naive_whiten(x, mask, eps=1e-8):
    m = mask.float()
    mean = (x * m).sum() / m.sum()
    var = (((x - mean) ** 2) * m).sum() / (m.sum() - 1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def _inputs(B, T, device):
    return {
        "rewards": random_tokens(B, T, device=device),
        "values": random_tokens(B, T, device=device),
        "mask": torch.rand(B, T, device=device) > 0.1,
    }


def gae_cases(device: torch.device, quick: bool) -> list:
    cases = []
    for B, T in QUICK_BATCHES if quick else BATCHES:
        contenders = [
            Contender("fastppo", lambda x: fastppo.gae(x["rewards"], x["values"], x["mask"])),
            Contender("naive (Python loop over T)", lambda x: naive_gae(x["rewards"], x["values"]), baseline=True),
            Contender("torch.compile(naive)", status="not run: compiling a loop over T unrolls it"),
        ]
        cases.append(
            Case("gae", f"B={B} T={T}", lambda B=B, T=T: _inputs(B, T, device), contenders, bytes_fwd=17 * B * T)
        )
    return cases


def whiten_cases(device: torch.device, quick: bool) -> list:
    def naive(x):
        return naive_whiten(x["values"], x["mask"])

    compiled_naive = compiled("torch.compile(naive)", naive, device)
    cases = []
    for B, T in QUICK_BATCHES if quick else BATCHES:
        contenders = [
            Contender("fastppo", lambda x: fastppo.masked_whiten(x["values"], x["mask"])),
            Contender("naive", naive, baseline=True),
            compiled_naive,
        ]
        cases.append(
            Case("whiten", f"B={B} T={T}", lambda B=B, T=T: _inputs(B, T, device), contenders, bytes_fwd=9 * B * T)
        )
    return cases
