"""One comparison of a peer's function with fastppo's drop-in: values, dtypes, gradients, errors.

A :class:`Case` builds its inputs twice from one seed, so the peer and the drop-in each get their
own tensors (a peer may write into its inputs). Both are called; their results must agree in
structure (tuples, dicts of metrics, None), dtype, shape and value, and the gradients of one
random linear function of the differentiable results must agree at every leaf input. When the
peer raises, the drop-in must raise too. A case that exercises one of the drop-in module's
deliberate deviations names it and carries its transform: the peer is called on the transformed
inputs, so the case passes only if the deviation is exactly what the module documents. Where a
deviation is about masked positions, per-token results and gradients are compared at the valid
positions only.
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# (rtol, atol) for values by the drop-in's result dtype; gradients by relative error of the whole.
VALUE_TOLERANCE = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (2e-5, 2e-6),
    torch.bfloat16: (8e-3, 1e-5),
    torch.float16: (2e-3, 1e-6),
}
# Gradients: ||g - g_peer|| <= rtol * ||g_peer|| + atol, by the leaf's dtype.
GRADIENT_TOLERANCE = {
    torch.float32: (2e-5, 1e-6),
    torch.bfloat16: (1e-2, 1e-4),
    torch.float16: (2e-3, 1e-5),
    torch.float64: (2e-5, 1e-9),
}
FLOAT_TOLERANCE = (2e-5, 2e-6)  # metrics returned as Python floats
CLEARER_ERRORS = (ValueError, TypeError, NotImplementedError)  # what a drop-in may raise where a peer fails
LARGE_LOGITS = (1e-3, 1e-3)  # fp32 resolves log p + H to ~4e-7 x max|logit| (DESIGN's numerics policy)


@dataclass
class Case:
    """``build(generator) -> (args, kwargs, leaves)``: fresh inputs and the leaves to differentiate.

    ``deviation`` names the drop-in module's documented deviation this case exercises;
    ``peer_inputs(args, kwargs) -> (args, kwargs)`` is its transform of the peer's copy of the
    inputs and ``peer_result`` of the peer's result (``peer_result(transformed, other)`` when
    ``untransformed`` is set: the peer is then called again, on the inputs as built or as
    ``other_inputs`` makes them, for a deviation that touches only part of a result); ``valid_at``
    (the position of the mask among the arguments) restricts per-token comparisons to valid
    positions, and ``valid_of(args, kwargs)`` (the mask, for a deviation about masked positions
    whose results are not per token) restricts the gradients' comparison to the valid positions,
    where the peer's transformed inputs still say what the peer does; ``check(peer_args,
    our_args)`` runs after both calls (a message, or None); ``slack``
    widens the tolerances (an
    extra relative and absolute error), as fp32 allows for logits in the hundreds."""

    label: str
    build: Callable
    seed: int
    deviation: Optional[str] = None
    peer_inputs: Optional[Callable] = None
    peer_result: Optional[Callable] = None
    untransformed: bool = False
    other_inputs: Optional[Callable] = None
    valid_at: Optional[int] = None
    valid_of: Optional[Callable] = None
    check: Optional[Callable] = None
    slack: tuple = (0.0, 0.0)

    def inputs(self):
        generator = torch.Generator().manual_seed(self.seed)
        return self.build(generator)


def _call(fn, args, kwargs):
    try:
        return fn(*args, **kwargs), None
    except Exception as error:  # noqa: BLE001 - the peer's exception is what is compared
        return None, error


def compare(peer_fn, our_fn, case: Case) -> Optional[str]:
    """None when the drop-in agrees with the peer on ``case``, else a one-line description."""
    built_args, built_kwargs, peer_leaves = case.inputs()
    our_args, our_kwargs, our_leaves = case.inputs()
    peer_args, peer_kwargs = built_args, built_kwargs
    if case.peer_inputs is not None:
        peer_args, peer_kwargs = case.peer_inputs(built_args, built_kwargs)
    peer_out, peer_error = _call(peer_fn, peer_args, peer_kwargs)
    our_out, our_error = _call(our_fn, our_args, our_kwargs)
    if peer_error is not None or our_error is not None:
        return _errors(peer_error, our_error)
    if case.untransformed:  # the second call shares the leaves, so both parts' gradients reach them
        other_args, other_kwargs = built_args, built_kwargs
        if case.other_inputs is not None:
            other_args, other_kwargs = case.other_inputs(built_args, built_kwargs)
        peer_out = case.peer_result(peer_out, peer_fn(*other_args, **other_kwargs))
    elif case.peer_result is not None:
        peer_out = case.peer_result(peer_out)
    if case.check is not None:
        message = case.check(peer_args, our_args)
        if message:
            return message
    valid = None if case.valid_at is None else our_args[case.valid_at].bool()
    message = _same(peer_out, our_out, valid, "result", case.slack)
    if message:
        return message
    if case.valid_of is not None:
        valid = case.valid_of(our_args, our_kwargs).bool()
    return _gradients(peer_out, our_out, peer_leaves, our_leaves, case.seed, valid, case.slack)


def _errors(peer_error, our_error) -> Optional[str]:
    if peer_error is None:
        return f"fastppo raised {type(our_error).__name__}: {our_error}; the peer returned"
    if our_error is None:
        return f"the peer raised {type(peer_error).__name__}: {peer_error}; fastppo returned"
    if isinstance(our_error, (type(peer_error),) + CLEARER_ERRORS):
        return None
    return f"the peer raised {type(peer_error).__name__}, fastppo {type(our_error).__name__}: {our_error}"


def _same(peer, ours, valid, where: str, slack=(0.0, 0.0)) -> Optional[str]:
    if isinstance(peer, torch.Tensor) or isinstance(ours, torch.Tensor):
        return _same_tensor(peer, ours, valid, where, slack)
    if isinstance(peer, (tuple, list)):
        if not isinstance(ours, (tuple, list)) or len(ours) != len(peer):
            return f"{where}: the peer returned {len(peer)} values, fastppo {_describe(ours)}"
        for i, (p, o) in enumerate(zip(peer, ours)):
            message = _same(p, o, valid, f"{where}[{i}]", slack)
            if message:
                return message
        return None
    if isinstance(peer, dict):
        if not isinstance(ours, dict) or set(ours) != set(peer):
            return f"{where}: the peer returned keys {sorted(peer)}, fastppo {_describe(ours)}"
        for key in peer:
            message = _same(peer[key], ours[key], valid, f"{where}[{key!r}]", slack)
            if message:
                return message
        return None
    if peer is None or ours is None:
        return None if peer is None and ours is None else f"{where}: the peer gave {peer!r}, fastppo {ours!r}"
    if isinstance(peer, (int, float)) and isinstance(ours, (int, float)):
        if type(peer) is not type(ours):
            return f"{where}: the peer gave a {type(peer).__name__}, fastppo a {type(ours).__name__}"
        if math.isnan(peer) and math.isnan(ours):
            return None
        if math.isclose(peer, ours, rel_tol=FLOAT_TOLERANCE[0], abs_tol=FLOAT_TOLERANCE[1]):
            return None
        return f"{where}: the peer gave {peer!r}, fastppo {ours!r}"
    return None if peer == ours else f"{where}: the peer gave {peer!r}, fastppo {ours!r}"


def _describe(x) -> str:
    if isinstance(x, (tuple, list)):
        return f"{len(x)} values"
    if isinstance(x, dict):
        return f"keys {sorted(x)}"
    return type(x).__name__


def _same_tensor(peer, ours, valid, where, slack) -> Optional[str]:
    if not (isinstance(peer, torch.Tensor) and isinstance(ours, torch.Tensor)):
        return f"{where}: the peer gave {_describe(peer)}, fastppo {_describe(ours)}"
    if peer.shape != ours.shape:
        return f"{where}: shape {tuple(peer.shape)} from the peer, {tuple(ours.shape)} from fastppo"
    if peer.dtype != ours.dtype:
        return f"{where}: dtype {peer.dtype} from the peer, {ours.dtype} from fastppo"
    if not ours.is_floating_point():
        return (
            None if torch.equal(peer, ours) else f"{where}: {peer.tolist()} from the peer, {ours.tolist()} from fastppo"
        )
    rtol, atol = (base + extra for base, extra in zip(VALUE_TOLERANCE[ours.dtype], slack))
    p, o = peer.detach().double(), ours.detach().double()
    if valid is not None and valid.shape == p.shape:
        p, o = p[valid], o[valid]
    differ = ~torch.isclose(o, p, rtol=rtol, atol=atol, equal_nan=True)
    if not bool(differ.any()):
        return None
    return (
        f"{where}: {int(differ.sum())} of {differ.numel()} values differ, e.g. {p[differ][0].item()!r} "
        f"from the peer, {o[differ][0].item()!r} from fastppo"
    )


def _differentiable(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad and out.is_floating_point() else [None]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _differentiable(x)]
    if isinstance(out, dict):
        return [t for key in sorted(out) for t in _differentiable(out[key])]
    return []


def _gradients(peer_out, our_out, peer_leaves, our_leaves, seed: int, valid, slack) -> Optional[str]:
    """The gradients of one random linear function of the results, whatever the results are (a
    NaN loss still has a gradient, and a training step follows it): where the peer's gradient of a
    leaf is finite everywhere, fastppo's must be too (a NaN there would poison a step the peer
    takes); where the peer's has non-finite entries, fastppo's must have some; and the entries
    finite in both agree within the tolerance. Which entries of a poisoned gradient are NaN is
    left alone: that follows each peer's autograd graph (a clamp or ``where`` passes 0 where a
    product passes NaN), and one non-finite entry already fails the step's norm check."""
    if not peer_leaves:
        return None
    peer_terms, our_terms = _differentiable(peer_out), _differentiable(our_out)
    if [t is None for t in peer_terms] != [t is None for t in our_terms]:
        return "a different set of results carries a gradient in the peer and in fastppo"
    pairs = [(p, o) for p, o in zip(peer_terms, our_terms) if p is not None]
    if not pairs:
        return None
    generator = torch.Generator().manual_seed(seed + 1)
    weights = [torch.randn(p.shape, generator=generator, dtype=torch.float64) for p, _ in pairs]
    peer_grads = _grad(sum((p.double() * w).sum() for (p, _), w in zip(pairs, weights)), peer_leaves)
    our_grads = _grad(sum((o.double() * w).sum() for (_, o), w in zip(pairs, weights)), our_leaves)
    for i, (leaf, g_ref, g) in enumerate(zip(our_leaves, peer_grads, our_grads)):
        if valid is not None and valid.shape == g.shape:
            g_ref, g = g_ref[valid], g[valid]
        peer_finite, our_finite = torch.isfinite(g_ref), torch.isfinite(g)
        if bool(peer_finite.all()) != bool(our_finite.all()):
            return (
                f"gradient of input {i}: the peer's has {int((~peer_finite).sum())} non-finite entries, "
                f"fastppo's {int((~our_finite).sum())}"
            )
        both = peer_finite & our_finite
        g_ref, g = g_ref[both], g[both]
        scale = float(g_ref.norm())
        error = float((g - g_ref).norm())
        rtol, atol = (base + extra for base, extra in zip(GRADIENT_TOLERANCE[leaf.dtype], slack))
        if error > rtol * scale + atol:
            return f"gradient of input {i}: relative error {error / max(scale, 1e-30):.3g} (norm {scale:.3g})"
    return None


def _grad(total, leaves) -> list:
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return [torch.zeros_like(leaf, dtype=torch.float64) if g is None else g.double() for leaf, g in zip(leaves, grads)]


def upcast(args, kwargs):
    """Floating tensors among ``args`` as float64 (differentiably: gradients reach the originals)."""
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args), kwargs


def cast(result, dtype):
    if isinstance(result, tuple):
        return tuple(cast(r, dtype) for r in result)
    return result.to(dtype) if isinstance(result, torch.Tensor) and result.is_floating_point() else result


def reference(
    label,
    build,
    seed,
    dtype,
    half_deviation,
    *,
    result_dtype=None,
    large=False,
    transform=None,
    deviation=None,
    entropy_only=False,
) -> Case:
    """A case on logits (or log-probs) of ``dtype``. In half precision the peer computes in it and
    fastppo in fp32 (the module's ``half_deviation``), and logits in the hundreds (``large``) are
    beyond what fp32 resolves exactly: then the peer runs on the same values in float64 and its
    results are cast to ``result_dtype`` (default ``dtype``). ``transform`` is another deviation's,
    named ``deviation``; ``entropy_only``: it concerns the entropy of a ``(log-probs, entropy)``
    result alone."""
    precise = dtype != torch.float32 or large
    result_dtype = result_dtype or dtype

    def peer_inputs(args, kwargs):
        args, kwargs = upcast(args, kwargs) if precise else (args, kwargs)
        return transform(args, kwargs) if transform else (args, kwargs)

    def rounded(result):
        return cast(result, result_dtype) if precise else result

    name = half_deviation if dtype != torch.float32 else deviation
    slack = LARGE_LOGITS if large else (0.0, 0.0)
    if not precise and transform is None:
        return Case(label, build, seed)
    if entropy_only and transform is not None:
        return Case(
            label,
            build,
            seed,
            deviation=name,
            peer_inputs=peer_inputs,
            untransformed=True,
            other_inputs=upcast if precise else None,
            peer_result=lambda both, plain: rounded((plain[0], both[1])),
            slack=slack,
        )
    return Case(label, build, seed, deviation=name, peer_inputs=peer_inputs, peer_result=rounded, slack=slack)
