"""fastppo.integrations.openrlhf against references written from each OpenRLHF version's source.

OpenRLHF is too heavy to install here (Ray, vLLM, DeepSpeed), so the references below are its
computations as the named versions write them, and each test pins the drop-ins to that version.
"""

import sys
import types

import pytest
import torch

import fastppo.integrations.openrlhf as openrlhf
from tests.oracles import relative_error


def ref_masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim)


def ref_gae(values, rewards, mask, gamma, lambd):
    values, rewards = (mask * values).double(), (mask * rewards).double()
    last, reversed_adv = 0.0, []
    T = rewards.shape[1]
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t < T - 1 else 0.0
        last = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lambd * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values


def test_openrlhf_is_not_imported():
    assert "openrlhf" not in sys.modules


def test_gae_runs_through_holes_as_zero_steps():
    values, rewards = torch.randn(4, 19), torch.randn(4, 19)
    mask = (torch.rand(4, 19) > 0.3).float()
    mask[1, -5:] = 0
    for got, want in zip(openrlhf.get_advantages_and_returns(values, rewards, mask, 0.99, 0.95),
                         ref_gae(values, rewards, mask, 0.99, 0.95)):
        assert relative_error(got, want) <= 1e-5


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_compute_approx_kl(estimator):
    new = -torch.rand(6, 9) * 3
    base = new + torch.randn(6, 9) * 4  # reaches the [-10, 10] clamp
    d = new.double() - base.double()
    expected = {"k1": d, "k2": d**2 / 2, "k3": torch.exp(-d) - 1 + d}[estimator].clamp(-10, 10)
    torch.testing.assert_close(openrlhf.compute_approx_kl(new, base, estimator).double(), expected,
                               rtol=1e-5, atol=1e-5)


def test_log_probs_from_logits_leaves_the_logits_alone():
    logits, labels = torch.randn(2, 5, 23), torch.randint(0, 23, (2, 5))
    before = logits.clone()
    out = openrlhf.log_probs_from_logits(logits, labels, temperature=0.7)
    expected = torch.log_softmax(before.double() / 0.7, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)
    assert torch.equal(logits, before) and out.dtype == torch.float32
    assert openrlhf.log_probs_from_logits(logits.bfloat16(), labels).dtype == torch.bfloat16


def ref_aggregate(loss, mask, token_level, version, dp_size=1, batch_num_tokens=None, global_batch_size=None):
    """The reduction as each OpenRLHF version writes it (``aggregate_loss`` from 0.10.3)."""
    if version < (0, 10, 3):
        return ref_masked_mean(loss, mask) if token_level else ref_masked_mean(loss, mask, dim=-1).mean()
    if token_level:
        if batch_num_tokens is None:
            return ref_masked_mean(loss, mask)
        return (loss * mask).sum() / batch_num_tokens * dp_size
    counts = mask.sum(-1)
    seq_loss, seq_mask = (loss * mask).sum(-1) / (counts + 1e-8), (counts > 0).double()
    if global_batch_size is None:
        return ref_masked_mean(seq_loss, seq_mask)
    return (seq_loss * seq_mask).sum() / global_batch_size * dp_size


def ref_policy_loss(version, new, old, adv, mask, *, low=0.2, high=0.28, dual=None, token_level=True,
                    correction=None, threshold=None, rollout=None, **batch):
    """PolicyLoss.forward as the OpenRLHF ``version`` (a tuple) writes it."""
    log_ratio = new - old
    ratio = (log_ratio.clamp(-20, 20) if version >= (0, 10, 3) else log_ratio).exp()
    surr1, surr2 = ratio * adv, ratio.clamp(1 - low, 1 + high) * adv
    if dual is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        loss = -torch.where(adv < 0, torch.max(clip1, dual * adv), clip1)
    vllm_kl = None
    if correction is not None:
        is_ratio = torch.exp(old - rollout)
        if correction == "cap":
            weights = is_ratio.clamp(max=threshold)
        elif correction == "tis":
            weights = is_ratio.clamp(min=threshold[0], max=threshold[1])
        elif correction == "icepop":
            weights = is_ratio * ((is_ratio >= threshold[0]) & (is_ratio <= threshold[1]))
        else:  # mis / seq-mask-tis
            seq = torch.exp(ref_masked_mean(old - rollout, mask, dim=-1))
            weights = ((seq >= threshold[0]) & (seq <= threshold[1])).unsqueeze(-1) * is_ratio
        loss = weights.detach() * loss
        vllm_kl = ref_masked_mean(rollout - old, mask)
    loss = ref_aggregate(loss, mask, token_level, version, **batch)
    clip_ratio = ref_masked_mean((surr2 < surr1).double(), mask)
    ppo_kl = ref_masked_mean(-log_ratio.detach(), mask)
    if version < (0, 8, 3):
        return (loss,)
    return (loss, clip_ratio, ppo_kl, vllm_kl)[:2 if version < (0, 8, 8) else 3 if version < (0, 8, 9) else 4]


# (version, PolicyLoss options for the correction, the correction that version applies)
CASES = [
    ("0.8.2", dict(), None),
    ("0.8.5", dict(), None),
    ("0.8.8", dict(), None),
    ("0.8.9", dict(vllm_is_truncated_threshold=1.5), "cap"),
    ("0.8.10", dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=1.5), "cap"),
    ("0.8.10", dict(vllm_is_truncated_threshold=1.5), None),  # no longer on without the flag
    ("0.9.1", dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.7, 1.5]), "tis"),
    ("0.9.1", dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.7, 1.5], use_icepop=True), "icepop"),
    ("0.9.3", dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.7, 1.5],
                   vllm_is_correction_type="mis"), "mis"),
    ("0.9.5", dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.7, 1.5],
                   vllm_is_correction_type="icepop"), "icepop"),
    ("0.10.2", dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.7, 1.5],
                    vllm_is_correction_type="seq-mask-tis"), "seq-mask-tis"),
    ("0.10.3", dict(), None),
    ("0.11.0", dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.7, 1.5]), "tis"),
    ("0.11.0", dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.7, 1.5],
                    vllm_is_correction_type="seq-mask-tis"), "seq-mask-tis"),
]


def version_tuple(text):
    return tuple(int(x) for x in text.split("."))


@pytest.mark.parametrize("version,options,correction", CASES)
@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("token_level", [True, False])
def test_policy_loss_as_each_version(version, options, correction, dual, token_level):
    v = version_tuple(version)
    if dual is not None and v < (0, 8, 6):
        pytest.skip("dual_clip is new in OpenRLHF 0.8.6")
    new = (-torch.rand(4, 12) * 3).requires_grad_()
    old = new.detach() + torch.randn(4, 12) * 1.5
    rollout = old + torch.randn(4, 12) * 0.4
    rollout[1] -= 1.0  # this row's geometric-mean weight (about e) is past the high threshold
    adv = torch.randn(4, 12) * 2
    mask = (torch.rand(4, 12) > 0.3).float()
    mask[:, 0] = 1
    batch = dict(dp_size=2, batch_num_tokens=70, global_batch_size=6) if v >= (0, 10, 3) else {}
    clip = dict(clip_eps=0.2) if v < (0, 8, 3) else dict(clip_eps_low=0.2, clip_eps_high=0.28)
    with openrlhf.OPENRLHF.pinned(version):
        loss_fn = openrlhf.PolicyLoss(dual_clip=dual, token_level_loss=token_level, **clip, **options)
        ours = loss_fn(new, old, adv, mask, rollout_log_probs=rollout, **batch)
    ours = ours if isinstance(ours, tuple) else (ours,)
    ref_new = new.detach().double().requires_grad_()
    expected = ref_policy_loss(v, ref_new, old.double(), adv.double(), mask.double(),
                               high=0.2 if v < (0, 8, 3) else 0.28, dual=dual, token_level=token_level,
                               correction=correction, threshold=options.get("vllm_is_truncated_threshold"),
                               rollout=rollout.double(), **batch)
    assert len(ours) == len(expected)
    for a, b in zip(ours, expected):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-6)
    ours[0].backward()
    expected[0].backward()
    assert relative_error(new.grad, ref_new.grad) <= 1e-5


def test_policy_loss_empty_masks_are_nan_as_in_openrlhf():
    new, old, adv = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    mask = torch.ones(3, 4)
    mask[1] = 0
    with openrlhf.OPENRLHF.pinned("0.10.2"):
        assert torch.isfinite(openrlhf.PolicyLoss()(new, old, adv, mask)[0])
        assert torch.isnan(openrlhf.PolicyLoss(token_level_loss=False)(new, old, adv, mask)[0])
    with openrlhf.OPENRLHF.pinned("0.11.0"):  # the empty row is left out of the sequence mean
        assert torch.isfinite(openrlhf.PolicyLoss(token_level_loss=False)(new, old, adv, mask)[0])
    assert all(torch.isnan(x) for x in openrlhf.PolicyLoss()(new, old, adv, torch.zeros(3, 4))[:3])
    with pytest.raises(ValueError, match="policy_loss_type='ppo' only"):
        openrlhf.PolicyLoss(policy_loss_type="gspo")
    with openrlhf.OPENRLHF.pinned("0.9.5"), pytest.raises(ValueError, match="must be one of tis/icepop/seq-mask-tis"):
        openrlhf.PolicyLoss(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.5, 2],
                            vllm_is_correction_type="mis")
    with openrlhf.OPENRLHF.pinned("0.10.2"), pytest.raises(TypeError, match="before 0.10.3 takes no dp_size"):
        openrlhf.PolicyLoss()(new, old, adv, mask, dp_size=2)


@pytest.mark.parametrize("version", ["0.9.0", "0.11.0"])
@pytest.mark.parametrize("clip_eps", [None, 0.2])
@pytest.mark.parametrize("token_level", [True, False])
def test_value_loss(version, clip_eps, token_level):
    values = torch.randn(4, 10).requires_grad_()
    old_values, returns = values.detach() + torch.randn(4, 10) * 0.5, torch.randn(4, 10)
    mask = (torch.rand(4, 10) > 0.3).float()
    mask[:, 0] = 1
    v = version_tuple(version)
    batch = dict(dp_size=2, batch_num_tokens=70, global_batch_size=6) if v >= (0, 10, 3) else {}
    with openrlhf.OPENRLHF.pinned(version):
        loss = openrlhf.ValueLoss(clip_eps, token_level)(values, old_values, returns, mask, **batch)
    ref = values.detach().double().requires_grad_()
    error = (ref - returns.double()) ** 2
    if clip_eps is not None:
        clipped = old_values.double() + (ref - old_values.double()).clamp(-clip_eps, clip_eps)
        error = torch.max((clipped - returns.double()) ** 2, error)
    expected = 0.5 * ref_aggregate(error, mask.double(), token_level, v, **batch)
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    loss.backward()
    expected.backward()
    assert relative_error(values.grad, ref.grad) <= 1e-5


def test_entropy_and_masked_mean():
    logits = torch.randn(3, 5, 17)
    log_p = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(openrlhf.compute_entropy(logits).double(), -(log_p.exp() * log_p).sum(-1),
                               rtol=0, atol=2e-5)
    assert openrlhf.compute_entropy(logits.bfloat16()).dtype == torch.bfloat16
    values = torch.tensor([[1.0, float("nan"), 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(openrlhf.masked_mean(values, mask), torch.tensor(2.0))
    row_means = openrlhf.masked_mean(values, mask, dim=-1)
    assert row_means[0] == 2.0 and torch.isnan(row_means[1])  # 0 / 0, as in OpenRLHF
    assert openrlhf.masked_mean(values[1:], None) == 5.0


def test_patch_swaps_the_loss_classes_and_unpatch_restores(monkeypatch):
    modules = {name: types.ModuleType(name) for name in
               ("openrlhf", "openrlhf.models", "openrlhf.models.loss", "openrlhf.models.utils",
                "openrlhf.trainer.ppo_trainer", "openrlhf.trainer.ppo_utils.experience_maker")}
    theirs = type("PolicyLoss", (), {})

    class RemoteExperienceMaker:  # its GAE is a method
        def get_advantages_and_returns(self, values, rewards, action_mask, gamma, lambd):
            return "openrlhf"

    modules["openrlhf.trainer.ppo_utils.experience_maker"].RemoteExperienceMaker = RemoteExperienceMaker
    modules["openrlhf.models.loss"].PolicyLoss = theirs
    modules["openrlhf.models"].PolicyLoss = theirs  # the package re-exports it
    modules["openrlhf.models.utils"].masked_mean = len
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    with openrlhf.patch():
        assert modules["openrlhf.models"].PolicyLoss is openrlhf.PolicyLoss
        assert modules["openrlhf.models.utils"].masked_mean is openrlhf.masked_mean
        modules["openrlhf.trainer.ppo_trainer"].PolicyLoss = modules["openrlhf.models"].PolicyLoss  # imported now
        values, rewards, mask = torch.randn(2, 5), torch.randn(2, 5), torch.ones(2, 5)
        got = RemoteExperienceMaker().get_advantages_and_returns(values, rewards, mask, 0.9, 0.8)
        for a, b in zip(got, openrlhf.get_advantages_and_returns(values, rewards, mask, 0.9, 0.8)):
            torch.testing.assert_close(a, b)
    assert modules["openrlhf.models"].PolicyLoss is modules["openrlhf.trainer.ppo_trainer"].PolicyLoss is theirs
    assert modules["openrlhf.models.utils"].masked_mean is len
    assert RemoteExperienceMaker().get_advantages_and_returns(None, None, None, 0.9, 0.8) == "openrlhf"
