"""TRL's own helpers against ``fastppo.integrations.trl``: cases and call-site targets.

Runs inside an interpreter where one TRL release is importable. Compared: ``selective_log_softmax``
(with ``temperature`` and ``row_mask`` from 1.14), ``entropy_from_logits``,
``selective_log_softmax_and_entropy`` (1.14 on) and the chunked LM-head function, called with the
positional arguments the release's own trainers pass, over fp32 and bf16, (N, V) and (B, T, V)
logits, peaked, -inf and large logits, labels at 0 and V - 1, and the cases fastppo leaves to TRL
(float64, several indices per row, soft-capping), which must come back as TRL's own.
"""

import inspect
import itertools

import torch
from peer_call_sites import Target
from peer_compare import Case, reference
from peer_inputs import labels, leaf, logits, normal

import fastppo.integrations.trl as ours

PEER = ours.TRL


def _half(label, build, seed, dtype, large=False, transform=None, deviation=None, entropy_only=False):
    """bf16 logits: TRL's CPU path computes in bf16, fastppo in fp32 (``fp32-compute``)."""
    return reference(
        label,
        build,
        seed,
        dtype,
        "fp32-compute",
        large=large,
        transform=transform,
        deviation=deviation,
        entropy_only=entropy_only,
    )


def _finite_logits(args, kwargs):
    """``neg-inf-logits``: TRL's entropy of a row with a -inf logit is NaN (0 * -inf)."""
    return (args[0].clamp(min=-1e4),) + tuple(args[1:]), kwargs


def _logit_cases(kind_of_call, with_options):
    cases, seed = [], {"logprobs": 0, "entropy": 100, "both": 200}[kind_of_call]
    options = [{}]
    if with_options:
        options += [{"temperature": 0.7}, {"row_mask": True}, {"temperature": 1.3, "row_mask": True}]
    for shape, kind, dtype, option in itertools.product(
        [(3, 5, 41), (9, 17), (2, 3, 1000)],
        ["random", "peaked", "neg-inf", "large"],
        [torch.float32, torch.bfloat16],
        options,
    ):
        seed += 1

        def build(g, shape=shape, kind=kind, dtype=dtype, option=option):
            z = leaf(logits(g, *shape, kind=kind).to(dtype))
            kwargs = dict(option)
            if kwargs.get("row_mask"):
                kwargs["row_mask"] = torch.rand(shape[:-1], generator=g) > 0.3
            if kind_of_call == "entropy":
                return (z,), {}, [z]
            index = labels(g, *shape[:-1], V=shape[-1])
            return (z, index), kwargs, [z]

        neg_inf = kind == "neg-inf" and kind_of_call != "logprobs"
        cases.append(
            _half(
                f"{shape} {kind} {dtype} {option}",
                build,
                seed,
                dtype,
                large=kind == "large",
                transform=_finite_logits if neg_inf else None,
                deviation="neg-inf-logits" if neg_inf else None,
                entropy_only=kind_of_call == "both",
            )
        )
    for label, dtype, index_extra in (("float64", torch.float64, False), ("several indices", torch.float32, True)):
        seed += 1

        def build(g, dtype=dtype, index_extra=index_extra):  # fastppo leaves these to TRL's own code
            z = leaf(logits(g, 3, 5, 41).to(dtype))
            if kind_of_call == "entropy":
                return (z,), {}, [z]
            index = torch.randint(0, 41, (3, 5, 2) if index_extra else (3, 5), generator=g)
            return (z, index), {}, [z]

        if not (index_extra and kind_of_call == "entropy"):
            cases.append(Case(label, build, seed))
    return cases


def _head_arguments(names, hidden, weight, bias, targets, temperature, outputs, softcap=None):
    values = {
        "hidden": hidden,
        "weight": weight,
        "bias": bias,
        "targets": targets,
        "temperature": temperature,
        "chunk_size": 64,
        "final_logit_softcapping": softcap,
        "logit_scale": 1.0,
        "outputs": outputs,
    }
    return tuple(values[name] for name in names)


def head_cases(peer_head):
    # the positional arguments in the release's order (TRL's own names differ between releases)
    names = list(inspect.signature(ours.FusedLinearLogProb.apply).parameters)
    if len(names) != len(inspect.signature(peer_head.forward).parameters) - 1:  # without ctx
        raise AssertionError(
            f"fastppo's LM head takes {names}; TRL's forward takes "
            f"{list(inspect.signature(peer_head.forward).parameters)[1:]}"
        )
    has_bias, has_outputs = "bias" in names, "outputs" in names
    output_sets = (
        [("entropy",), ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), (), ("is_top1",)]
        if has_outputs
        else [None]
    )
    cases, seed = [], 300
    grid = list(
        itertools.product(
            [torch.float32, torch.bfloat16],
            [False, True] if has_bias else [False],
            [1.0, 0.7, 1.5],
            output_sets,
            [None],
        )
    )
    if has_outputs:  # a third of the larger grid (TRL 1.15's head is a Triton kernel, interpreted here)
        grid = grid[::3]
    grid += [(torch.float32, has_bias, 1.0, output_sets[0], 30.0), (torch.float32, False, 0.7, output_sets[-1], 30.0)]
    # soft-capping (which fastppo leaves to TRL's own code) twice
    for dtype, bias, temperature, outputs, softcap in grid:
        seed += 1

        def build(g, dtype=dtype, bias=bias, temperature=temperature, outputs=outputs, softcap=softcap):
            hidden = leaf(normal(g, 37, 24).to(dtype))
            weight = leaf(normal(g, 211, 24, scale=0.3).to(dtype))
            b = leaf(normal(g, 211, scale=0.1).to(dtype)) if bias else None
            targets = labels(g, 37, V=211)
            args = _head_arguments(names, hidden, weight, b, targets, temperature, outputs, softcap)
            return args, {}, [t for t in (hidden, weight, b) if t is not None]

        slack = (2e-2, 2e-2) if dtype == torch.bfloat16 else (0.0, 0.0)  # both project in bf16, in their own order
        cases.append(
            Case(f"{dtype} bias={bias} T={temperature} outputs={outputs} softcap={softcap}", build, seed, slack=slack)
        )
    return cases


def functions(release: str, root) -> list:
    import trl.trainer.utils as utils

    rows = [
        (
            "selective_log_softmax",
            utils.selective_log_softmax,
            ours.selective_log_softmax,
            _logit_cases("logprobs", PEER.has("temperature-and-row-mask")),
        ),
        ("entropy_from_logits", utils.entropy_from_logits, ours.entropy_from_logits, _logit_cases("entropy", False)),
    ]
    if PEER.has("temperature-and-row-mask"):
        rows.append(
            (
                "selective_log_softmax_and_entropy",
                utils.selective_log_softmax_and_entropy,
                ours.selective_log_softmax_and_entropy,
                _logit_cases("both", True),
            )
        )
    head = _head_module(utils)
    rows.append(("ChunkedLogProbFunction", head.apply, ours.FusedLinearLogProb.apply, head_cases(head)))
    return rows


def _head_module(utils):
    if PEER.has("head-outputs"):
        import trl.kernels as kernels

        return kernels.ChunkedLogProbFunction
    return utils._ChunkedLogProbFunction


def targets(release: str, root, arities: dict) -> tuple:
    import trl.trainer.utils as utils

    found = []
    for name in ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy"):
        if hasattr(utils, name) and name in arities:
            peer_returns, our_returns = arities.get(name) or (None, None)
            found.append(
                Target(
                    "trl.trainer.utils",
                    name,
                    inspect.signature(getattr(utils, name)),
                    inspect.signature(getattr(ours, name)),
                    peer_returns,
                    our_returns,
                )
            )
    head = _head_module(utils)
    module, name = (
        ("trl.kernels", "ChunkedLogProbFunction")
        if PEER.has("head-outputs")
        else ("trl.trainer.utils", "_ChunkedLogProbFunction")
    )
    peer_returns, our_returns = arities.get("ChunkedLogProbFunction") or (None, None)
    forward = inspect.Signature(list(inspect.signature(head.forward).parameters.values())[1:])
    call = Target(module, name, forward, inspect.signature(ours.FusedLinearLogProb.apply), peer_returns, our_returns)
    found.append(Target(module, name, forward, forward, instance=call, class_method="apply"))
    return "trl", found
