"""Peer kernels, measured when installed and listed as "not installed" when not, never dropped.

Each peer computes what its library offers for the op (for log-probs that is often the log-prob
alone, without the entropy); its row's name says so.
"""

import importlib
import importlib.util

import torch

from .case import Contender


def _load(module: str, attr: str):
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return None, "not installed"
    try:
        return getattr(importlib.import_module(module), attr), "ok"
    except Exception as error:  # a peer that is installed but broken is a row, not a crash
        return None, f"import failed: {type(error).__name__}"


def _peer(name: str, module: str, attr: str, device: torch.device, call, *, cuda_only: bool) -> Contender:
    fn, status = _load(module, attr)
    if fn is None:
        return Contender(name, status=status)
    if cuda_only and device.type != "cuda":
        return Contender(name, status="CUDA only")
    return Contender(name, lambda inputs: call(fn, inputs))


def logprobs_peers(device: torch.device) -> list:
    return [
        _peer(
            "trl selective_log_softmax_and_entropy",
            "trl.trainer.utils",
            "selective_log_softmax_and_entropy",
            device,
            lambda fn, x: fn(x["logits"], x["labels"]),
            cuda_only=False,
        ),
        _peer(
            "trl selective_log_softmax (logp only)",
            "trl.trainer.utils",
            "selective_log_softmax",
            device,
            lambda fn, x: fn(x["logits"], x["labels"]),
            cuda_only=False,
        ),
        _peer(
            "liger cross_entropy (logp only)",
            "liger_kernel.transformers.functional",
            "liger_cross_entropy",
            device,
            lambda fn, x: fn(x["logits"], x["labels"], reduction="none"),
            cuda_only=True,
        ),
        _peer(
            "flash-attn cross_entropy (logp only)",
            "flash_attn.ops.triton.cross_entropy",
            "cross_entropy_loss",
            device,
            lambda fn, x: fn(x["logits"], x["labels"])[0],
            cuda_only=True,
        ),
    ]


def logprobs_from_hidden_peers(device: torch.device) -> list:
    return [
        _peer(
            "trl ChunkedLogProbFunction",
            "trl.kernels",
            "ChunkedLogProbFunction",
            device,
            lambda fn, x: fn.apply(
                x["hidden"], x["weight"], None, x["labels"], 1.0, 4096, None, 1.0, ("log_probs", "entropy")
            )[:2],
            cuda_only=False,
        ),
        _peer(
            "liger fused_linear_cross_entropy (logp only)",
            "liger_kernel.transformers.functional",
            "liger_fused_linear_cross_entropy",
            device,
            lambda fn, x: fn(x["hidden"], x["weight"], x["labels"], reduction="none"),
            cuda_only=True,
        ),
    ]


def _liger_grpo(fn, x):
    # Liger's GRPO loss takes (B, L + 1, V) logits for L completion tokens and one advantage per
    # sequence: the N tokens are fed as one sequence of N - 1 completion tokens.
    N = x["labels"].shape[0]
    out = fn(
        x["logits"].unsqueeze(0),
        x["old"][None, : N - 1],
        x["ref"][None, : N - 1],
        x["labels"][None, : N - 1],
        x["adv"][:1],
        x["mask"][None, : N - 1].int(),
    )
    loss = out[0] if isinstance(out, tuple) else out
    return loss.sum()


def ppo_loss_peers(device: torch.device) -> list:
    return [
        _peer(
            "liger triton_grpo_loss",
            "liger_kernel.transformers.grpo_loss",
            "triton_grpo_loss",
            device,
            _liger_grpo,
            cuda_only=True,
        )
    ]
