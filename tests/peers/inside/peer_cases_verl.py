"""verl's own functions against ``fastppo.integrations.verl``: the cases and the call-site targets.

Runs inside an interpreter where one verl release is importable (its wheel on the path, its
distributed dependencies stubbed by ``peer_stubs``). Each function is compared on random inputs
over every aggregation mode, mask kind and global-batch setting the release knows, and on
adversarial ones: empty rows, all-masked batches, counts of 0, log-ratios past every clamp,
NaN and inf at masked positions, zero rollout weights, bf16 inputs, -inf and peaked logits.
"""

import itertools
import types

import numpy as np
import torch
from peer_call_sites import Target
from peer_compare import Case, reference
from peer_inputs import GAE_GRID, MASKS, labels, leaf, log_probs, logits, mask, normal, with_garbage, zero_masked

import fastppo.integrations.verl as ours

PEER = ours.VERL
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _modes():
    return AGG_MODES + ["token-sum"] * PEER.has("token-sum") + ["no-such-mode"]


def _batch_infos():
    """The global-batch arguments the release takes, as ints and as tensors, zero counts included."""
    if not PEER.has("global-batch"):
        return [{}]
    return [
        {},
        {"dp_size": 1},
        {"dp_size": 2},
        {"dp_size": 4, "batch_num_tokens": 150, "global_batch_size": 12},
        {"dp_size": 2, "batch_num_tokens": torch.tensor(37.0), "global_batch_size": torch.tensor(9)},
        {"loss_scale_factor": 64},
        {"dp_size": 4, "batch_num_tokens": 90, "global_batch_size": 6, "loss_scale_factor": 32},
        {"batch_num_tokens": 0, "global_batch_size": 0},
    ]


def _actor_config(actor_config, clip=0.2, low=None, high=0.28, clip_c=3.0, info=None):
    config = actor_config(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=clip,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=clip_c,
    )
    if info is not None and PEER.has("global-batch"):
        config.global_batch_info.update(info)
    return config


def _garbage_case(label, build, seed, mask_at, zeroed, per_token=False):
    """A case with NaN and inf at masked positions: the peer gets them zeroed (the deviation)."""

    def peer_inputs(args, kwargs):
        m = args[mask_at]
        args = tuple(zero_masked(a, m) if i in zeroed and a is not None else a for i, a in enumerate(args))
        return args, kwargs

    return Case(
        label,
        build,
        seed,
        deviation="masked-positions-ignored",
        peer_inputs=peer_inputs,
        valid_at=mask_at if per_token else None,
        valid_of=lambda args, kwargs: args[mask_at],
    )


def logprob_cases():
    cases, seed = [], 0
    for shape, kind, dtype in itertools.product(
        [(7, 33), (2, 5, 17), (4, 1), (3, 1000)],
        ["random", "peaked", "neg-inf", "large"],
        [torch.float32, torch.bfloat16],
    ):
        seed += 1

        def build(g, shape=shape, kind=kind, dtype=dtype):
            z = leaf(logits(g, *shape, kind=kind).to(dtype))
            return (z, labels(g, *shape[:-1], V=shape[-1])), {}, [z]

        cases.append(_half(f"{shape} {kind} {dtype}", build, seed, dtype, large=kind == "large"))
    return cases


def _half(label, build, seed, dtype, transform=None, large=False):
    """bf16 inputs: verl computes in bf16, fastppo in fp32 and returns fp32 (``fp32-results``)."""
    return reference(
        label,
        build,
        seed,
        dtype,
        "fp32-results",
        result_dtype=torch.float32,
        large=large,
        transform=transform,
        deviation="neg-inf-logits" if transform else None,
    )


def _finite_logits(args, kwargs):
    """The ``neg-inf-logits`` deviation: verl's entropy of a row with a -inf logit is NaN (0 * -inf);
    fastppo's gives those tokens probability 0, as a very negative finite logit does."""
    z = args[0]
    return (z.clamp(min=-1e4),) + tuple(args[1:]), kwargs


def entropy_cases(chunked=False):
    cases, seed = [], 100
    shapes = [(7, 33), (3, 1000), (5, 1)] + ([] if chunked else [(2, 5, 17)])
    for shape, kind, dtype in itertools.product(
        shapes, ["random", "peaked", "neg-inf", "large"], [torch.float32, torch.bfloat16]
    ):
        seed += 1

        def build(g, shape=shape, kind=kind, dtype=dtype):
            z = leaf(logits(g, *shape, kind=kind).to(dtype))
            return ((z, 3) if chunked else (z,)), {}, [z]

        transform = _finite_logits if kind == "neg-inf" else None
        if chunked and dtype == torch.bfloat16 and kind != "large":  # the chunked form upcasts itself
            cases.append(
                Case(
                    f"{shape} {kind} {dtype}",
                    build,
                    seed,
                    peer_inputs=transform,
                    deviation="neg-inf-logits" if transform else None,
                )
            )
        else:
            cases.append(_half(f"{shape} {kind} {dtype}", build, seed, dtype, transform, large=kind == "large"))
    return cases


def masked_cases(kind):
    cases, seed = [], 200
    for kind_of_mask, axis, shift in itertools.product(MASKS, [None, -1, 0], [True, False]):
        if kind != "whiten" and not shift or kind == "whiten" and axis is not None:
            continue
        seed += 1

        def build(g, m_kind=kind_of_mask, axis=axis, shift=shift):
            m = mask(g, 5, 9, m_kind)
            x = leaf(normal(g, 5, 9, scale=2.0) + 1.0)
            if kind == "whiten":
                return (x, m), {"shift_mean": shift}, [x]
            return (x, m), {"axis": axis}, [x]

        cases.append(Case(f"{kind_of_mask} axis={axis} shift={shift}", build, seed))
    for m_kind in ("random", "spans"):  # NaN and inf where the mask is 0: verl's where() drops them too
        seed += 1

        def build(g, m_kind=m_kind):
            m = mask(g, 5, 9, m_kind)
            x = leaf(with_garbage(normal(g, 5, 9), m, g))
            return (x, m), {}, [x]

        cases.append(Case(f"{m_kind} garbage", build, seed, valid_at=1))
    return cases


def gae_cases():
    cases, seed = [], 300
    for m_kind, gamma, lam in GAE_GRID:
        seed += 1

        def build(g, m_kind=m_kind, gamma=gamma, lam=lam):
            m = mask(g, 4, 23, m_kind)
            return (normal(g, 4, 23), normal(g, 4, 23), m, gamma, lam), {}, []

        cases.append(Case(f"{m_kind} gamma={gamma} lam={lam}", build, seed))
    for m_kind in ("random", "spans"):
        seed += 1

        def build(g, m_kind=m_kind):
            m = mask(g, 4, 23, m_kind)
            return (with_garbage(normal(g, 4, 23), m, g), with_garbage(normal(g, 4, 23), m, g), m, 0.99, 0.95), {}, []

        cases.append(_garbage_case(f"{m_kind} garbage", build, seed, 2, {0, 1}, per_token=True))
    return cases


def _outcome_inputs(g, index_kind):
    """Scores at each response's last token; uids of groups of 1 to 4, shuffled, as verl passes them."""
    sizes = [3, 1, 4, 2, 1] if index_kind != "all-singles" else [1, 1, 1]
    uids = np.array([f"p{i}" for i, n in enumerate(sizes) for _ in range(n)], dtype=object)
    if index_kind == "ints":
        uids = np.array([i for i, n in enumerate(sizes) for _ in range(n)])
    order = torch.randperm(len(uids), generator=g).numpy()
    uids = uids[order]
    B, T = len(uids), 9
    m = mask(g, B, T, "random")
    rewards = torch.zeros(B, T)
    last = (m * torch.arange(T)).argmax(dim=-1)
    rewards[torch.arange(B), last] = normal(g, B) + (normal(g, B) > 0).float()
    if index_kind == "ties":
        rewards[rewards != 0] = 1.0  # equal scores: a group's std is 0
    return rewards, m, uids


def outcome_cases(estimator):
    cases, seed = [], 400
    for index_kind, option in itertools.product(["strings", "ints", "ties", "all-singles"], [True, False]):
        seed += 1

        def build(g, index_kind=index_kind, option=option):
            rewards, m, uids = _outcome_inputs(g, index_kind)
            if estimator == "grpo":
                return (rewards, m, uids), {"norm_adv_by_std_in_grpo": option}, []
            if estimator == "rloo":
                return (rewards, m, uids), {}, []
            config = types.SimpleNamespace(gamma=0.9 if option else 1.0)
            return (
                (normal(g, *rewards.shape), mask(g, *rewards.shape, "spans" if option else "random")),
                {"config": config},
                [],
            )

        cases.append(Case(f"{index_kind} option={option}", build, seed))
    return cases


def kl_cases():
    modes = [
        "kl",
        "k1",
        "abs",
        "mse",
        "k2",
        "low_var_kl",
        "k3",
        "full",
        "k1+",
        "k2+",
        "k3+",
        "low_var_kl+",
        "abs+",
        "mse+",
    ]
    cases, seed = [], 500
    for mode, spread, dtype in itertools.product(modes, [0.5, 4.0, 40.0], [torch.float32, torch.bfloat16]):
        seed += 1

        def build(g, mode=mode, spread=spread, dtype=dtype):
            logprob = leaf(log_probs(g, 5, 7).to(dtype))
            ref = leaf((log_probs(g, 5, 7) + normal(g, 5, 7, scale=spread)).to(dtype))
            return (logprob, ref, mode), {}, [logprob, ref]

        cases.append(_half(f"{mode} spread={spread} {dtype}", build, seed, dtype))
    return cases


def agg_cases():
    cases, seed = [], 600
    for mode, m_kind, info in itertools.product(_modes(), MASKS, range(len(_batch_infos()))):
        seed += 1

        def build(g, mode=mode, m_kind=m_kind, info=info):
            m = mask(g, 6, 11, m_kind)
            x = leaf(normal(g, 6, 11, scale=2.0))
            return (x, m, mode), dict(_batch_infos()[info]), [x]

        cases.append(Case(f"{mode} {m_kind} info={_batch_infos()[info]}", build, seed))
    for mode in AGG_MODES:
        seed += 1

        def build(g, mode=mode):
            m = mask(g, 6, 11, "empty-row")
            x = leaf(with_garbage(normal(g, 6, 11), m, g))
            return (x, m, mode), {}, [x]

        cases.append(_garbage_case(f"{mode} garbage", build, seed, 1, {0}))
    return cases


def _policy_build(kind, actor_config, m_kind, mode, spread, weights, info, clip, garbage=False, negative_weight=False):
    def build(g):
        m = mask(g, 5, 13, m_kind)
        new = log_probs(g, 5, 13)
        old = new + normal(g, 5, 13, scale=spread)  # log-ratios past 20 and past 88 at the widest spread
        adv = normal(g, 5, 13, scale=2.0)
        if kind == "gspo":
            adv = normal(g, 5, 1) + normal(g, 5, 13, scale=0.1)  # near GRPO's constant per row
        w = None
        if weights:
            w = torch.rand(5, 13, generator=g) * 2
            w[w < 0.3] = 0.0  # rollout correction zeroes tokens
            if negative_weight:
                w[0, 0] = -0.5
        if garbage:
            new, old, adv = (with_garbage(x, m, g) for x in (new, old, adv))
        new = leaf(new)
        low, high, clip_c = clip
        config = _actor_config(actor_config, low=low, high=high, clip_c=clip_c, info=info)
        if kind == "deprecated":
            return (
                (old, new, adv, m),
                dict(cliprange=0.2, cliprange_low=low, cliprange_high=high, clip_ratio_c=clip_c, loss_agg_mode=mode),
                [new],
            )
        return (old, new, adv, m), dict(loss_agg_mode=mode, config=config, rollout_is_weights=w), [new]

    return build


def policy_cases(kind, actor_config):
    cases, seed = [], 700 if kind == "vanilla" else 800
    infos = _batch_infos() if kind != "deprecated" else [{}]
    clips = [(None, 0.28, 3.0), (0.1, 0.1, 1.5), (0.3, 0.2, 10.0)]
    for mode, m_kind, spread, weights, info, clip in itertools.product(
        _modes(),
        ["random", "empty-row", "all-masked", "spans"],
        [0.3, 3.0, 60.0],
        [False, True],
        range(len(infos)),
        range(len(clips)),
    ):
        if kind == "deprecated" and weights or (info + clip + int(spread)) % 3:  # a third of the grid
            continue
        seed += 1
        build = _policy_build(kind, actor_config, m_kind, mode, spread, weights, infos[info], clips[clip])
        cases.append(
            Case(
                f"{mode} {m_kind} spread={spread} weights={weights} info={infos[info]} clip={clips[clip]}", build, seed
            )
        )
    for mode in AGG_MODES:
        seed += 1
        build = _policy_build(kind, actor_config, "random", mode, 3.0, kind != "deprecated", {}, clips[0], garbage=True)
        cases.append(_garbage_case(f"{mode} garbage", build, seed, 3, {0, 1, 2}))
    if kind == "vanilla":
        for mode in AGG_MODES:
            seed += 1
            build = _policy_build(kind, actor_config, "full", mode, 3.0, True, {}, clips[0], negative_weight=True)
            cases.append(
                Case(
                    f"{mode} a negative weight",
                    build,
                    seed,
                    deviation="non-negative-rollout-weights",
                    peer_result=_nan_loss,
                )
            )
    return cases


def _nan_loss(result):
    """``non-negative-rollout-weights``: fastppo's loss is NaN where a weight is negative, its
    gradient too (never a different number)."""
    return (result[0] * float("nan"),) + tuple(result[1:])


def value_cases():
    cases, seed = [], 900
    infos = _batch_infos() if PEER.has("value-loss-global-batch") else [{}]
    for mode, m_kind, clip, info in itertools.product(
        _modes(), ["random", "empty-row", "all-masked", "spans"], [0.2, 0.5, 100.0], range(len(infos))
    ):
        seed += 1

        def build(g, mode=mode, m_kind=m_kind, clip=clip, info=info):
            m = mask(g, 4, 10, m_kind)
            vpreds = leaf(normal(g, 4, 10))
            values = vpreds.detach() + normal(g, 4, 10, scale=0.5)
            return (vpreds, normal(g, 4, 10), values, m, clip, mode), dict(infos[info]), [vpreds]

        cases.append(Case(f"{mode} {m_kind} clip={clip} info={infos[info]}", build, seed))
    return cases


def functions(release: str, root) -> list:
    """``(name, peer function, drop-in, cases)`` for every function the drop-ins replace."""
    import verl.trainer.ppo.core_algos as core
    import verl.utils.torch_functional as functional
    import verl.workers.config as workers_config

    actor_config = workers_config.ActorConfig
    rows = [
        ("logprobs_from_logits", functional.logprobs_from_logits, logprob_cases()),
        ("entropy_from_logits", functional.entropy_from_logits, entropy_cases()),
        ("entropy_from_logits_with_chunking", functional.entropy_from_logits_with_chunking, entropy_cases(True)),
        ("masked_sum", functional.masked_sum, masked_cases("sum")),
        ("masked_mean", functional.masked_mean, masked_cases("mean")),
        ("masked_whiten", functional.masked_whiten, masked_cases("whiten")),
        ("compute_gae_advantage_return", core.compute_gae_advantage_return, gae_cases()),
        ("compute_grpo_outcome_advantage", core.compute_grpo_outcome_advantage, outcome_cases("grpo")),
        ("compute_rloo_outcome_advantage", core.compute_rloo_outcome_advantage, outcome_cases("rloo")),
        (
            "compute_reinforce_plus_plus_outcome_advantage",
            core.compute_reinforce_plus_plus_outcome_advantage,
            outcome_cases("reinforce++"),
        ),
        ("kl_penalty", core.kl_penalty, kl_cases()),
        ("agg_loss", core.agg_loss, agg_cases()),
        ("compute_policy_loss_vanilla", core.compute_policy_loss_vanilla, policy_cases("vanilla", actor_config)),
        ("compute_policy_loss_gspo", core.compute_policy_loss_gspo, policy_cases("gspo", actor_config)),
        ("compute_policy_loss", core.compute_policy_loss, policy_cases("deprecated", actor_config)),
        ("compute_value_loss", core.compute_value_loss, value_cases()),
    ]
    return [(name, peer, getattr(ours, name), cases) for name, peer, cases in rows]


def targets(release: str, root, arities: dict) -> tuple:
    """``(package, [Target])`` for the call-site scan; ``arities`` holds how many values each
    function returns, ``(peer's, ours)``, as the comparisons saw."""
    import inspect

    import verl.trainer.ppo.core_algos as core
    import verl.utils.torch_functional as functional

    modules = {"verl.utils.torch_functional": functional, "verl.trainer.ppo.core_algos": core}
    registries = {
        "compute_policy_loss_vanilla": ("policy_loss_fn",),
        "compute_policy_loss_gspo": ("policy_loss_fn",),
        "compute_grpo_outcome_advantage": ("adv_estimator_fn",),
        "compute_rloo_outcome_advantage": ("adv_estimator_fn",),
        "compute_reinforce_plus_plus_outcome_advantage": ("adv_estimator_fn",),
        "compute_gae_advantage_return": ("adv_estimator_fn",),
    }
    found = []
    for (module, name), _ in ours._PATCH.replacements.items():
        peer = getattr(modules[module], name)
        peer_returns, our_returns = arities.get(name) or (None, None)
        found.append(
            Target(
                module,
                name,
                inspect.signature(peer),
                inspect.signature(getattr(ours, name)),
                peer_returns,
                our_returns,
                registries.get(name, ()),
            )
        )
    return "verl", found
