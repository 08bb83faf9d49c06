"""Bench cases for the log-prob ops: from logits, and from hidden states and the LM head.

Bytes, the fewest a fused implementation must move (e = bytes per logit or hidden element):

* ``logprobs`` forward: logits ``N*V*e`` read, labels ``8N`` read, log-prob and entropy ``8N``
  written. Forward+backward adds the logits read again, their gradient ``N*V*e`` written and the
  two upstream gradients ``8N`` read.
* ``logprobs_from_hidden`` forward: hidden ``N*H*e`` and weight ``V*H*e`` read, labels and outputs as
  above. Forward+backward adds hidden and weight read again and their gradients written. The op
  is bound by its matmuls (2*N*H*V FLOPs each), so its GB/s stays far from the copy bandwidth by
  nature; compare its time and memory.
"""

import itertools

import torch

import fastppo

from .case import Case, Contender, compiled, random_tokens
from .peer_kernels import logprobs_from_hidden_peers, logprobs_peers

TOKENS, VOCABS, HIDDENS = (4096, 16384), (32000, 128256, 151936), (896, 4096)
CPU_TOKENS, CPU_VOCABS = (2048,), (32000, 49152)  # a CPU batch; Llama-2's and SmolLM2's vocabularies
QUICK_TOKENS, QUICK_VOCABS, QUICK_HIDDENS = (256,), (1000,), (64,)


def logit_shapes(device: torch.device, quick: bool) -> tuple:
    if quick:
        return QUICK_TOKENS, QUICK_VOCABS
    return (CPU_TOKENS, CPU_VOCABS) if device.type == "cpu" else (TOKENS, VOCABS)


def naive_logprobs(logits, labels):
    """What a trainer writes: an fp32 log_softmax of the whole logits, then a gather."""
    log_p = torch.log_softmax(logits.float(), dim=-1)  # (N, V) fp32
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def naive_logprobs_from_hidden(hidden, weight, labels):
    return naive_logprobs(hidden @ weight.T, labels)  # materialises the (N, V) logits


def dtype_for(device: torch.device) -> torch.dtype:
    # bf16 is what models run in on GPUs; CPUs run fp32 (their bf16 matmuls are slow emulation).
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def logprobs_cases(device: torch.device, quick: bool) -> list:
    dtype = dtype_for(device)
    e = torch.finfo(dtype).bits // 8
    compiled_naive = compiled("torch.compile(naive)", lambda x: naive_logprobs(x["logits"], x["labels"]), device)
    cases = []
    for N, V in itertools.product(*logit_shapes(device, quick)):

        def make(N=N, V=V):
            return {
                "logits": random_tokens(N, V, device=device, dtype=dtype, requires_grad=True),
                "labels": torch.randint(0, V, (N,), device=device),
            }

        contenders = [
            Contender("fastppo", lambda x: fastppo.token_logprobs(x["logits"], x["labels"], return_entropy=True)),
            Contender("fastppo (logp only)", lambda x: fastppo.token_logprobs(x["logits"], x["labels"])),
            Contender("naive", lambda x: naive_logprobs(x["logits"], x["labels"]), baseline=True),
            compiled_naive,
            *logprobs_peers(device),
        ]
        cases.append(
            Case(
                "logprobs",
                f"N={N} V={V}",
                make,
                contenders,
                bytes_fwd=N * V * e + 16 * N,
                bytes_fwd_bwd=3 * N * V * e + 24 * N,
                grad_inputs=("logits",),
            )
        )
    return cases


def logprobs_from_hidden_cases(device: torch.device, quick: bool) -> list:
    dtype = dtype_for(device)
    e = torch.finfo(dtype).bits // 8
    compiled_naive = compiled(
        "torch.compile(naive)", lambda x: naive_logprobs_from_hidden(x["hidden"], x["weight"], x["labels"]), device
    )
    shapes = (QUICK_TOKENS, QUICK_VOCABS, QUICK_HIDDENS) if quick else (TOKENS, VOCABS, HIDDENS)
    cases = []
    for N, V, H in itertools.product(*shapes):

        def make(N=N, V=V, H=H):
            return {
                "hidden": random_tokens(N, H, device=device, dtype=dtype, requires_grad=True),
                "weight": (random_tokens(V, H, device=device, dtype=dtype) / H**0.5).requires_grad_(),
                "labels": torch.randint(0, V, (N,), device=device),
            }

        contenders = [
            Contender(
                "fastppo",
                lambda x: fastppo.token_logprobs_from_hidden(
                    x["hidden"], x["weight"], x["labels"], return_entropy=True
                ),
            ),
            Contender(
                "naive", lambda x: naive_logprobs_from_hidden(x["hidden"], x["weight"], x["labels"]), baseline=True
            ),
            compiled_naive,
            *logprobs_from_hidden_peers(device),
        ]
        operands = (N * H + V * H) * e
        cases.append(
            Case(
                "logprobs_from_hidden",
                f"N={N} V={V} H={H}",
                make,
                contenders,
                bytes_fwd=operands + 16 * N,
                bytes_fwd_bwd=4 * operands + 24 * N,
                grad_inputs=("hidden", "weight"),
            )
        )
    return cases
