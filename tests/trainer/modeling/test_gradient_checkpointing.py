"""Gradient checkpointing changes memory, not math: the same gradients, with the blocks' forward
really run twice."""

import pytest
import torch

from fastppo.trainer.update.loss import minibatch_loss
from tests.trainer.runs import untrained


def gradients_of_one_loss(tmp_path, checkpointing: bool) -> tuple:
    trainer = untrained(tmp_path, estimator="gae", kl_coef=0.0, save=False, gradient_checkpointing=checkpointing)
    scored = trainer.rollout(0)
    rollout, scores = scored.rollout, scored.scores
    batch = trainer.prepare(rollout, scores)
    calls = []
    mlp = trainer.policy.model.layers[0].mlp  # inside a block: run again when the block is recomputed
    forward = mlp.forward  # (counted on the method: module hooks do not run in a recomputation)
    mlp.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    trainer.policy.train()
    trainer.critic.train()
    loss, _ = minibatch_loss(
        batch, trainer.models, trainer.config, trainer.state.kl_coef, batch.mask.sum(), on_policy=True
    )
    loss.backward()
    del mlp.forward
    models = (trainer.policy, trainer.critic)
    return [p.grad.clone() for m in models for p in m.parameters() if p.grad is not None], len(calls), loss


def test_checkpointed_gradients_equal_the_plain_ones(tmp_path):
    plain, plain_calls, plain_loss = gradients_of_one_loss(tmp_path / "a", False)
    ours, our_calls, our_loss = gradients_of_one_loss(tmp_path / "b", True)
    assert (plain_calls, our_calls) == (1, 2)  # recomputed in the backward: checkpointing is on
    assert len(plain) == len(ours) and len(ours) > 20  # policy and critic both have gradients
    torch.testing.assert_close(our_loss, plain_loss, rtol=0, atol=0)
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_a_checkpointed_run_learns(tmp_path, estimator):
    history = untrained(tmp_path, estimator=estimator, iterations=20, save=False, gradient_checkpointing=True).train()
    first = sum(h["reward_mean"] for h in history[:5]) / 5
    last = sum(h["reward_mean"] for h in history[-5:]) / 5
    assert last > first + 0.1, (first, last)
