"""Bench cases for the losses: the PPO loss from logits, the token-level PPO loss, the value loss.

Bytes, the fewest each must move (e = bytes per logit; token tensors are fp32, the mask 1 byte):

* ``ppo_loss`` (from logits, with KL and entropy terms) forward: logits ``N*V*e`` and labels
  ``8N`` read, old log-probs, advantages and reference log-probs ``12N``, mask ``N``.
  Forward+backward adds the logits read again and their gradient written.
* ``ppo_loss_hidden`` (from hidden states and the LM head): as ``logprobs_from_hidden`` (hidden and
  weight read, their gradients written), plus ``21N`` for the token tensors. Bound by its
  matmuls: fastppo runs three per chunk where the unfused chain of its own ops runs four.
* ``ppo_loss_tokens`` (from log-probs) forward: four fp32 token tensors and the mask, ``17N``;
  forward+backward adds the gradient ``4N``.
* ``value_loss`` forward: values, old values and returns ``12N`` and the mask ``N``;
  forward+backward adds the gradient ``4N``.
"""

import itertools

import torch

import fastppo

from .case import Case, Contender, compiled, random_tokens
from .logprobs import HIDDENS, QUICK_HIDDENS, QUICK_TOKENS, QUICK_VOCABS, TOKENS, VOCABS, dtype_for, naive_logprobs
from .peer_kernels import ppo_loss_peers

# Token-level ops run on (B, T) batches the size of a rollout.
BATCHES = ((64, 1024), (512, 1024), (64, 8192), (512, 8192))
QUICK_BATCHES = ((8, 128),)
LOSS_OPTIONS = dict(clip_eps=0.2, kl_coef=0.05, kl_estimator="k3")


def naive_ppo_loss(logp, old, adv, mask, ref, entropy=None, clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01):
    """The loss as trainers write it: one PyTorch op per line."""
    m = mask.float()
    ratio = torch.exp((logp - old).clamp(-20, 20))
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    d = (logp - ref).clamp(-20, 20)
    per_token = pg + kl_coef * (torch.exp(-d) + d - 1)
    if entropy is not None:
        per_token = per_token - entropy_coef * entropy
    return (per_token * m).sum() / m.sum().clamp(min=1)


def _token_inputs(shape, device):
    logp = -torch.rand(shape, device=device) * 3
    return {
        "old": logp + torch.randn(shape, device=device) * 0.2,
        "adv": random_tokens(*shape, device=device),
        "ref": logp + torch.randn(shape, device=device) * 0.3,
        "mask": torch.rand(shape, device=device) > 0.2,
        "logp": logp.requires_grad_(),
    }


def ppo_loss_cases(device: torch.device, quick: bool) -> list:
    dtype = dtype_for(device)
    e = torch.finfo(dtype).bits // 8

    def naive(x):
        logp, entropy = naive_logprobs(x["logits"], x["labels"])
        return naive_ppo_loss(logp, x["old"], x["adv"], x["mask"], x["ref"], entropy)

    compiled_naive = compiled("torch.compile(naive)", naive, device)
    cases = []
    for N, V in itertools.product(*((QUICK_TOKENS, QUICK_VOCABS) if quick else (TOKENS, VOCABS))):

        def make(N=N, V=V):
            x = _token_inputs((N,), device)
            del x["logp"]
            x.update(
                logits=random_tokens(N, V, device=device, dtype=dtype, requires_grad=True),
                labels=torch.randint(0, V, (N,), device=device),
            )
            return x

        contenders = [
            Contender(
                "fastppo",
                lambda x: fastppo.ppo_loss_from_logits(
                    x["logits"],
                    x["labels"],
                    x["old"],
                    x["adv"],
                    x["mask"],
                    ref_logprobs=x["ref"],
                    entropy_coef=0.01,
                    **LOSS_OPTIONS,
                )[0],
            ),
            Contender("naive", naive, baseline=True),
            compiled_naive,
            *ppo_loss_peers(device),
        ]
        cases.append(
            Case(
                "ppo_loss",
                f"N={N} V={V}",
                make,
                contenders,
                bytes_fwd=N * V * e + 21 * N,
                bytes_fwd_bwd=3 * N * V * e + 21 * N,
                grad_inputs=("logits",),
            )
        )
    return cases


def ppo_loss_hidden_cases(device: torch.device, quick: bool) -> list:
    dtype = dtype_for(device)
    e = torch.finfo(dtype).bits // 8

    def naive(x):
        logp, entropy = naive_logprobs(x["hidden"] @ x["weight"].T, x["labels"])  # the full logits
        return naive_ppo_loss(logp, x["old"], x["adv"], x["mask"], x["ref"], entropy)

    def unfused(x):
        logp, entropy = fastppo.token_logprobs_from_hidden(x["hidden"], x["weight"], x["labels"], return_entropy=True)
        return fastppo.ppo_policy_loss(
            logp,
            x["old"],
            x["adv"],
            x["mask"],
            ref_logprobs=x["ref"],
            entropy=entropy,
            entropy_coef=0.01,
            **LOSS_OPTIONS,
        )[0]

    compiled_naive = compiled("torch.compile(naive)", naive, device)
    shapes = (QUICK_TOKENS, QUICK_VOCABS, QUICK_HIDDENS) if quick else (TOKENS, VOCABS, HIDDENS)
    cases = []
    for N, V, H in itertools.product(*shapes):

        def make(N=N, V=V, H=H):
            x = _token_inputs((N,), device)
            del x["logp"]
            x.update(
                hidden=random_tokens(N, H, device=device, dtype=dtype, requires_grad=True),
                weight=(random_tokens(V, H, device=device, dtype=dtype) / H**0.5).requires_grad_(),
                labels=torch.randint(0, V, (N,), device=device),
            )
            return x

        contenders = [
            Contender(
                "fastppo",
                lambda x: fastppo.ppo_loss_from_hidden(
                    x["hidden"],
                    x["weight"],
                    x["labels"],
                    x["old"],
                    x["adv"],
                    x["mask"],
                    ref_logprobs=x["ref"],
                    entropy_coef=0.01,
                    **LOSS_OPTIONS,
                )[0],
            ),
            Contender("fastppo unfused (token_logprobs_from_hidden + ppo_policy_loss)", unfused),
            Contender("naive", naive, baseline=True),
            compiled_naive,
        ]
        operands = (N * H + V * H) * e
        cases.append(
            Case(
                "ppo_loss_hidden",
                f"N={N} V={V} H={H}",
                make,
                contenders,
                bytes_fwd=operands + 21 * N,
                bytes_fwd_bwd=4 * operands + 21 * N,
                grad_inputs=("hidden", "weight"),
            )
        )
    return cases


def ppo_loss_tokens_cases(device: torch.device, quick: bool) -> list:
    def naive(x):
        return naive_ppo_loss(x["logp"], x["old"], x["adv"], x["mask"], x["ref"])

    compiled_naive = compiled("torch.compile(naive)", naive, device)
    cases = []
    for B, T in QUICK_BATCHES if quick else BATCHES:
        contenders = [
            Contender(
                "fastppo",
                lambda x: fastppo.ppo_policy_loss(
                    x["logp"], x["old"], x["adv"], x["mask"], ref_logprobs=x["ref"], **LOSS_OPTIONS
                )[0],
            ),
            Contender("naive", naive, baseline=True),
            compiled_naive,
        ]
        cases.append(
            Case(
                "ppo_loss_tokens",
                f"B={B} T={T}",
                lambda B=B, T=T: _token_inputs((B, T), device),
                contenders,
                bytes_fwd=17 * B * T,
                bytes_fwd_bwd=21 * B * T,
                grad_inputs=("logp",),
            )
        )
    return cases


def naive_value_loss(values, old_values, returns, mask, clip_eps=0.2):
    m = mask.float()
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return (per_token * m).sum() / m.sum().clamp(min=1)


def value_loss_cases(device: torch.device, quick: bool) -> list:
    def naive(x):
        return naive_value_loss(x["values"], x["old"], x["returns"], x["mask"])

    def make(B, T):
        return {
            "values": random_tokens(B, T, device=device, requires_grad=True),
            "old": random_tokens(B, T, device=device),
            "returns": random_tokens(B, T, device=device),
            "mask": torch.rand(B, T, device=device) > 0.2,
        }

    compiled_naive = compiled("torch.compile(naive)", naive, device)
    cases = []
    for B, T in QUICK_BATCHES if quick else BATCHES:
        contenders = [
            Contender("fastppo", lambda x: fastppo.value_loss(x["values"], x["old"], x["returns"], x["mask"])[0]),
            Contender("naive", naive, baseline=True),
            compiled_naive,
        ]
        cases.append(
            Case(
                "value_loss",
                f"B={B} T={T}",
                lambda B=B, T=T: make(B, T),
                contenders,
                bytes_fwd=13 * B * T,
                bytes_fwd_bwd=17 * B * T,
                grad_inputs=("values",),
            )
        )
    return cases
