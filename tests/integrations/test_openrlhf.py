"""fastppo.integrations.openrlhf without OpenRLHF: what each release changed, and the deviations.

The drop-ins are compared with OpenRLHF's own released code by ``tests/peers`` (``pytest -m
peers``); these quick checks pin what each declared change means, as relations between the
drop-ins' own results or small hand-computed values, so a change misdeclared in ``OPENRLHF``
fails here too.
"""

import inspect
import sys
import types

import pytest
import torch

import fastppo.integrations.openrlhf as openrlhf

PEER = openrlhf.OPENRLHF


def inputs(seed=0, B=4, T=12):
    g = torch.Generator().manual_seed(seed)
    new = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = new.detach() + torch.randn(B, T, generator=g)
    rollout = old + torch.randn(B, T, generator=g) * 0.4
    adv = torch.randn(B, T, generator=g) * 2
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1
    return new, old, rollout, adv, mask


def test_openrlhf_is_not_imported():
    assert "openrlhf" not in sys.modules


def test_every_release_post_releases_included_is_declared():
    releases = [str(r) for r in PEER.releases]
    assert releases[0] == "0.8.0" and releases[-1] == "0.11.2" and len(releases) == 37
    assert {"0.8.0.post1", "0.8.9.post1", "0.9.1.post1", "0.10.1.post1", "0.10.1.post2"} <= set(releases)


@pytest.mark.parametrize("release,clamped", [("0.8.5", False), ("0.8.6", True)])
def test_kl_estimates_are_clamped_from_0_8_6(release, clamped):
    new = torch.tensor([[-0.1, -0.2]])
    base = torch.tensor([[-20.0, -0.3]])  # log-ratio 19.9: k1 19.9, k3 18.9
    with PEER.pinned(release):
        for estimator, raw in (("k1", 19.9), ("k3", 18.9)):
            value = openrlhf.compute_approx_kl(new, base, kl_estimator=estimator)[0, 0]
            torch.testing.assert_close(value, torch.tensor(10.0 if clamped else raw), rtol=1e-5, atol=1e-4)


def test_compute_approx_kl_takes_log_probs_old_third_from_0_11_1():
    new, old, _, _, _ = inputs()
    base = old + 0.5
    with PEER.pinned("0.11.0"):
        assert list(inspect.signature(openrlhf.compute_approx_kl).parameters) == [
            "log_probs",
            "log_probs_base",
            "kl_estimator",
        ]
        k3 = openrlhf.compute_approx_kl(new, base, "k3")
        with pytest.raises(TypeError, match="unbiased_gradient"):
            openrlhf.compute_approx_kl(new, base, kl_estimator="k3", unbiased_gradient=True)
    with PEER.pinned("0.11.1"):
        torch.testing.assert_close(openrlhf.compute_approx_kl(new, base, None, "k3"), k3)
        value = openrlhf.compute_approx_kl(new, base, log_probs_old=old, kl_estimator="k3", unbiased_gradient=True)
        torch.testing.assert_close(value, k3)
        value.sum().backward()
        weight = (new - old).exp().clamp(max=10.0).detach()
        torch.testing.assert_close(new.grad, weight * (new - base).detach())  # k2's gradient, weighted


def test_policy_loss_constructor_follows_each_release():
    with PEER.pinned("0.8.0"):
        loss = openrlhf.PolicyLoss(0.1)  # 0.8.0's one clip range, given positionally
        assert (loss.clip_eps_low, loss.clip_eps_high) == (0.1, 0.1)
    with PEER.pinned("0.8.2"):
        loss = openrlhf.PolicyLoss(0.1)  # the lower range alone from 0.8.2
        assert (loss.clip_eps_low, loss.clip_eps_high) == (0.1, 0.2)
        with pytest.raises(TypeError, match="dual_clip"):
            openrlhf.PolicyLoss(dual_clip=3.0)
    with PEER.pinned("0.11.1"), pytest.raises(TypeError, match="is_correction_level"):
        openrlhf.PolicyLoss(is_correction_level="token")
    with PEER.pinned("0.11.2"):
        assert "is_correction_level" in inspect.signature(openrlhf.PolicyLoss).parameters
        with pytest.raises(ValueError, match="is_correction_mode=clip requires"):
            openrlhf.PolicyLoss(is_correction_level="seq", is_correction_mode="clip")


@pytest.mark.parametrize(
    "release,returned", [("0.8.2", 1), ("0.8.3", 2), ("0.8.8", 3), ("0.8.9", 4), ("0.11.1", 4), ("0.11.2", 5)]
)
def test_policy_loss_returns_what_the_release_unpacks(release, returned):
    new, old, rollout, adv, mask = inputs()
    with PEER.pinned(release):
        result = openrlhf.PolicyLoss()(new, old, adv, mask)
    assert (len(result) if isinstance(result, tuple) else 1) == returned


def test_the_correction_type_mis_is_renamed_seq_mask_tis_in_0_9_4():
    options = dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.5, 2.0])
    with PEER.pinned("0.9.3"):
        openrlhf.PolicyLoss(vllm_is_correction_type="mis", **options)
    with PEER.pinned("0.9.4"), pytest.raises(ValueError, match="tis/icepop/seq-mask-tis"):
        openrlhf.PolicyLoss(vllm_is_correction_type="mis", **options)
    with PEER.pinned("0.9.4"), pytest.raises(ValueError, match="tis/icepop/seq-mask-tis"):
        openrlhf.PolicyLoss(vllm_is_correction_type="nonsense")  # checked even with the correction off


def test_ppo_kl_reports_the_rollout_log_ratio_with_a_correction_from_0_9_3_to_0_10_2():
    """Those releases reuse ``log_ratio`` for ``old - rollout`` inside the correction, and report it."""
    new, old, rollout, adv, mask = inputs()
    options = dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.5, 2.0])
    for release, expected in (("0.9.3", rollout - old), ("0.10.2", rollout - old), ("0.10.3", old - new.detach())):
        with PEER.pinned(release):
            ppo_kl = openrlhf.PolicyLoss(**options)(new, old, adv, mask, rollout_log_probs=rollout)[2]
        torch.testing.assert_close(ppo_kl, openrlhf.masked_mean(expected, mask))


def test_the_sequence_mean_leaves_empty_rows_out_from_0_10_3():
    new, old, _, adv, mask = inputs()
    mask[1] = 0
    with PEER.pinned("0.10.2"):
        assert torch.isnan(openrlhf.PolicyLoss(token_level_loss=False)(new, old, adv, mask)[0])
        with pytest.raises(TypeError, match="dp_size"):
            openrlhf.PolicyLoss()(new, old, adv, mask, dp_size=2)
    with PEER.pinned("0.10.3"):
        assert torch.isfinite(openrlhf.PolicyLoss(token_level_loss=False)(new, old, adv, mask)[0])
        with pytest.raises(TypeError, match="needs action_mask"):
            openrlhf.PolicyLoss(token_level_loss=False)(new, old, adv)


def test_is_correction_gates_of_0_11_2():
    new, old, rollout, adv, mask = inputs()
    with PEER.pinned("0.11.2"):
        plain = openrlhf.PolicyLoss()(new, old, adv, mask, rollout_log_probs=rollout)
        assert plain[3] is None and plain[4] is None
        gated = openrlhf.PolicyLoss(is_correction_level="seq", is_correction_threshold=[1e9, 2e9])
        loss, _, _, vllm_kl, filtered = gated(new, old, adv, mask, rollout_log_probs=rollout)
        assert loss == 0 and filtered == 1.0  # every row out of the band: nothing left to learn from
        torch.testing.assert_close(vllm_kl, openrlhf.masked_mean(rollout - old, mask))


def test_another_policy_loss_type_needs_openrlhfs_own_class():
    with pytest.raises(ValueError, match="runs OpenRLHF's own PolicyLoss"):
        openrlhf.PolicyLoss(policy_loss_type="gspo")


def test_deviation_masked_positions_are_ignored():
    new, old, _, adv, mask = inputs()
    dirty = torch.where(mask.bool(), new.detach(), torch.tensor(float("nan"))).requires_grad_()
    for level in (True, False):
        clean = openrlhf.PolicyLoss(token_level_loss=level)(new, old, adv, mask)
        out = openrlhf.PolicyLoss(token_level_loss=level)(dirty, old, adv, mask)
        torch.testing.assert_close(out[0], clean[0])
        (grad,) = torch.autograd.grad(out[0], dirty)
        assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()


def test_deviation_log_ratios_are_clamped_before_exp_on_every_release():
    new = torch.tensor([[0.0]])
    old = torch.tensor([[-30.0]])  # log-ratio 30
    adv = torch.tensor([[-1.0]])
    with PEER.pinned("0.10.2"):  # OpenRLHF would give e^30 here
        loss = openrlhf.PolicyLoss()(new, old, adv)[0]
    torch.testing.assert_close(loss, torch.exp(torch.tensor(20.0)))


def test_deviation_a_negative_correction_weight_poisons_the_loss():
    new, old, rollout, adv, mask = inputs()
    with PEER.pinned("0.9.3"):
        loss = openrlhf.PolicyLoss(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[-2.0, -1.0])
        assert torch.isnan(loss(new, old, adv, mask, rollout_log_probs=rollout)[0])


def test_deviation_log_probs_from_logits_leaves_the_logits_alone():
    logits, labels = torch.randn(2, 5, 23), torch.randint(0, 23, (2, 5))
    before = logits.clone()
    out = openrlhf.log_probs_from_logits(logits, labels, temperature=0.7)
    expected = torch.log_softmax(before.double() / 0.7, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)
    assert torch.equal(logits, before) and out.dtype == torch.float32
    assert openrlhf.log_probs_from_logits(logits.bfloat16(), labels).dtype == torch.bfloat16


def test_gae_runs_through_holes_as_zero_steps():
    values = torch.tensor([[1.0, 2.0, 3.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])  # the value at the hole counts as 0
    advantages, returns = openrlhf.get_advantages_and_returns(values, rewards, mask, 1.0, 1.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.0, -2.0, -2.0]]) + torch.tensor([[0.0, 3.0, 0.0]]))
    torch.testing.assert_close(returns, advantages + mask * values)


def test_patch_swaps_the_loss_classes_and_unpatch_restores(monkeypatch):
    modules = {
        name: types.ModuleType(name)
        for name in (
            "openrlhf",
            "openrlhf.models",
            "openrlhf.models.loss",
            "openrlhf.models.utils",
            "openrlhf.trainer.ppo_trainer",
            "openrlhf.trainer.ppo_utils.experience_maker",
        )
    }
    theirs = type("PolicyLoss", (), {"__init__": lambda self, **options: None})

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
        assert type(openrlhf.PolicyLoss(policy_loss_type="gspo")) is theirs  # a type fastppo leaves to OpenRLHF
        values, rewards, mask = torch.randn(2, 5), torch.randn(2, 5), torch.ones(2, 5)
        got = RemoteExperienceMaker().get_advantages_and_returns(values, rewards, mask, 0.9, 0.8)
        for a, b in zip(got, openrlhf.get_advantages_and_returns(values, rewards, mask, 0.9, 0.8)):
            torch.testing.assert_close(a, b)
    assert modules["openrlhf.models"].PolicyLoss is modules["openrlhf.trainer.ppo_trainer"].PolicyLoss is theirs
    assert modules["openrlhf.models.utils"].masked_mean is len
    assert RemoteExperienceMaker().get_advantages_and_returns(None, None, None, 0.9, 0.8) == "openrlhf"


def test_patch_names_the_import_that_failed(monkeypatch, tmp_path):
    """OpenRLHF installed but its models failing to import (flash-attn missing): an error naming it."""
    package = tmp_path / "openrlhf"
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models" / "__init__.py").write_text("import flash_attn_missing_for_this_test\n")
    (package / "trainer").mkdir()
    (package / "trainer" / "__init__.py").write_text("from openrlhf.models import *\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(
            ImportError,
            match=r"importing openrlhf\.models\.\w+ failed: No module named "
            r"'flash_attn_missing_for_this_test'; nothing was patched",
        ):
            openrlhf.patch()
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] == "openrlhf"]:
            del sys.modules[name]


@pytest.mark.parametrize("release", ["0.8.0", "0.11.2"])
@pytest.mark.parametrize("token_level", [True, False])
def test_an_all_masked_batch_is_nan_in_the_loss_and_its_gradient_as_openrlhfs(release, token_level):
    """OpenRLHF's masked mean divides ``sum(loss * mask)`` by a count of 0: the gradient reaching
    every term is ``inf * 0``, NaN; fastppo's used to be 0 there (the value alone poisoned)."""
    new, old, _, adv, mask = inputs()
    values = new.detach().clone().requires_grad_()
    with PEER.pinned(release):
        policy = openrlhf.PolicyLoss(token_level_loss=token_level)(new, old, adv, torch.zeros_like(mask))
        value = openrlhf.ValueLoss(token_level_loss=token_level)(values, old, old + adv, torch.zeros_like(mask))
    for out, leaf in ((policy[0] if isinstance(policy, tuple) else policy, new), (value, values)):
        (grad,) = torch.autograd.grad(out, leaf)
        assert torch.isnan(out) and torch.isnan(grad).any()


def test_openrlhf_0_8s_sequence_mean_with_an_empty_row_is_nan_in_that_rows_gradient_alone():
    new, old, _, adv, mask = inputs()
    mask[1] = 0
    values = new.detach().clone().requires_grad_()
    with PEER.pinned("0.8.0"):
        out = openrlhf.ValueLoss(token_level_loss=False)(values, old, old + adv, mask)
    (grad,) = torch.autograd.grad(out, values)
    assert torch.isnan(out) and torch.isnan(grad[1]).all() and torch.isfinite(grad[[0, 2, 3]]).all()
    # the other rows: 1/B of their own mean's gradient, of 0.5 (v - r)^2 over each row's tokens
    expected = (values.detach() - old - adv) * mask / mask.sum(dim=1, keepdim=True) / 4
    torch.testing.assert_close(grad[[0, 2, 3]], expected[[0, 2, 3]])


def test_masked_mean_of_an_empty_group_is_nan_in_its_gradient_alone():
    x = torch.randn(3, 5, requires_grad=True)
    mask = torch.ones(3, 5)
    mask[1] = 0
    out = openrlhf.masked_mean(x, mask, dim=-1)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.isnan(out[1]) and torch.isnan(grad[1]).all()
    torch.testing.assert_close(grad[[0, 2]], torch.full((2, 5), 0.2))
