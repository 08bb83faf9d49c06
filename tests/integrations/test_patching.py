"""The patching and version machinery every drop-in module shares, on a made-up peer package."""

import sys
import types

import pytest

from fastppo.integrations.patching import Patch
from fastppo.integrations.peers import Peer, parse_version


def original_loss():
    return "peer"


def drop_in_loss():
    return "fastppo"


@pytest.fixture
def package(monkeypatch):
    """``peerpkg.core`` defines ``loss`` and a registry; ``peerpkg.actor`` imported it by name."""
    root, core, actor = (types.ModuleType(name) for name in ("peerpkg", "peerpkg.core", "peerpkg.actor"))
    core.loss, core.REGISTRY, core.OTHER = original_loss, {"vanilla": original_loss, "other": len}, 3
    actor.loss = original_loss
    for module in (root, core, actor):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return core, actor


def make_patch():
    return Patch("peerpkg", {("peerpkg.core", "loss"): drop_in_loss, ("peerpkg.absent", "x"): drop_in_loss},
                 missing="needs peerpkg")


def test_patch_swaps_every_name_and_registry_entry_and_unpatch_restores(package, monkeypatch):
    core, actor = package
    user = types.ModuleType("user_code")  # outside the package: never touched
    user.loss = drop_in_loss
    monkeypatch.setitem(sys.modules, "user_code", user)
    patch = make_patch().install(Peer("peerpkg", "1.0", "2.0"))
    assert patch.active and core.loss is actor.loss is core.REGISTRY["vanilla"] is drop_in_loss
    assert core.REGISTRY["other"] is len and core.OTHER == 3
    assert patch.original("peerpkg.core", "loss") is original_loss
    late = types.ModuleType("peerpkg.late")  # imported while patched: it copied the drop-in
    late.loss = core.loss
    monkeypatch.setitem(sys.modules, "peerpkg.late", late)
    with patch:
        pass
    assert not patch.active
    assert core.loss is actor.loss is late.loss is core.REGISTRY["vanilla"] is original_loss
    assert user.loss is drop_in_loss
    assert patch.original("peerpkg.core", "loss") is original_loss


def test_patch_without_the_package_is_an_import_error_with_the_message():
    with pytest.raises(ImportError, match="needs peerpkg"):
        make_patch().install(Peer("peerpkg", "1.0", "2.0"))


def test_versions_parse_and_pin(monkeypatch):
    assert parse_version("0.10.1.post1") == (0, 10, 1) and parse_version("0.8.0.dev") == (0, 8, 0)
    with pytest.raises(ValueError, match="not a version"):
        parse_version("main")
    peer = Peer("fastppo-no-such-distribution", oldest="0.8.0", newest="0.11.0")
    assert peer.installed() is None and peer.version == (0, 11, 0)
    with peer.pinned("0.9.3"):
        assert peer.version == (0, 9, 3) and peer.at_least("0.9") and not peer.at_least("0.10")
    assert peer.version == (0, 11, 0)
    with pytest.raises(ValueError, match=r"0.7.1 is older than fastppo's drop-ins support \(0.8.0 to 0.11.0\)"):
        with peer.pinned("0.7.1"):
            pass
    monkeypatch.setattr(peer, "installed", lambda: (0, 12, 0))
    assert peer.version == (0, 11, 0)  # a newer release is followed as the newest supported
    with pytest.warns(UserWarning, match="0.12.0 is newer than fastppo's drop-ins were tested with"):
        assert peer.check_supported() == (0, 11, 0)


def test_the_readme_states_each_peers_supported_range():
    from pathlib import Path

    import fastppo.integrations.openrlhf as openrlhf
    import fastppo.integrations.trl as trl
    import fastppo.integrations.verl as verl

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2] for line in readme.splitlines()
            if line.startswith("| ") and line.count("|") == 4}
    for name, peer in (("TRL", trl.TRL), ("verl", verl.VERL), ("OpenRLHF", openrlhf.OPENRLHF)):
        for version in (peer.oldest, peer.newest):
            assert ".".join(map(str, version[:2])) in rows[name], (name, version)
    assert "for trl in 1.9.0 1.13.0 1.14.0; do" in (root / ".ci" / "run").read_text()  # the TRLs CI tests
    assert "under 1.9, 1.13 and 1.14" in readme
