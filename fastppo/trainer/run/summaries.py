"""What a run says of itself. Before it starts (``start_summary``): the model, the rewards, an
iteration's shape (with tools, its episodes' and what the python tool isolates), the first prompt
as the sampler sees it, the sampler's path (fast or generic, and why), the memory plan's total for
one device, and a note when a model of one's own keeps the defaults chosen for the shipped toy task.
When it ends (``end_summary``): the mean reward of its first and last iterations and its held-out
scores before and after, read from the whole run's ``metrics.jsonl``."""

from pathlib import Path

from ...agents import sandbox
from ...limits import GiB
from ..configuration.config import TrainConfig
from ..memory.plan import memory_plan, peak
from ..modeling.default import DEFAULT_MODEL
from .directory import read_metrics


def start_summary(config: "TrainConfig", models, rollouts, longest_prompt: int, world: int) -> list:
    """The start-up lines of a run of ``config`` training ``models`` (:class:`~fastppo.trainer.build.Models`)
    on the prompts and rewards of ``rollouts`` (:class:`~fastppo.trainer.experience.rollouts.Rollouts`) over
    ``world`` ranks."""
    c, r, policy = config, config.rollout, models.policy
    rewards, prompts, device_type = rollouts.rewards, rollouts.prompts, policy.device.type
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in policy.parameters())
    named = ", ".join(f"{name} x {weight:g}" for (name, _), weight in zip(rewards.named, rewards.weights))
    plan = memory_plan(c, policy.config, prompt_tokens=longest_prompt, device_type=device_type, world_size=world)
    return [
        f"model: {c.model.model or DEFAULT_MODEL}, {total:,} parameters ({trainable:,} trained); "
        f"{c.algo.estimator}, lr {c.optim.lr:g}; rewards: {named}",
        *([f"weights read {models.loaded}"] if world > 1 else []),
        f"each iteration: {r.prompts_per_iteration} prompts x {r.samples_per_prompt} samples"
        + (f" x {world} ranks" if world > 1 else "")
        + f", up to {r.max_new_tokens} new tokens each, of {len(prompts)} prompts; the first, as the "
        f"sampler sees it: {prompts.texts[0]!r}",
        *episodes(c, rollouts.agent),
        f"sampler: {rollouts.sampler.path}; decode attention: {rollouts.sampler.attention}" + split(models),
        "update forwards: "
        + (
            "each prompt encoded once for its samples"
            if models.shared_prefix is not None
            else f"one padded row per sample ({models.padded_because})"
        )
        + (
            f", micro-batches of <= {c.algo.max_tokens_per_microbatch} tokens"
            if c.algo.max_tokens_per_microbatch
            else ""
        ),
        f"memory plan for one {device_type} device: "
        f"{peak(plan) / GiB:.2f} GiB at its peak (the lines: fastppo train --plan)",
    ] + toy_defaults(c)


def split(models) -> str:
    """What the sampler's line adds under ``--rollout-tp``: how the copy is split, and over whom."""
    group = models.rollout_group
    if group.size == 1:
        return ""
    return (
        f"; split over {group.size} ranks (--rollout-tp: heads, MLP and vocabulary), {group.count} group(s) "
        f"each decoding its ranks' prompts together"
    )


def episodes(config: "TrainConfig", agent) -> list:
    """A line on the episodes of a run with tools, and one on what the built-in python tool isolates."""
    if agent is None:
        return []
    t = config.tools
    names = ", ".join(schema["function"]["name"] for schema in agent.schemas)
    return [
        f"episodes: tools {names}; up to {t.max_tool_calls} calling turns, {t.max_tool_tokens} tokens of "
        f"results, {t.tool_timeout:g} s a call"
    ] + ([sandbox.isolation()] if "python" in (t.tools or ()) else [])


def toy_defaults(config: "TrainConfig") -> list:
    """A note when a run of a model of one's own keeps defaults chosen for the shipped tiny model."""

    def tuned(c):
        return {"lr": c.optim.lr, "max_new_tokens": c.rollout.max_new_tokens}

    defaults = tuned(TrainConfig())
    kept = [f"{name} {value:g}" for name, value in tuned(config).items() if value == defaults[name]]
    if config.model.model is None or not kept:
        return []
    return [
        f"note: {' and '.join(kept)} are the defaults for the shipped tiny model's task; a pretrained model "
        "usually wants an lr near 1e-6 and room for hundreds of new tokens (--lr, --max-new-tokens)"
    ]


def end_summary(out: Path, held_out: int, k: int) -> list:
    """The end-of-run lines, from the whole run's ``metrics.jsonl`` (a resumed run's too): the mean
    reward of the first and last 5 iterations, and the held-out scores at the first and the last
    evaluation, each reward function's as well when there are several."""
    rows = [row for _, row in read_metrics(out / "metrics.jsonl")]
    trained = [row for row in rows if "reward_mean" in row]
    lines = []
    if trained:
        first, last = trained[:5], trained[-5:]
        lines.append(
            f"mean reward: first 5 iterations {sum(r['reward_mean'] for r in first) / len(first):.3f}, "
            f"last 5 {sum(r['reward_mean'] for r in last) / len(last):.3f} ({len(trained)} iterations); "
            f"metrics in {out}/metrics.jsonl"
        )
    evaluated = [row for row in rows if "eval/greedy" in row]
    if len(evaluated) >= 2:
        before, after = evaluated[0], evaluated[-1]
        prefixes = sorted({key[: -len("greedy")] for key in after if key.endswith("/greedy")})
        for prefix in prefixes:  # "eval/" first, then each reward's
            name = "" if prefix == "eval/" else f"{prefix[len('eval/') : -1]}: "
            passed = f"{prefix}pass@{k}"  # missing before a resume that changed eval_samples
            best = f", pass@{k} {before[passed]:.3f} -> {after[passed]:.3f}" if passed in before else ""
            lines.append(
                f"held-out ({held_out} prompts): {name}greedy {before[prefix + 'greedy']:.3f} -> "
                f"{after[prefix + 'greedy']:.3f}{best} (iteration {before['iteration']} -> "
                f"{after['iteration']})"
            )
    return lines
