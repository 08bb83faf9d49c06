"""The differential suite's own machinery, offline: it must be able to fail.

Runs in the default test command (no download): the comparison flags a wrong value, a wrong
gradient, a missing error and a different result shape; the call-site scan flags a call the
drop-in cannot take and an unpacking it does not fit; a registry that cannot be reached is an
``Unreachable``, which the suite turns into a skip that says so.
"""

import importlib.util
import inspect
import sys

import pytest
import torch

from tests.peers import environment


def _inside(name):
    spec = importlib.util.spec_from_file_location(name, environment.INSIDE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


compare_module = _inside("peer_compare")
call_sites = _inside("peer_call_sites")
Case, compare = compare_module.Case, compare_module.compare


def case(**options):
    def build(g):
        x = torch.randn(3, 4, generator=g).requires_grad_()
        return (x,), {}, [x]

    return Case("x", build, seed=1, **options)


def test_agreeing_functions_pass():
    assert compare(lambda x: (x * 2).sum(), lambda x: (x + x).sum(), case()) is None


def test_a_wrong_value_a_wrong_gradient_a_missing_error_and_a_wrong_shape_are_caught():
    assert "values differ" in compare(lambda x: x.sum(), lambda x: x.sum() + 1e-3, case())
    # same values at this point, different gradients
    assert "gradient" in compare(lambda x: (x * x).sum(), lambda x: (x * x.detach()).sum(), case())
    assert "the peer raised" in compare(lambda x: 1 / 0, lambda x: x.sum(), case())
    assert "returned 2 values" in compare(lambda x: (x, x), lambda x: (x, x, x), case())
    assert "dtype" in compare(lambda x: x.sum(), lambda x: x.sum().double(), case())
    assert compare(lambda x: 1 / 0, lambda x: float("x"), case()) is None  # both refuse


def test_a_deviation_is_its_transform_and_nothing_else():
    peer, ours = (lambda x: x.clamp(max=0.5).sum()), (lambda x: x.sum())
    assert compare(peer, ours, case()) is not None

    def shifted(args, kwargs):
        return (args[0] - 10.0,), kwargs  # below the clamp, where it is the identity

    explained = case(deviation="uncapped", peer_inputs=shifted, peer_result=lambda result: result + 120.0)
    assert compare(peer, ours, explained) is None
    unexplained = case(deviation="uncapped", peer_inputs=shifted, peer_result=lambda result: result + 119.0)
    assert "values differ" in compare(peer, ours, unexplained)


def test_the_call_site_scan_binds_calls_and_unpackings(tmp_path):
    package = tmp_path / "peerpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "core.py").write_text("def loss(a, b, mode='x'):\n    return a, b\n")
    (package / "actor.py").write_text(
        "from peerpkg.core import loss\n"
        "from other import loss as not_the_one\n"
        "def step(config):\n"
        "    options = {'mode': 'y'}\n"
        "    pg, metrics = loss(1, 2, **options)\n"
        "    first, second = loss(1, b=2, **config.batch_info)\n"
        "    not_the_one(1, 2, 3, 4)\n"
        "def configure(config):\n"
        "    config.batch_info['mode'] = 'z'\n"
    )

    def ours(a, b, mode="x"):
        return a, b, mode

    def target(returns):
        return call_sites.Target(
            "peerpkg.core", "loss", inspect.signature(lambda a, b, mode="x": None), inspect.signature(ours), 2, returns
        )

    fine = call_sites.scan(tmp_path, "peerpkg", [target(2)])
    assert fine["bound"] == 2 and fine["partial"] == 0 and not fine["failures"]
    wrong = call_sites.scan(tmp_path, "peerpkg", [target(3)])
    assert len(wrong["failures"]) == 2 and "unpacks 2 values, gets 3" in wrong["failures"][0]
    narrower = call_sites.Target(
        "peerpkg.core",
        "loss",
        inspect.signature(lambda a, b, mode="x": None),
        inspect.signature(lambda a, b: None),
        2,
        2,
    )
    assert all("mode" in f for f in call_sites.scan(tmp_path, "peerpkg", [narrower])["failures"])


def test_an_unreachable_registry_is_said_so(tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "CACHE", tmp_path)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(environment.Unreachable, match="verl==0.9.1"):
        environment.release("verl", "0.9.1")
    assert not list((tmp_path / "releases").iterdir())  # nothing half-written is left behind
