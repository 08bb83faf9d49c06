"""Bench cases for the trainer: where one PPO iteration of a small model spends its time.

The model is the tiny one ``fastppo train`` ships, on its arithmetic task, with the default
rollout (16 prompts x 8 samples, up to 8 new tokens). Each phase is a row: the rollout
(sampling and scoring), the forward passes for old log-probs and values, the minibatch
updates, and the whole iteration. There is no naive contender: the rows split one iteration.
Bytes are the policy's weights, read at least once by every phase (a floor, not a model of the
traffic); the rate column is generated tokens per second.
"""

import tempfile

import torch

from .case import Case, Contender


def trainer_cases(device: torch.device, quick: bool) -> list:
    from ..trainer import PPOTrainer, TrainConfig

    def make():
        out = tempfile.mkdtemp(prefix="fastppo-bench-")
        trainer = PPOTrainer(TrainConfig.from_flat({"out": out, "save": False, "device": str(device)}).validate())
        rollout, scores, _, _ = trainer.rollout(0)
        return {"trainer": trainer, "rollout": rollout, "scores": scores,
                "batch": trainer.prepare(rollout, scores)}

    contenders = [
        Contender("rollout (sampler + reward)", lambda x: x["trainer"].rollout(0)),
        Contender("forward (old log-probs, values)", lambda x: x["trainer"].prepare(x["rollout"], x["scores"])),
        Contender("update (PPO minibatch steps)", lambda x: x["trainer"].update(x["batch"])),
        Contender("whole iteration", lambda x: x["trainer"].iteration(0)),
    ]
    from ..trainer.models import load_policy

    policy, _ = load_policy(None)
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())
    rows, new_tokens = 16 * 8, 8
    return [Case("trainer", f"shipped tiny model, {rows} rows x {new_tokens} tokens", make, contenders,
                 bytes_fwd=weights, items=rows * new_tokens)]
