"""Choosing between the Triton kernels and their PyTorch twins.

``backend="auto"`` sends CUDA tensors to Triton and everything else to the PyTorch twin, which is
the production path on CPU. ``"triton"`` forces the kernels: on CPU that works only when
``TRITON_INTERPRET=1`` was set before triton was imported (the interpreter runs them on CPU
tensors, which is how the tests check every kernel without a GPU). ``"torch"`` forces the twin.

The two implementations of a family define the launchers its contract declares
(``kernels/contract.py``), with one signature each, so an op picks one with :func:`implementation`
and calls it without caring which it got. The two tables below pair them, the one hop from a
family to its code: the twins are imported with this module, the kernels on first use (importing
triton is slow, and it is absent off Linux).
"""

import importlib.metadata
import importlib.util
import os
from functools import lru_cache

import torch

from . import decode_attention_torch, gae_torch, ppo_policy_loss_torch, sample_tokens_torch, token_logprobs_torch

TWINS = {
    "gae": gae_torch,
    "token_logprobs": token_logprobs_torch,
    "ppo_policy_loss": ppo_policy_loss_torch,
    "sample_tokens": sample_tokens_torch,
    "decode_attention": decode_attention_torch,
}

BACKENDS = ("auto", "triton", "torch")

# Looked up once, without importing triton: the import is slow and absent off Linux.
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn the user's ``backend`` into ``"triton"`` or ``"torch"`` for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and TRITON_INSTALLED else "torch"
    if backend == "triton":
        if not TRITON_INSTALLED:
            raise ValueError("backend='triton' needs the triton package, which is not installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' needs CUDA tensors, got tensors on {device}; to run the kernels "
                "on CPU set TRITON_INTERPRET=1 before triton is imported"
            )
        if device.type != "cuda":
            problem = interpreter_problem(_version("triton"), _version("numpy"))
            if problem:
                raise ValueError(f"backend='triton' on {device}: {problem}")
    return backend


@lru_cache(maxsize=None)
def _version(package: str) -> tuple:
    release = importlib.metadata.version(package).split("+")[0]
    return tuple(int(part) for part in release.split(".")[:2] if part.isdigit())


def interpreter_problem(triton_version: tuple, numpy_version: tuple):
    """Why the Triton interpreter cannot run the kernels with these releases, or None.

    Before triton 3.7 the interpreter turns a loop bound, a one-element array, into a Python int,
    which numpy 2.4 refuses: every kernel with a loop would fail with a TypeError from numpy.
    """
    if triton_version < (3, 7) and numpy_version >= (2, 4):
        return (
            f"the interpreter of triton {'.'.join(map(str, triton_version))} needs numpy < 2.4 "
            f"(numpy {'.'.join(map(str, numpy_version))} is installed): install 'numpy<2.4' or triton >= 3.7"
        )
    return None


@lru_cache(maxsize=1)
def kernels() -> dict:
    """The Triton launchers of each family (imports triton, once)."""
    from ..kernels import decode_attention, gae, ppo_policy_loss, sample_tokens, token_logprobs

    return {
        "gae": gae,
        "token_logprobs": token_logprobs,
        "ppo_policy_loss": ppo_policy_loss,
        "sample_tokens": sample_tokens,
        "decode_attention": decode_attention,
    }


def implementation(backend: str, family: str):
    """The module holding ``family``'s launchers for a resolved ``backend``: ``"triton"`` or ``"torch"``."""
    return kernels()[family] if backend == "triton" else TWINS[family]
