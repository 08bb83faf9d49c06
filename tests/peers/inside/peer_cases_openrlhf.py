"""OpenRLHF's own functions against ``fastppo.integrations.openrlhf``: cases and call-site targets.

OpenRLHF's ``models/utils.py`` and ``models/loss.py`` import nothing of OpenRLHF's but each other,
so each release's pair is loaded from its files under a private package name, as OpenRLHF's own
tests load them, and one interpreter compares every release. The experience maker's
``get_advantages_and_returns`` is compiled from its file alone (the rest of that module needs a
Ray cluster). The constructor and ``forward`` options compared are read from each release's own
signatures, so every option a release has is exercised: clip ranges given positionally and by
name, dual clipping, token- and sequence-level losses, every importance-sampling correction and
gate, the global-batch arguments, and adversarial inputs (empty rows, all-masked batches,
log-ratios past 20 and past 88, NaN at masked positions, bf16).
"""

import ast
import importlib.util
import inspect
import itertools
import sys
import textwrap
import types
import typing
from pathlib import Path

import torch
from peer_call_sites import Target
from peer_compare import Case, reference
from peer_inputs import GAE_GRID, labels, leaf, log_probs, logits, mask, normal, with_garbage, zero_masked

import fastppo.integrations.openrlhf as ours
from fastppo.integrations.peers import parse_version

PEER = ours.OPENRLHF


def _load(release: str, root: Path) -> types.SimpleNamespace:
    """This release's ``models.utils``, ``models.loss`` and GAE method, from its files."""
    package = "_openrlhf_" + release.replace(".", "_")
    models = root / "openrlhf" / "models"
    module = types.ModuleType(package)
    module.__path__ = [str(models)]
    sys.modules[package] = module
    loaded = {}
    for name in ("utils", "loss"):
        spec = importlib.util.spec_from_file_location(f"{package}.{name}", models / f"{name}.py")
        loaded[name] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = loaded[name]
        spec.loader.exec_module(loaded[name])
    return types.SimpleNamespace(utils=loaded["utils"], loss=loaded["loss"], gae=_method(root))


def _method(root: Path):
    """``RemoteExperienceMaker.get_advantages_and_returns`` compiled from the experience maker's source."""
    path = root / "openrlhf" / "trainer" / "ppo_utils" / "experience_maker.py"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_advantages_and_returns":
            source = textwrap.dedent(ast.get_source_segment(path.read_text(), node, padded=True))
            namespace = {"torch": torch, **{name: getattr(typing, name) for name in typing.__all__}}
            exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - the peer's own code, loaded
            method = namespace["get_advantages_and_returns"]
            return lambda *args, **kwargs: method(None, *args, **kwargs)
    raise LookupError(f"no get_advantages_and_returns in {path}")


def _parameters(cls) -> dict:
    """A class's constructor parameters and defaults, without self."""
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items() if name != "self"}


def _half(label, build, seed, dtype, large=False, transform=None, deviation=None):
    """Half-precision inputs: OpenRLHF computes in them, fastppo in fp32 (``fp32-compute``)."""
    return reference(label, build, seed, dtype, "fp32-compute", large=large, transform=transform, deviation=deviation)


def _finite_logits(args, kwargs):
    """``neg-inf-logits``: OpenRLHF's entropy of a row with a -inf logit is NaN (0 * -inf)."""
    return (args[0].clamp(min=-1e4),) + tuple(args[1:]), kwargs


def logprob_cases():
    cases, seed = [], 0
    for shape, kind, dtype, temperature in itertools.product(
        [(7, 33), (2, 5, 17), (3, 1000)],
        ["random", "peaked", "neg-inf", "large"],
        [torch.float32, torch.bfloat16],
        [1.0, 0.7],
    ):
        seed += 1

        def build(g, shape=shape, kind=kind, dtype=dtype, temperature=temperature):
            z = leaf(logits(g, *shape, kind=kind).to(dtype))
            return (z, labels(g, *shape[:-1], V=shape[-1]), temperature), {}, [z]

        if temperature != 1.0 and dtype == torch.float32 and kind != "large":
            cases.append(
                Case(
                    f"{shape} {kind} T={temperature}",
                    build,
                    seed,
                    deviation="logits-left-alone",
                    peer_inputs=_clone_logits,
                    check=_logits_untouched,
                )
            )
        else:
            case = _half(
                f"{shape} {kind} {dtype} T={temperature}",
                build,
                seed,
                dtype,
                large=kind == "large",
                transform=_clone_logits if temperature != 1.0 else None,
            )
            cases.append(case)
    return cases


def _clone_logits(args, kwargs):
    """OpenRLHF divides its logits in place by the temperature; give it a copy it may write (the
    ``logits-left-alone`` deviation: fastppo never writes them)."""
    return (args[0].clone(),) + tuple(args[1:]), kwargs


def _logits_untouched(peer_args, our_args):
    before = our_args[0]
    return None if before._version == 0 else "fastppo wrote into the logits"


def entropy_cases():
    cases, seed = [], 100
    for shape, kind, dtype in itertools.product(
        [(7, 33), (2, 5, 17), (3, 1000)], ["random", "peaked", "neg-inf", "large"], [torch.float32, torch.bfloat16]
    ):
        seed += 1

        def build(g, shape=shape, kind=kind, dtype=dtype):
            z = leaf(logits(g, *shape, kind=kind).to(dtype))
            return (z,), {}, [z]

        finite = _finite_logits if kind == "neg-inf" else None
        cases.append(
            _half(
                f"{shape} {kind} {dtype}",
                build,
                seed,
                dtype,
                large=kind == "large",
                transform=finite,
                deviation="neg-inf-logits" if finite else None,
            )
        )
    return cases


def masked_mean_cases():
    cases, seed = [], 200
    for m_kind, dim, garbage in itertools.product(
        ["random", "full", "empty-row", "all-masked", "spans", "none"], [None, -1, 0], [False, True]
    ):
        if garbage and m_kind in ("none", "full"):
            continue
        seed += 1

        def build(g, m_kind=m_kind, dim=dim, garbage=garbage):
            m = None if m_kind == "none" else mask(g, 5, 9, m_kind)
            x = normal(g, 5, 9, scale=2.0)
            x = leaf(with_garbage(x, m, g) if garbage else x)
            return (x, m, dim), {}, [x]

        if garbage:
            cases.append(
                Case(
                    f"{m_kind} dim={dim} garbage",
                    build,
                    seed,
                    deviation="masked-positions-ignored",
                    peer_inputs=lambda a, k: ((zero_masked(a[0], a[1]),) + tuple(a[1:]), k),
                    valid_of=lambda a, k: a[1],
                )
            )
        else:
            cases.append(Case(f"{m_kind} dim={dim}", build, seed))
    return cases


def kl_cases(peer_kl):
    cases, seed = [], 300
    names = list(inspect.signature(peer_kl).parameters)
    with_old = "log_probs_old" in names
    for estimator, spread, dtype, unbiased, positional in itertools.product(
        ["k1", "k2", "k3", "k4"],
        [0.5, 4.0, 40.0, 150.0],
        [torch.float32, torch.bfloat16],
        [False, True] if with_old else [False],
        [False, True],
    ):
        seed += 1

        def build(g, estimator=estimator, spread=spread, dtype=dtype, unbiased=unbiased, positional=positional):
            new = leaf(log_probs(g, 5, 7).to(dtype))
            base = leaf((log_probs(g, 5, 7) + normal(g, 5, 7, scale=spread)).to(dtype))
            old = (new.detach() + normal(g, 5, 7, scale=min(spread, 5.0))).to(dtype)
            if positional:
                args = (new, base, old, estimator) if with_old else (new, base, estimator)
                return args, ({"unbiased_gradient": unbiased} if with_old else {}), [new, base]
            kwargs = {"kl_estimator": estimator}
            if with_old:
                kwargs.update(log_probs_old=old, unbiased_gradient=unbiased)
            return (new, base), kwargs, [new, base]

        label = f"{estimator} spread={spread} {dtype} unbiased={unbiased} positional={positional}"
        if (
            estimator == "k3"
            and spread >= 40
            and PEER.has("kl-clamped")
            and not unbiased
            and PEER.release < parse_version("0.11.2")
        ):
            cases.append(Case(label, build, seed, deviation="finite-k3-gradient", peer_inputs=_bounded_k3))
        else:
            cases.append(Case(label, build, seed))
    return cases


def _bounded_k3(args, kwargs):
    """``finite-k3-gradient``: below -88, OpenRLHF's k3 gradient is NaN (inf times the clamp's 0);
    bounding its log-ratio at -20 (past the [-10, 10] clamp) gives fastppo's 0 there."""
    new, base = args[0], args[1]
    bounded = torch.where(new.float() - base.float() < -20.0, (base - 20.0).detach(), new)  # elsewhere new itself
    return (bounded,) + tuple(args[1:]), kwargs


def gae_cases():
    cases, seed = [], 400
    for m_kind, gamma, lambd in GAE_GRID + (("none", 0.99, 0.95),):
        seed += 1

        def build(g, m_kind=m_kind, gamma=gamma, lambd=lambd):
            m = None if m_kind == "none" else mask(g, 4, 19, m_kind)
            return (normal(g, 4, 19), normal(g, 4, 19), m, gamma, lambd), {}, []

        cases.append(Case(f"{m_kind} gamma={gamma} lambd={lambd}", build, seed))
    return cases


def _policy_options(parameters: dict) -> list:
    """Constructor keyword sets for this release's ``PolicyLoss``, every option it has."""
    clips = (
        [{"clip_eps": 0.2}, {"clip_eps": 0.1}]
        if "clip_eps" in parameters
        else [{}, {"clip_eps_low": 0.1, "clip_eps_high": 0.3}]
    )
    duals = [{}, {"dual_clip": 3.0}, {"dual_clip": 0.5}] if "dual_clip" in parameters else [{}]
    levels = [{"token_level_loss": True}, {"token_level_loss": False}]
    corrections = [{}]
    if "is_correction_level" in parameters:
        corrections += [
            dict(
                is_correction_level=level,
                is_correction_mode=mode,
                is_correction_gating=gating,
                is_correction_threshold=[0.5, 5.0] if gating == "ratio" else [0, 0.05],
            )
            for level, mode, gating in itertools.product(
                ["token", "seq"], ["mask", "clip"], ["ratio", "binary_kl", "tv"]
            )
        ]
        corrections += [
            dict(is_correction_level="token", is_correction_gating="tv", is_correction_threshold=[0.5, 5.0]),
            dict(is_correction_level="sideways"),
        ]
    elif "vllm_is_correction_type" in parameters:
        corrections += [
            dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.5, 2.0], vllm_is_correction_type=kind)
            for kind in ("tis", "icepop", "mis", "seq-mask-tis")
        ]
        corrections += [dict(enable_vllm_is_correction=False, vllm_is_correction_type="nonsense")]
    elif "use_icepop" in parameters:
        corrections += [
            dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.5, 2.0], use_icepop=icepop)
            for icepop in (False, True)
        ]
    elif "enable_vllm_is_correction" in parameters:
        corrections += [
            dict(enable_vllm_is_correction=enable, vllm_is_truncated_threshold=2.0) for enable in (False, True)
        ]
    elif "vllm_is_truncated_threshold" in parameters:
        corrections += [dict(vllm_is_truncated_threshold=2.0)]
    return [{**c, **d, **level, **r} for c, d, level, r in itertools.product(clips, duals, levels, corrections)]


def _policy_cases(peer_cls):
    parameters = _parameters(peer_cls)
    forward = list(inspect.signature(peer_cls.forward).parameters)
    global_batch = "dp_size" in forward
    rollout = "rollout_log_probs" in forward
    cases, seed = [], 500
    infos = (
        [
            {},
            {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 6},
            {"dp_size": 1, "batch_num_tokens": torch.tensor(0.0), "global_batch_size": 0},
        ]
        if global_batch
        else [{}]
    )
    options = _policy_options(parameters)
    for index, (m_kind, spread) in enumerate(
        itertools.product(["random", "empty-row", "all-masked", "spans", "none"], [0.3, 3.0, 30.0, 120.0])
    ):
        for option_index, option in enumerate(options):
            info = infos[(index + option_index) % len(infos)]
            seed += 1
            build = _policy_build(option, m_kind, spread, info, rollout)
            label = f"{option} {m_kind} spread={spread} info={info}"
            if spread > 20 and not PEER.has("policy-ratio-clamped"):
                cases.append(
                    Case(
                        label,
                        build,
                        seed,
                        deviation="ratio-clamped",
                        peer_inputs=_clamped_ratio,
                        peer_result=_loss_from_first,
                        untransformed=True,
                    )
                )
            else:
                cases.append(Case(label, build, seed))
    for option in options[::7]:  # positional constructor arguments, bound as the release binds them
        seed += 1
        build = _policy_build(option, "random", 1.0, {}, rollout, positional=True, parameters=parameters)
        cases.append(Case(f"positional {option}", build, seed))
    negative = _negative_weights(parameters)
    if negative is not None:
        for level in (True, False):
            seed += 1
            build = _policy_build({**negative, "token_level_loss": level}, "full", 1.0, {}, rollout)
            cases.append(
                Case(
                    f"{negative} token_level={level} negative weights",
                    build,
                    seed,
                    deviation="non-negative-weights",
                    peer_result=_nan_loss,
                )
            )
    for option in options:
        seed += 1
        build = _policy_build(option, "random", 1.0, {}, rollout, garbage=True)
        cases.append(
            Case(
                f"{option} garbage",
                build,
                seed,
                deviation="masked-positions-ignored",
                peer_inputs=_zero_masked_policy,
                valid_of=lambda a, k: k["action_mask"],
            )
        )
    return cases


def _policy_build(option, m_kind, spread, info, rollout, garbage=False, positional=False, parameters=None):
    def build(g):
        m = None if m_kind == "none" else mask(g, 5, 13, m_kind)
        new = log_probs(g, 5, 13)
        old = new + normal(g, 5, 13, scale=spread)
        adv = normal(g, 5, 13, scale=2.0)
        rollout_lp = old + normal(g, 5, 13, scale=0.5)
        if garbage:
            new, old, adv, rollout_lp = (with_garbage(x, m, g) for x in (new, old, adv, rollout_lp))
        new = leaf(new)
        kwargs = {"action_mask": m, **info}
        if rollout:
            kwargs["rollout_log_probs"] = rollout_lp
        init = ((), dict(option))
        if positional:  # every parameter up to the last one set, in the release's order, by position
            names = list(parameters)
            last = max((names.index(name) for name in option), default=-1)
            init = (tuple(option.get(name, parameters[name]) for name in names[: last + 1]), {})
        return (init, new, old, adv), kwargs, [new]

    return build


def _negative_weights(parameters: dict):
    """Constructor options whose correction weights come out negative (negative thresholds), or None."""
    if "is_correction_level" in parameters:
        return dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=[-2.0, -1.0])
    if "vllm_is_correction_type" in parameters:
        return dict(
            enable_vllm_is_correction=True, vllm_is_truncated_threshold=[-2.0, -1.0], vllm_is_correction_type="tis"
        )
    if "use_icepop" in parameters:
        return dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[-2.0, -1.0])
    if "enable_vllm_is_correction" in parameters:
        return dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=-1.0)
    if "vllm_is_truncated_threshold" in parameters:
        return dict(vllm_is_truncated_threshold=-1.0)
    return None


def _nan_loss(result):
    """``non-negative-weights``: fastppo's loss is NaN where a correction weight is negative, its
    gradient too (never a different number)."""
    if not isinstance(result, tuple):
        return result * float("nan")
    return (result[0] * float("nan"),) + tuple(result[1:])


def _clamped_ratio(args, kwargs):
    """``ratio-clamped``: the peer's log-ratio clamped to [-20, 20] before its loss, as fastppo's."""
    init, new, old, adv = args
    return (init, old + (new - old).clamp(-20.0, 20.0), old, adv), kwargs


def _loss_from_first(transformed, untransformed):
    """The loss from the peer on clamped ratios; its statistics (unclamped, as fastppo's) from the raw call."""
    if not isinstance(transformed, tuple):
        return transformed
    return (transformed[0],) + tuple(untransformed[1:])


def _zero_masked_policy(args, kwargs):
    init, new, old, adv = args
    m = kwargs["action_mask"]
    kwargs = dict(kwargs)
    if kwargs.get("rollout_log_probs") is not None:
        kwargs["rollout_log_probs"] = zero_masked(kwargs["rollout_log_probs"], m)
    return (init, zero_masked(new, m), zero_masked(old, m), zero_masked(adv, m)), kwargs


def _value_cases(peer_cls):
    forward = list(inspect.signature(peer_cls.forward).parameters)
    infos = (
        [
            {},
            {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 6},
            {"batch_num_tokens": 0, "global_batch_size": torch.tensor(0)},
        ]
        if "dp_size" in forward
        else [{}]
    )
    cases, seed = [], 700
    for clip, level, m_kind, info in itertools.product(
        [None, 0.2, 100.0], [True, False], ["random", "empty-row", "all-masked", "spans", "none"], range(len(infos))
    ):
        seed += 1

        def build(g, clip=clip, level=level, m_kind=m_kind, info=info):
            m = None if m_kind == "none" else mask(g, 4, 10, m_kind)
            values = leaf(normal(g, 4, 10))
            old = values.detach() + normal(g, 4, 10, scale=0.5)
            init = ((), {"clip_eps": clip, "token_level_loss": level})
            return (init, values, old, normal(g, 4, 10)), {"action_mask": m, **infos[info]}, [values]

        cases.append(Case(f"clip={clip} token_level={level} {m_kind} info={infos[info]}", build, seed))
    return cases


def _module_call(cls):
    """Construct ``cls`` from the first argument ``(args, kwargs)`` and call the object on the rest."""

    def call(init, *args, **kwargs):
        return cls(*init[0], **init[1])(*args, **kwargs)

    return call


_LOADED = {}


def functions(release: str, root: Path) -> list:
    peer = _LOADED.setdefault(release, _load(release, root))
    rows = [
        ("log_probs_from_logits", peer.utils.log_probs_from_logits, ours.log_probs_from_logits, logprob_cases()),
        ("compute_entropy", peer.utils.compute_entropy, ours.compute_entropy, entropy_cases()),
        ("masked_mean", peer.utils.masked_mean, ours.masked_mean, masked_mean_cases()),
        (
            "compute_approx_kl",
            peer.utils.compute_approx_kl,
            ours.compute_approx_kl,
            kl_cases(peer.utils.compute_approx_kl),
        ),
        ("get_advantages_and_returns", peer.gae, ours.get_advantages_and_returns, gae_cases()),
        (
            "PolicyLoss",
            _module_call(peer.loss.PolicyLoss),
            _module_call(ours.PolicyLoss),
            _policy_cases(peer.loss.PolicyLoss),
        ),
        (
            "ValueLoss",
            _module_call(peer.loss.ValueLoss),
            _module_call(ours.ValueLoss),
            _value_cases(peer.loss.ValueLoss),
        ),
    ]
    return rows


def targets(release: str, root: Path, arities: dict) -> tuple:
    peer = _LOADED[release]
    modules = {"openrlhf.models.utils": peer.utils, "openrlhf.models.loss": peer.loss}
    found = []
    for (module, name), drop_in in ours._PATCH.replacements.items():
        peer_returns, our_returns = arities.get(name.split(".")[-1]) or (None, None)
        if "." in name:  # the experience maker's method, called as self.get_advantages_and_returns(...)
            method = name.split(".")[1]
            found.append(
                Target(
                    module,
                    method,
                    _without_self(peer.gae, root),
                    inspect.signature(drop_in),
                    peer_returns,
                    our_returns,
                    registry_names=(method,),
                )
            )
            continue
        original = getattr(modules[module], name)
        if inspect.isclass(original):
            call = Target(module, name, _forward(original), _forward(drop_in), *(arities.get(name) or (None, None)))
            found.append(Target(module, name, _constructor(original), _constructor(drop_in), instance=call))
        else:
            found.append(
                Target(module, name, inspect.signature(original), inspect.signature(drop_in), peer_returns, our_returns)
            )
    return "openrlhf", found


def _without_self(method, root) -> inspect.Signature:
    path = root / "openrlhf" / "trainer" / "ppo_utils" / "experience_maker.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "get_advantages_and_returns":
            names = [a.arg for a in node.args.args][1:]
            return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    raise LookupError(path)


def _constructor(cls) -> inspect.Signature:
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return inspect.Signature(parameters)


def _forward(cls) -> inspect.Signature:
    parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    return inspect.Signature(parameters)
