"""Every kernel family's Triton launchers and PyTorch twin define the functions its contract
declares (``kernels/contract.py``), each with the declared signature; a Triton launcher may
add only keyword-only tuning arguments with defaults."""

import inspect

import pytest

from fastppo.kernels import contract
from fastppo.ops import dispatch


def without_tuning(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` without its keyword-only parameters that have defaults."""
    kept = [p for p in signature.parameters.values() if not (p.kind is p.KEYWORD_ONLY and p.default is not p.empty)]
    return signature.replace(parameters=kept)


def parameters(signature: inspect.Signature) -> list:
    """Names, kinds and defaults: what a call depends on (annotations are the implementations' own)."""
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


@pytest.mark.parametrize("family", sorted(contract.FAMILIES))
def test_the_twin_and_the_kernels_define_the_declared_launchers(family):
    pytest.importorskip("triton")
    assert set(dispatch.TWINS) == set(dispatch.kernels()) == set(contract.FAMILIES)  # one table pairs them
    for declared in contract.FAMILIES[family]:
        signature = parameters(inspect.signature(declared))
        twin = getattr(dispatch.TWINS[family], declared.__name__)
        kernel = getattr(dispatch.kernels()[family], declared.__name__)
        assert parameters(inspect.signature(twin)) == signature, f"the twin's {declared.__name__}"
        assert parameters(without_tuning(inspect.signature(kernel))) == signature, f"the kernel's {declared.__name__}"


def test_a_launcher_that_strays_from_its_contract_is_caught():
    def strayed(logits, inv_temperature, greedy, seed, tokens, logprobs, *, top_k=0):
        """Like the sampling twin once was: an extra option the kernel lacks, though keyword-only."""

    signature = parameters(inspect.signature(contract.sample_forward))
    assert parameters(without_tuning(inspect.signature(strayed))) == signature  # allowed only on the kernel's side
    assert parameters(inspect.signature(strayed)) != signature  # the twin check refuses it
