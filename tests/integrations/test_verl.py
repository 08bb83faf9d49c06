"""fastppo.integrations.verl without verl: what each release changed, and the deviations.

The drop-ins are compared with verl's own released code by ``tests/peers`` (``pytest -m peers``);
these quick checks pin what each declared change means, written as relations between the
drop-ins' own results (no verl needed), so a change misdeclared in ``VERL`` fails here too.
"""

import sys
import types

import numpy as np
import pytest
import torch

import fastppo.integrations.verl as verl
from tests.oracles import relative_error

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def batch(B=4, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1
    return loss, mask


def policy_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    new = (-torch.rand(4, 11, generator=g) * 3).requires_grad_()
    old = new.detach() + torch.randn(4, 11, generator=g)
    adv = torch.randn(4, 11, generator=g) * 2
    mask = (torch.rand(4, 11, generator=g) > 0.3).float()
    mask[:, 0] = 1
    return old, new, adv, mask


CONFIG = {"clip_ratio": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}


def test_verl_is_not_imported():
    assert "verl" not in sys.modules


def test_every_release_is_declared_with_its_own_semantics():
    assert [str(r) for r in verl.VERL.releases] == ["0.6.0", "0.6.1", "0.7.0", "0.7.1", "0.8.0", "0.9.0", "0.9.1"]
    for release in verl.VERL.releases:
        with verl.VERL.pinned(str(release)):
            assert verl.VERL.release == release


@pytest.mark.parametrize("release,returns", [("0.6.0", 4), ("0.6.1", 2), ("0.9.1", 2)])
def test_policy_losses_return_what_the_release_unpacks(release, returns):
    old, new, adv, mask = policy_inputs()
    with verl.VERL.pinned(release):
        for loss in (verl.compute_policy_loss_vanilla, verl.compute_policy_loss_gspo):
            result = loss(old, new, adv, mask, config=CONFIG)
            assert len(result) == returns
            if returns == 2:
                assert set(result[1]) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
                assert all(isinstance(v, float) for v in result[1].values())


def test_seq_mean_modes_leave_empty_rows_out_from_0_6_1():
    loss, mask = batch()
    mask[2] = 0
    with verl.VERL.pinned("0.6.0"):
        assert torch.isnan(verl.agg_loss(loss, mask, "seq-mean-token-mean"))
        every_row = verl.agg_loss(loss, mask, "seq-mean-token-sum")
    with verl.VERL.pinned("0.6.1"):
        kept = verl.agg_loss(loss, mask, "seq-mean-token-sum")
        torch.testing.assert_close(kept, every_row * 4 / 3)  # 3 rows with a token, not 4
        assert torch.isfinite(verl.agg_loss(loss, mask, "seq-mean-token-mean"))


def test_global_batch_arguments_arrive_in_0_7_0():
    loss, mask = batch()
    with verl.VERL.pinned("0.6.1"), pytest.raises(TypeError, match="dp_size"):
        verl.agg_loss(loss, mask, "token-mean", dp_size=2)
    with verl.VERL.pinned("0.7.0"):
        total = (loss * mask).sum()
        torch.testing.assert_close(
            verl.agg_loss(loss, mask, "token-mean", dp_size=4, batch_num_tokens=50), total / 50 * 4
        )
        sums = (loss * mask).sum(-1).sum()
        torch.testing.assert_close(
            verl.agg_loss(loss, mask, "seq-mean-token-sum", dp_size=2, global_batch_size=8), sums / 8 * 2
        )


def test_sum_norm_divides_the_global_sequence_mean_from_0_7_1():
    """verl 0.7.1 on divides seq-mean-token-sum by the horizon; dividing the total by it instead is
    global_batch_size / dp_size times too much (fastppo 0.1.0 did, for 0.7.1 and 0.8.0)."""
    loss, mask = batch()
    info = dict(dp_size=2, batch_num_tokens=40, global_batch_size=8, loss_scale_factor=16)
    for release in ("0.7.1", "0.8.0", "0.9.1"):
        with verl.VERL.pinned(release):
            norm = verl.agg_loss(loss, mask, "seq-mean-token-sum-norm", **info)
            torch.testing.assert_close(norm, verl.agg_loss(loss, mask, "seq-mean-token-sum", **info) / 16)
    with verl.VERL.pinned("0.7.0"):
        torch.testing.assert_close(
            verl.agg_loss(loss, mask, "seq-mean-token-sum-norm", **info), (loss * mask).sum() / 16
        )


def test_data_parallel_without_global_counts_is_refused_from_0_7_1():
    loss, mask = batch()
    with verl.VERL.pinned("0.7.0"):
        verl.agg_loss(loss, mask, "token-mean", dp_size=2)
    for mode, missing in (("token-mean", "batch_num_tokens"), ("seq-mean-token-mean", "global_batch_size")):
        with verl.VERL.pinned("0.7.1"), pytest.raises(ValueError, match=missing):
            verl.agg_loss(loss, mask, mode, dp_size=2)


@pytest.mark.parametrize("mode", MODES)
def test_zero_counts_give_verls_nan_not_an_exception(mode):
    loss, mask = batch()
    with verl.VERL.pinned("0.7.0"):
        out = verl.agg_loss(loss, torch.zeros_like(mask), mode, batch_num_tokens=0, global_batch_size=0)
        assert torch.isnan(out) or mode == "seq-mean-token-sum-norm" and out == 0


def test_kl_plus_suffix_from_0_8_0():
    logprob = (-torch.rand(3, 5) * 3).requires_grad_()
    ref = logprob.detach() + torch.randn(3, 5)
    with verl.VERL.pinned("0.7.1"), pytest.raises(NotImplementedError):
        verl.kl_penalty(logprob, ref, "k3+")
    with verl.VERL.pinned("0.8.0"):
        value = verl.kl_penalty(logprob, ref, "k3+")
        torch.testing.assert_close(value, verl.kl_penalty(logprob, ref, "k3"))
        value.sum().backward()
        torch.testing.assert_close(logprob.grad, (logprob - ref).detach())  # k2's gradient


def test_token_sum_and_the_critics_global_batch_from_0_9_0():
    loss, mask = batch()
    vpreds, returns, values = torch.randn(4, 9), torch.randn(4, 9), torch.randn(4, 9)
    with verl.VERL.pinned("0.8.0"):
        with pytest.raises(ValueError, match="token-sum"):
            verl.agg_loss(loss, mask, "token-sum")
        with pytest.raises(TypeError, match="dp_size"):
            verl.compute_value_loss(vpreds, returns, values, mask, 0.2, dp_size=2)
    with verl.VERL.pinned("0.9.0"):
        torch.testing.assert_close(verl.agg_loss(loss, mask, "token-sum", dp_size=2), (loss * mask).sum() * 2)
        plain, _ = verl.compute_value_loss(vpreds, returns, values, mask, 0.2)
        scaled, _ = verl.compute_value_loss(
            vpreds, returns, values, mask, 0.2, dp_size=2, batch_num_tokens=int(mask.sum()) * 2
        )
        torch.testing.assert_close(scaled, plain)


def test_gspo_follows_loss_agg_mode_from_0_9_1():
    old, new, adv, mask = policy_inputs()
    results = {}
    for release in ("0.9.0", "0.9.1"):
        with verl.VERL.pinned(release):
            results[release] = [
                verl.compute_policy_loss_gspo(old, new, adv, mask, mode, CONFIG)[0]
                for mode in ("token-mean", "seq-mean-token-mean")
            ]
    assert results["0.9.0"][0] == results["0.9.0"][1]  # always seq-mean-token-mean
    assert results["0.9.1"][0] != results["0.9.1"][1]
    torch.testing.assert_close(results["0.9.1"][1], results["0.9.0"][1])


def test_reinforce_plus_plus_carries_returns_across_observation_spans_from_0_9_0():
    rewards = torch.zeros(1, 6)
    rewards[0, 5] = 1.0
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])  # a tool's observation at 2 and 3
    config = types.SimpleNamespace(gamma=0.5)
    with verl.VERL.pinned("0.8.0"):
        _, returns = verl.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config)
        torch.testing.assert_close(returns[0], torch.tensor([0.0, 0.0, 0.0, 0.25, 0.5, 1.0]))  # cut after the span
    with verl.VERL.pinned("0.9.0"):
        _, returns = verl.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config)
        torch.testing.assert_close(returns[0], torch.tensor([0.125, 0.25, 0.0, 0.0, 0.5, 1.0]))


def test_gae_writes_the_carried_advantage_at_masked_positions():
    rewards, values = torch.randn(2, 8), torch.randn(2, 8)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]).float()
    advantages, returns = verl.compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    raw = returns - values  # before whitening: the advantage, carried through masked positions
    torch.testing.assert_close(raw[0, 2:5], raw[0, 4].expand(3))
    torch.testing.assert_close(raw[0, 6:], torch.zeros(2))
    assert (advantages[0, 6:] != 0).all()  # whitening moves every position, masked ones too


def test_grpo_and_rloo_on_verls_uid_arrays():
    rewards = torch.zeros(5, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 2.0, 4.0, 1.0])
    mask = torch.ones(5, 3)
    uids = np.array(["a", "b", "a", "c", "b"], dtype=object)  # "c" alone
    grpo, _ = verl.compute_grpo_outcome_advantage(rewards, mask, uids)
    torch.testing.assert_close(grpo[3, 0], torch.tensor(4.0 / (1 + 1e-6)))
    torch.testing.assert_close(grpo[0, 0], torch.tensor(-0.5 / (float(np.std([1.0, 2.0], ddof=1)) + 1e-6)))
    rloo, _ = verl.compute_rloo_outcome_advantage(rewards, mask, uids)
    torch.testing.assert_close(rloo[:, 0], torch.tensor([-1.0, -1.0, 1.0, 4.0, 1.0]))


def test_deviation_masked_positions_are_ignored():
    loss, mask = batch()
    dirty = torch.where(mask.bool(), loss, torch.tensor(float("nan"))).requires_grad_()
    for mode in MODES:
        out = verl.agg_loss(dirty, mask, mode)
        torch.testing.assert_close(out, verl.agg_loss(loss, mask, mode))
        (grad,) = torch.autograd.grad(out, dirty)
        assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()


def test_deviation_a_negative_rollout_weight_poisons_the_loss():
    old, new, adv, mask = policy_inputs()
    weights = torch.rand(4, 11)
    loss, _ = verl.compute_policy_loss_vanilla(old, new, adv, mask, config=CONFIG, rollout_is_weights=weights)
    assert torch.isfinite(loss)
    weights[0, 0] = -0.5
    loss, _ = verl.compute_policy_loss_vanilla(old, new, adv, mask, config=CONFIG, rollout_is_weights=weights)
    assert torch.isnan(loss)
    weights[mask == 0] = -1.0
    weights[0, 0] = 0.5
    loss, _ = verl.compute_policy_loss_vanilla(old, new, adv, mask, config=CONFIG, rollout_is_weights=weights)
    assert torch.isfinite(loss)  # a masked position's weight is ignored like anything else there


def test_deviation_entropy_with_neg_inf_logits_is_finite():
    logits = torch.randn(3, 17)
    logits[:, :5] = -float("inf")
    entropy = verl.entropy_from_logits(logits)
    log_p = torch.log_softmax(logits[:, 5:].double(), -1)
    torch.testing.assert_close(entropy.double(), -(log_p.exp() * log_p).sum(-1), rtol=0, atol=2e-5)


def test_logprobs_come_out_fp32_and_closer_to_float64_than_bf16():
    logits, labels = torch.randn(3, 5, 17).bfloat16(), torch.randint(0, 17, (3, 5))
    log_p = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0]
    ours = verl.logprobs_from_logits(logits, labels)
    assert ours.dtype == torch.float32
    assert relative_error(ours.double(), log_p) <= 1e-6


@pytest.fixture
def fake_verl(monkeypatch):
    """The installed-verl layout patch() walks: two modules and the policy-loss registry."""

    def original_vanilla(*args, **kwargs):
        return "verl"

    modules = {
        name: types.ModuleType(name)
        for name in (
            "verl",
            "verl.trainer",
            "verl.trainer.ppo",
            "verl.trainer.ppo.core_algos",
            "verl.utils",
            "verl.utils.torch_functional",
            "verl.workers.actor.dp_actor",
        )
    }
    core = modules["verl.trainer.ppo.core_algos"]
    core.compute_policy_loss_vanilla = original_vanilla
    core.POLICY_LOSS_REGISTRY = {"vanilla": original_vanilla}
    modules["verl.utils.torch_functional"].masked_mean = len
    modules["verl.workers.actor.dp_actor"].compute_policy_loss_vanilla = original_vanilla
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules, original_vanilla


def test_patch_reaches_the_registry_and_unpatch_restores(fake_verl):
    modules, original = fake_verl
    core = modules["verl.trainer.ppo.core_algos"]
    with verl.patch():
        assert core.POLICY_LOSS_REGISTRY["vanilla"] is verl.compute_policy_loss_vanilla
        assert modules["verl.workers.actor.dp_actor"].compute_policy_loss_vanilla is verl.compute_policy_loss_vanilla
        assert modules["verl.utils.torch_functional"].masked_mean is verl.masked_mean
    assert core.POLICY_LOSS_REGISTRY["vanilla"] is original is core.compute_policy_loss_vanilla
    assert modules["verl.utils.torch_functional"].masked_mean is len


def test_patch_without_verl_is_a_clear_import_error():
    with pytest.raises(ImportError, match="needs verl: pip install verl"):
        verl.patch()


@pytest.mark.parametrize("release", ["0.7.1", "0.9.1"])
@pytest.mark.parametrize("mode", MODES)
def test_an_all_masked_batch_is_a_nan_loss_with_verls_zero_gradient(release, mode):
    """verl divides its masked sum by a count of 0 behind a ``where``: the loss is NaN (or 0 for
    the sum-norm mode), and the gradient 0; a NaN gradient would poison the accumulated step."""
    old, new, adv, mask = policy_inputs()
    with verl.VERL.pinned(release):
        loss, _ = verl.compute_policy_loss_vanilla(
            old, new, adv, torch.zeros_like(mask), loss_agg_mode=mode, config=CONFIG
        )
        (grad,) = torch.autograd.grad(loss, new)
    assert torch.isnan(loss) or mode == "seq-mean-token-sum-norm"
    assert torch.equal(grad, torch.zeros_like(grad))


def test_verl_0_6_0s_sequence_mean_with_an_empty_row_is_nan_in_that_rows_gradient():
    """0.6.0 averages every row's mean, an empty row's 0 / 0 included: NaN in the value and in that
    row's gradient, the other rows' gradient 1/B of their own means'."""
    old, new, adv, mask = policy_inputs()
    loss_mat = new * 1.0
    mask[2] = 0
    with verl.VERL.pinned("0.6.0"):
        out = verl.agg_loss(loss_mat, mask, "seq-mean-token-mean")
        (grad,) = torch.autograd.grad(out, new)
    assert torch.isnan(out) and torch.isnan(grad[2]).all() and torch.isfinite(grad[[0, 1, 3]]).all()
    expected = mask / mask.sum(dim=1, keepdim=True) / 4
    torch.testing.assert_close(grad[[0, 1, 3]], expected[[0, 1, 3]])
