"""fastppo.integrations.verl against references written from each supported verl's source.

verl is too heavy to install here (Ray, vLLM), so each reference below is verl's computation as
the named version writes it, and each test runs the drop-ins pinned to that version.
"""

import sys
import types

import numpy as np
import pytest
import torch

import fastppo.integrations.verl as verl
from tests.oracles import relative_error


def ref_masked_mean(x, mask):
    return torch.where(mask.bool(), x, 0.0).mul(mask).sum() / (mask.sum() + 1e-8)


def ref_whiten(x, mask):
    mean = ref_masked_mean(x, mask)
    var = ref_masked_mean((x - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def ref_gae(rewards, values, mask, gamma, lam):
    """verl's loop: masked positions carry the next valid position's value and advantage."""
    rewards, values, mask = rewards.double(), values.double(), mask.double()
    next_value, last = 0.0, 0.0
    reversed_adv = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last = candidate * mask[:, t] + (1 - mask[:, t]) * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return ref_whiten(advantages, mask), advantages + values


def test_verl_is_not_imported():
    assert "verl" not in sys.modules


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_gae_reproduces_verl_at_masked_positions_too(gamma, lam):
    rewards, values = torch.randn(4, 23), torch.randn(4, 23)
    mask = (torch.rand(4, 23) > 0.3).float()
    mask[0, :5] = 0  # a leading masked run
    mask[1, -6:] = 0  # a trailing one (verl writes 0 there)
    advantages, returns = verl.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    expected_adv, expected_ret = ref_gae(rewards, values, mask, gamma, lam)
    assert relative_error(advantages, expected_adv) <= 1e-5 and relative_error(returns, expected_ret) <= 1e-5
    assert (advantages[1, -6:] != 0).all()  # whitening moves the masked zeros too, as verl does


@pytest.mark.parametrize("mode", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_penalty(mode):
    logprob = -torch.rand(5, 7) * 3
    ref = logprob + torch.randn(5, 7) * 4  # large gaps reach verl's [-10, 10] clamp
    d = logprob.double() - ref.double()
    kl = ref.double() - logprob.double()
    expected = {"kl": d, "k1": d, "abs": d.abs(), "mse": 0.5 * d**2, "k2": 0.5 * d**2}.get(mode)
    if expected is None:
        kl = kl.clamp(-20, 20)
        expected = (torch.exp(kl) - kl - 1).clamp(-10, 10)
    torch.testing.assert_close(verl.kl_penalty(logprob, ref, mode).double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError):
        verl.kl_penalty(logprob, ref, "full")


VERSIONS = ["0.6.0", "0.7.0", "0.8.0"]  # 0.8.0: main (0.8.0.dev); 0.7 and main share these functions
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def ref_agg(loss, mask, mode, version, dp_size=1, batch_num_tokens=None, global_batch_size=None,
            loss_scale_factor=None):
    """agg_loss as each verl version writes it."""
    if version < "0.7":
        if mode == "token-mean":
            return ref_masked_mean(loss, mask)
        if mode == "seq-mean-token-sum":
            return (loss * mask).sum(-1).mean()
        if mode == "seq-mean-token-mean":
            return ((loss * mask).sum(-1) / mask.sum(-1)).mean()
        return (loss * mask).sum() / mask.shape[-1]
    if mode == "token-mean":
        tokens = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss * mask).sum() / tokens * dp_size
    if mode == "seq-mean-token-sum-norm":
        return (loss * mask).sum() / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    seq_losses = (loss * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (mask.sum(-1) + 1e-8)
    rows = (mask.sum(-1) > 0).float()
    sequences = rows.sum() if global_batch_size is None else global_batch_size
    return (seq_losses * rows).sum() / sequences * dp_size


def batch_info(version, full=True):
    if version < "0.7":
        return {}
    return dict(dp_size=4, batch_num_tokens=150, global_batch_size=12, loss_scale_factor=64) if full else \
        dict(dp_size=2)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss(version, mode):
    loss, mask = torch.randn(4, 9), (torch.rand(4, 9) > 0.3).float()
    mask[:, 0] = 1
    with verl.VERL.pinned(version):
        torch.testing.assert_close(verl.agg_loss(loss, mask, mode), ref_agg(loss, mask, mode, version))
        for info in (batch_info(version), batch_info(version, full=False)):
            torch.testing.assert_close(verl.agg_loss(loss, mask, mode, **info),
                                       ref_agg(loss, mask, mode, version, **info))
        mask[2] = 0  # an empty row: verl 0.6's seq-mean-token-mean is NaN; from 0.7 the row is left out
        out = verl.agg_loss(loss, mask, mode)
        assert torch.isnan(out) == (version < "0.7" and mode == "seq-mean-token-mean")
        torch.testing.assert_close(out, ref_agg(loss, mask, mode, version), equal_nan=True)
        nothing = torch.zeros_like(mask)  # 0 / 0 is NaN from 0.7, except in the -norm mode
        out = verl.agg_loss(loss, nothing, mode)
        assert torch.isnan(out) == (mode == "seq-mean-token-mean" or version >= "0.7" and mode != "seq-mean-token-sum-norm")
        torch.testing.assert_close(out, ref_agg(loss, nothing, mode, version), equal_nan=True)
    if version < "0.7":
        with verl.VERL.pinned(version), pytest.raises(TypeError, match="takes no global-batch arguments"):
            verl.agg_loss(loss, mask, mode, dp_size=2)


def ref_vanilla(old, new, adv, mask, mode, version, weights=None, low=0.2, high=0.28, clip_c=3.0, **info):
    lr = (new - old).clamp(-20, 20)
    ratio = lr.exp()
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
    clipped = torch.maximum(pg1, pg2)
    pg3 = -adv * clip_c
    losses = torch.where(adv < 0, torch.min(pg3, clipped), clipped)
    if weights is not None:
        losses = losses * weights
    lower = ref_masked_mean((torch.gt(clipped, pg3) & (adv < 0)).float(), mask)
    return (ref_agg(losses, mask, mode, version, **info), ref_masked_mean((pg2 > pg1).float(), mask),
            ref_masked_mean(-lr, mask), lower)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_vanilla_policy_loss(version, mode, weighted):
    new = (-torch.rand(4, 11) * 3).requires_grad_()
    old = new.detach() + torch.randn(4, 11) * 1.5  # ratios past clip_ratio_c for some tokens
    adv = torch.randn(4, 11) * 2
    mask = (torch.rand(4, 11) > 0.3).float()
    mask[:, 0] = 1
    weights = torch.rand(4, 11) * 2 + 0.05 if weighted else None
    info = batch_info(version)
    config = {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
              "global_batch_info": info}
    with verl.VERL.pinned(version):
        ours = verl.compute_policy_loss_vanilla(old, new, adv, mask, mode, config, rollout_is_weights=weights)
    ref_new = new.detach().double().requires_grad_()
    expected = ref_vanilla(old.double(), ref_new, adv.double(), mask.double(), mode, version,
                           None if weights is None else weights.double(), **info)
    if version >= "0.7":
        loss, metrics = ours
        assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
        assert all(isinstance(v, float) for v in metrics.values())
        ours = (loss, *map(torch.tensor, metrics.values()))
    assert len(ours) == 4
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-6)
    ours[0].backward()
    expected[0].backward()
    assert relative_error(new.grad, ref_new.grad) <= 1e-5
    assert expected[3] > 0  # dual clipping was exercised


def ref_gspo(old, new, adv, mask, version, weights=None, low=0.2, high=0.28, **info):
    """verl's GSPO as written: the sequence ratio's value, each token's own gradient."""
    lr = new - old
    seq = (lr * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_ratio = (new - new.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
    losses = torch.maximum(pg1, pg2)
    if weights is not None:
        losses = losses * weights
    loss = ref_agg(losses, mask, "seq-mean-token-mean", version, **info)
    return loss, ref_masked_mean((pg2 > pg1).float(), mask), ref_masked_mean(-lr, mask), torch.zeros(())


@pytest.mark.parametrize("version", ["0.6.0", "0.8.0"])
@pytest.mark.parametrize("weighted", [False, True])
def test_gspo_policy_loss(version, weighted):
    new = (-torch.rand(4, 11) * 3).requires_grad_()
    old = new.detach() + torch.randn(4, 11) * 0.3
    old[0] -= 12.0  # a sequence ratio past verl's clamp at e^10: no gradient there
    adv = torch.randn(4, 1) * torch.ones(4, 11) + torch.randn(4, 11) * 0.1  # near GRPO's constant per row
    adv[0] = -adv[0].abs() - 0.5  # negative: the unclipped term, with the clamped ratio, wins
    mask = (torch.rand(4, 11) > 0.3).float()
    mask[:, 0] = 1
    mask[3] = 0  # an empty row
    weights = torch.rand(4, 11) + 0.5 if weighted else None
    info = batch_info(version, full=False)
    config = {"clip_ratio": 0.2, "clip_ratio_high": 0.28, "global_batch_info": info}
    with verl.VERL.pinned(version):
        ours = verl.compute_policy_loss_gspo(old, new, adv, mask, config=config, rollout_is_weights=weights)
    if version >= "0.7":
        ours = (ours[0], *map(torch.tensor, ours[1].values()))
    ref_new = new.detach().double().requires_grad_()
    expected = ref_gspo(old.double(), ref_new, adv.double(), mask.double(), version,
                        None if weights is None else weights.double(), **info)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a.double(), b.detach().double(), rtol=1e-5, atol=1e-6, equal_nan=True)
    if version >= "0.7":  # verl 0.6 averages over every row, so the empty one makes the loss NaN
        ours[0].backward()
        expected[0].backward()
        assert relative_error(new.grad, ref_new.grad) <= 1e-5 and (new.grad[0] == 0).all()


def test_deprecated_compute_policy_loss():
    new, adv = -torch.rand(3, 8) * 3, torch.randn(3, 8)
    old = new + torch.randn(3, 8)
    mask = (torch.rand(3, 8) > 0.2).float()
    ours = verl.compute_policy_loss(old, new, adv, mask, cliprange=0.2, cliprange_high=0.28, clip_ratio_c=3.0)
    expected = ref_vanilla(old.double(), new.double(), adv.double(), mask.double(), "token-mean", "0.8")
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("version", ["0.6.0", "0.8.0"])
@pytest.mark.parametrize("mode", MODES)
def test_value_loss(version, mode):
    vpreds = torch.randn(4, 10).requires_grad_()
    values, returns = vpreds.detach() + torch.randn(4, 10) * 0.5, torch.randn(4, 10)
    mask = (torch.rand(4, 10) > 0.3).float()
    mask[:, 0] = 1
    with verl.VERL.pinned(version):
        loss, clipfrac = verl.compute_value_loss(vpreds, returns, values, mask, 0.2, mode)
    ref = vpreds.detach().double().requires_grad_()
    clipped = values.double() + (ref - values.double()).clamp(-0.2, 0.2)
    l1, l2 = (ref - returns.double()) ** 2, (clipped - returns.double()) ** 2
    expected = 0.5 * ref_agg(torch.max(l1, l2), mask.double(), mode, version)
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(clipfrac.double(), ref_masked_mean((l2 > l1).double(), mask.double()).detach())
    loss.backward()
    expected.backward()
    assert relative_error(vpreds.grad, ref.grad) <= 1e-5


def ref_group_scores(scores, index):
    groups = {}
    for i, uid in enumerate(index):
        groups.setdefault(uid, []).append(scores[i])
    return groups


def ref_grpo(rewards, mask, index, epsilon=1e-6, norm=True):
    """verl's loop: a group of one has mean 0 and std 1."""
    scores = rewards.sum(-1).clone()
    groups = {uid: torch.stack(v) for uid, v in ref_group_scores(scores, index).items()}
    stats = {uid: (v.mean(), v.std()) if len(v) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
             for uid, v in groups.items()}
    for i, uid in enumerate(index):
        mean, std = stats[uid]
        scores[i] = (scores[i] - mean) / (std + epsilon) if norm else scores[i] - mean
    return scores.unsqueeze(-1) * mask


def ref_rloo(rewards, mask, index):
    scores = rewards.sum(-1).clone()
    groups = {uid: torch.stack(v) for uid, v in ref_group_scores(scores, index).items()}
    for i, uid in enumerate(index):
        n = len(groups[uid])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - groups[uid].mean() * n / (n - 1)
    return scores.unsqueeze(-1) * mask


def outcome_batch():
    """Three prompts in shuffled order: groups of 3, 2 and 1 (verl passes uids as a NumPy array)."""
    index = np.array(["b", "a", "c", "a", "b", "b"], dtype=object)
    mask = (torch.rand(6, 7) > 0.2).float()
    rewards = torch.zeros(6, 7)
    rewards[torch.arange(6), torch.randint(0, 7, (6,))] = torch.randn(6)
    return rewards, mask, index


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_outcome_advantage(norm):
    rewards, mask, index = outcome_batch()
    advantages, returns = verl.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    expected = ref_grpo(rewards, mask, index, norm=norm)
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-6)
    assert returns is advantages or torch.equal(returns, advantages)
    lone = 2  # the group of one: score / (1 + epsilon)
    torch.testing.assert_close(advantages[lone], rewards[lone].sum() / (1 + 1e-6) * mask[lone])


def test_rloo_outcome_advantage():
    rewards, mask, index = outcome_batch()
    advantages, _ = verl.compute_rloo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(advantages, ref_rloo(rewards, mask, index), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(advantages[2], rewards[2].sum() * mask[2])  # a lone response keeps its score


def test_reinforce_plus_plus_outcome_advantage():
    rewards, mask = torch.randn(4, 9), (torch.rand(4, 9) > 0.3).float()
    mask[:, 0] = 1
    gamma = 0.9
    returns = torch.zeros_like(rewards)  # verl's loop
    running = 0
    for t in reversed(range(9)):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    advantages, got_returns = verl.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, {"gamma": gamma})
    torch.testing.assert_close(got_returns, returns, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(advantages, ref_whiten(returns, mask) * mask, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs config"):
        verl.compute_reinforce_plus_plus_outcome_advantage(rewards, mask)


@pytest.mark.parametrize("mode", ["k1+", "k3+", "low_var_kl+", "abs+", "k2+"])
def test_kl_straight_through_takes_k2s_gradient(mode):
    logprob = (-torch.rand(3, 5) * 3).requires_grad_()
    ref = logprob.detach() + torch.randn(3, 5)
    value = verl.kl_penalty(logprob, ref, mode)
    torch.testing.assert_close(value, verl.kl_penalty(logprob, ref, mode[:-1]))
    value.sum().backward()
    torch.testing.assert_close(logprob.grad, (logprob - ref).detach())  # d/dx of (x - ref)^2 / 2


def test_logprobs_and_entropy():
    logits, labels = torch.randn(3, 5, 17).bfloat16(), torch.randint(0, 17, (3, 5))
    log_p = torch.log_softmax(logits.double(), -1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(verl.logprobs_from_logits(logits, labels).double(),
                               log_p.gather(-1, labels[..., None])[..., 0], rtol=0, atol=1e-4)
    torch.testing.assert_close(verl.entropy_from_logits(logits).double(), entropy, rtol=0, atol=1e-4)
    chunked = verl.entropy_from_logits_with_chunking(logits.reshape(15, 17), chunk_size=4)
    assert chunked.dtype == torch.float32 and chunked.shape == (15,)
    torch.testing.assert_close(chunked.double(), entropy.reshape(15), rtol=0, atol=1e-4)


def test_masked_sum_and_mean_ignore_whatever_is_masked():
    values = torch.tensor([[1.0, float("nan"), 3.0], [4.0, 5.0, float("inf")]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    assert verl.masked_sum(values, mask) == 13.0
    torch.testing.assert_close(verl.masked_mean(values, mask), torch.tensor(13.0 / (4 + 1e-8)))
    torch.testing.assert_close(verl.masked_mean(values, mask, axis=-1), torch.tensor([2.0, 4.5]))


@pytest.fixture
def fake_verl(monkeypatch):
    """The installed-verl layout patch() walks: two modules and the policy-loss registry."""
    def original_vanilla(*args, **kwargs):
        return "verl"

    modules = {name: types.ModuleType(name) for name in
               ("verl", "verl.trainer", "verl.trainer.ppo", "verl.trainer.ppo.core_algos", "verl.utils",
                "verl.utils.torch_functional", "verl.workers.actor.dp_actor")}
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
