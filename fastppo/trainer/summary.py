"""What a run is, said before it starts: the model, the rewards, an iteration's shape (with tools,
its episodes'), the first prompt as the sampler sees it, the memory plan's total for one device,
and a note when a model of one's own keeps the defaults chosen for the shipped toy task."""

from .config import TrainConfig
from .models import DEFAULT_MODEL
from .plan import GiB, memory_plan


def summary(config, models, rollouts, longest_prompt: int, world: int) -> list:
    """The start-up lines of a run of ``config`` training ``models`` (:class:`~fastppo.trainer.build.Models`)
    on the prompts and rewards of ``rollouts`` (:class:`~fastppo.trainer.rollouts.Rollouts`) over
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
        f"each iteration: {r.prompts_per_iteration} prompts x {r.samples_per_prompt} samples"
        + (f" x {world} ranks" if world > 1 else "")
        + f", up to {r.max_new_tokens} new tokens each, of {len(prompts)} prompts; the first, as the "
        f"sampler sees it: {prompts.texts[0]!r}",
        *episodes(c, rollouts.agent),
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
        f"{sum(line.bytes for line in plan) / GiB:.2f} GiB (the lines: fastppo train --plan)",
    ] + toy_defaults(c)


def episodes(config, agent) -> list:
    """A line on the episodes of a run with tools."""
    if agent is None:
        return []
    t = config.tools
    names = ", ".join(schema["function"]["name"] for schema in agent.schemas)
    return [
        f"episodes: tools {names}; up to {t.max_tool_calls} calling turns, {t.max_tool_tokens} tokens of "
        f"results, {t.tool_timeout:g} s a call"
    ]


def toy_defaults(config) -> list:
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
