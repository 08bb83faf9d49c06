"""The trainer's orchestration pinned against fastppo's ops called directly.

Both ranks of a two-rank test run the same code, and an end-to-end run still learns with many
plausible slips (a flipped KL sign, the wrong temperature, unwhitened advantages), so each
tensor the trainer builds from a rollout, and the loss it minimises, is recomputed here from its
definition and compared.
"""

import pytest
import torch

import fastppo
from fastppo.trainer.update.batch import response_hidden, response_values
from fastppo.trainer.update.loss import minibatch_loss
from tests.trainer.runs import TEMPERATURE, direct_logprobs, drifted, rolled_out, untrained


@torch.no_grad()
def test_gae_batch_is_whitened_gae_over_kl_shaped_rewards(tmp_path):
    trainer = drifted(tmp_path, estimator="gae", kl_coef=0.2, gamma=0.97, lam=0.9)
    scores, batch = rolled_out(trainer)
    mask = batch.mask
    old = direct_logprobs(trainer.policy, batch, TEMPERATURE)
    ref = direct_logprobs(trainer.models.reference, batch, TEMPERATURE)
    torch.testing.assert_close(batch.old_logprobs, old)
    torch.testing.assert_close(batch.ref_logprobs, ref)  # at the rollout temperature ...
    at_one = direct_logprobs(trainer.models.reference, batch, 1.0)
    assert (batch.ref_logprobs - at_one).abs().max() > 1e-2  # ... which the test can tell from 1
    values = response_values(trainer.critic, batch.layout()) * mask
    torch.testing.assert_close(batch.values, values)

    # the penalty is -kl_coef * (logp - ref_logp) per token, the score added at the last token
    kl = (old - ref) * mask
    assert kl.abs().sum() > 0.1
    rewards = -0.2 * kl
    last = mask.sum(1) - 1
    rewards[torch.arange(len(scores)), last] += scores
    torch.testing.assert_close(fastppo.token_rewards(scores, old, ref, mask, kl_coef=0.2), rewards)
    advantages, returns = fastppo.gae(rewards, values, mask, gamma=0.97, lam=0.9)
    torch.testing.assert_close(batch.returns, returns)
    valid = advantages[mask]
    whitened = (advantages - valid.mean()) / valid.std()
    torch.testing.assert_close(batch.advantages, torch.where(mask, whitened, 0.0), rtol=1e-4, atol=1e-5)
    assert abs(float(batch.advantages[mask].std()) - 1) < 1e-3


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
@torch.no_grad()
def test_critic_free_advantages_are_the_group_estimators(tmp_path, estimator):
    trainer = drifted(tmp_path, estimator=estimator, kl_coef=0.1)
    scores, batch = rolled_out(trainer)
    group = fastppo.group_advantages(scores, trainer.config.rollout.samples_per_prompt, estimator=estimator)
    expected = group[:, None].expand_as(batch.mask) * batch.mask
    if estimator == "reinforce_baseline":
        expected = fastppo.masked_whiten(expected, batch.mask)
    torch.testing.assert_close(batch.advantages, expected)
    torch.testing.assert_close(batch.ref_logprobs, direct_logprobs(trainer.models.reference, batch, TEMPERATURE))


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_the_minimised_loss_is_the_ops_loss_with_the_configured_options(tmp_path, estimator):
    fields = dict(
        estimator=estimator,
        kl_coef=0.1,
        clip_eps=0.15,
        entropy_coef=0.02,
        kl_estimator="k2",
        vf_coef=0.3,
        vf_clip=0.1,
        recompute_old_logprobs=True,
    )
    trainer = drifted(tmp_path, **fields)
    _, batch = rolled_out(trainer)
    batch.old_logprobs = batch.old_logprobs + 0.1 * torch.randn_like(batch.old_logprobs) * batch.mask  # ratios != 1
    tokens = batch.mask.sum()
    loss, stats = minibatch_loss(batch, trainer.models, trainer.config, trainer.state.kl_coef, tokens, on_policy=False)

    hidden = response_hidden(trainer.policy, batch.layout())
    head = trainer.policy.get_output_embeddings()
    kl_in_loss = estimator != "gae"  # with a critic the KL is in the reward instead
    expected, expected_stats = fastppo.ppo_loss_from_logits(
        hidden @ head.weight.T,
        batch.response_ids,
        batch.old_logprobs,
        batch.advantages,
        batch.mask,
        temperature=TEMPERATURE,
        clip_eps=0.15,
        entropy_coef=0.02,
        kl_estimator="k2",
        ref_logprobs=batch.ref_logprobs if kl_in_loss else None,
        kl_coef=0.1 if kl_in_loss else 0.0,
        num_tokens=int(tokens),
    )
    assert expected_stats["clipfrac"] > 0
    if estimator == "gae":
        values = response_values(trainer.critic, batch.layout())
        vf, _ = fastppo.value_loss(
            values, batch.values, batch.returns, batch.mask, clip_eps=0.1, num_tokens=int(tokens)
        )
        expected = expected + 0.3 * vf
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for name in ("pg_loss", "clipfrac", "entropy"):
        torch.testing.assert_close(stats[name], expected_stats[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rollout_is_cap", [None, 1.05])
def test_on_policy_old_logprobs_are_the_updates_own_with_the_same_loss_and_gradient(tmp_path, rollout_is_cap):
    """One epoch, one step per rollout: no separate pass; the update's log-probs, detached, are the
    old ones, and loss and gradient equal the fused op's given those as old log-probs."""
    trainer = drifted(tmp_path, estimator="grpo", kl_coef=0.1, entropy_coef=0.02, rollout_is_cap=rollout_is_cap)
    assert trainer.config.old_logprobs_from_update
    _, batch = rolled_out(trainer)
    assert batch.old_logprobs is None  # prepare did not compute them
    # a sampler well off the update's log-probs (as a low-precision one can be), so weights that were
    # computed and never applied would show in the loss
    batch.sampler_logprobs = batch.sampler_logprobs + 0.3 * torch.rand_like(batch.sampler_logprobs)
    tokens = batch.mask.sum()
    loss, stats = minibatch_loss(batch, trainer.models, trainer.config, trainer.state.kl_coef, tokens, on_policy=True)
    loss.backward()
    grads = [p.grad.clone() for p in trainer.policy.parameters()]
    trainer.policy.zero_grad()

    with torch.no_grad():
        old = direct_logprobs(trainer.policy, batch, TEMPERATURE)
    torch.testing.assert_close(batch.old_logprobs, old, rtol=0, atol=1e-6)
    advantages = batch.advantages
    if rollout_is_cap is not None:  # the sampler's log-probs differ a little from the update's
        weights = fastppo.rollout_is_weights(old, batch.sampler_logprobs, batch.mask, rollout_is_cap)
        assert stats["rollout_is_weight"] == pytest.approx(float(weights[batch.mask].mean()), rel=1e-5)
        assert float(weights[batch.mask].min()) < 0.9
        advantages = advantages * weights
    hidden = response_hidden(trainer.policy, batch.layout())
    head = trainer.policy.get_output_embeddings()
    expected, expected_stats = fastppo.ppo_loss_from_logits(
        hidden @ head.weight.T,
        batch.response_ids,
        old,
        advantages,
        batch.mask,
        temperature=TEMPERATURE,
        entropy_coef=0.02,
        ref_logprobs=batch.ref_logprobs,
        kl_coef=0.1,
        num_tokens=int(tokens),
    )
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for name in ("pg_loss", "entropy", "kl", "ratio_mean"):
        torch.testing.assert_close(stats[name], expected_stats[name], rtol=1e-5, atol=1e-6)
    for got, p in zip(grads, trainer.policy.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "fields",
    [dict(ppo_epochs=2), dict(minibatches=2), dict(recompute_old_logprobs=True), dict(estimator="gae", kl_coef=0.1)],
)
def test_old_logprobs_get_their_own_pass_when_the_update_is_not_on_policy(tmp_path, fields):
    trainer = untrained(tmp_path, save=False, **fields)
    assert not trainer.config.old_logprobs_from_update
    _, batch = rolled_out(trainer)
    with torch.no_grad():
        torch.testing.assert_close(batch.old_logprobs, direct_logprobs(trainer.policy, batch, 1.0))


def test_the_adaptive_kl_coefficient_follows_the_logged_rollout_kl(tmp_path):
    """coef <- coef * (1 + clip(kl / target - 1, +-0.2) * rows / horizon), fed the rollout's token-mean k1."""
    trainer = drifted(tmp_path, kl_coef=0.1, kl_target=0.05, kl_horizon=64, iterations=3)
    history = [trainer.iteration(i) for i in range(3)]
    rows = trainer.config.rollout.prompts_per_iteration * trainer.config.rollout.samples_per_prompt
    for before, after in zip(history, history[1:]):
        error = min(max(before["rollout_kl"] / 0.05 - 1, -0.2), 0.2)
        assert after["kl_coef"] == pytest.approx(before["kl_coef"] * (1 + error * rows / 64))
    assert history[0]["rollout_kl"] > 0.05  # the policy drifted: the coefficient had to move
    prepared, prepare = [], trainer.prepare
    trainer.prepare = lambda rollout, scores: prepared.append(prepare(rollout, scores)) or prepared[-1]
    metrics = trainer.iteration(3)
    (batch,) = prepared
    expected = ((batch.old_logprobs - batch.ref_logprobs) * batch.mask).sum() / batch.mask.sum()
    assert metrics["rollout_kl"] == pytest.approx(float(expected), rel=1e-5)
