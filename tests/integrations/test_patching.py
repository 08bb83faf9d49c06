"""The patching and version machinery every drop-in module shares, on a made-up peer package."""

import inspect
import re
import sys
import types
import warnings

import pytest

from fastppo.integrations.patching import Patch
from fastppo.integrations.peers import Peer, parameters, parse_version


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
    return Patch(
        "peerpkg",
        {("peerpkg.core", "loss"): drop_in_loss, ("peerpkg.absent", "x"): drop_in_loss},
        caller="peerpkg_patch()",
        install_hint="pip install peerpkg",
    )


PEER = Peer("peerpkg", {"1.0": (), "2.0": ()})


def test_patch_swaps_every_name_and_registry_entry_and_unpatch_restores(package, monkeypatch):
    core, actor = package
    user = types.ModuleType("user_code")  # outside the package: never touched
    user.loss = drop_in_loss
    monkeypatch.setitem(sys.modules, "user_code", user)
    patch = make_patch().install(PEER)
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


def test_patch_without_the_package_says_how_to_install_it():
    with pytest.raises(ImportError, match=r"peerpkg_patch\(\) needs peerpkg: pip install peerpkg"):
        make_patch().install(PEER)


def _write_package(root, files: dict):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def on_disk(tmp_path, monkeypatch):
    """A real ``peerpkg`` on the path, its files given by the test; removed from sys.modules after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield lambda files: _write_package(tmp_path, files)
    for name in [name for name in sys.modules if name.split(".")[0] == "peerpkg"]:
        del sys.modules[name]


def test_a_package_that_fails_to_import_is_named_with_its_error(on_disk):
    on_disk({"peerpkg/__init__.py": "import a_dependency_that_is_not_installed\n"})
    with pytest.raises(
        ImportError,
        match="peerpkg is installed but importing it failed: No module named "
        "'a_dependency_that_is_not_installed'; nothing was patched",
    ):
        make_patch().install(PEER)


def test_a_module_that_fails_to_import_is_a_warning_naming_it(on_disk):
    on_disk(
        {
            "peerpkg/__init__.py": "",
            "peerpkg/core.py": "def loss():\n    return 'peer'\n",
            "peerpkg/heavy.py": "import flash_attn_not_here\n",
        }
    )
    patch = Patch(
        "peerpkg",
        {
            ("peerpkg.core", "loss"): drop_in_loss,
            ("peerpkg.heavy", "x"): drop_in_loss,
            ("peerpkg.absent", "y"): drop_in_loss,
        },
        caller="peerpkg_patch()",
        install_hint="",
    )
    with pytest.warns(
        UserWarning,
        match=r"importing peerpkg.heavy failed: No module named 'flash_attn_not_here'; "
        r"its x stay peerpkg's",
    ) as caught:
        patch.install(PEER)
    try:
        assert sys.modules["peerpkg.core"].loss is drop_in_loss
        assert not any("absent" in str(w.message) for w in caught)  # a module this release lacks: no word
    finally:
        patch.remove()


def test_releases_are_declared_once_with_their_changes(monkeypatch):
    with pytest.raises(ValueError, match="oldest first"):
        Peer("p", {"2.0": (), "1.0": ()})
    with pytest.raises(ValueError, match="declared twice"):
        Peer("p", {"1.0": ("a",), "2.0": ("a",)})
    peer = Peer("fastppo-no-such-distribution", {"0.8.0": (), "0.8.0.post1": (), "0.9.3": ("band",), "0.11.0": ()})
    assert peer.installed() is None and peer.release == parse_version("0.11.0") and peer.has("band")
    with pytest.raises(KeyError, match="no change named 'bnad'"):
        peer.has("bnad")
    with peer.pinned("0.8.0.post1"):
        assert str(peer.release) == "0.8.0.post1" and not peer.has("band")
    with pytest.raises(ValueError, match="not a version"):
        parse_version("main")
    with pytest.raises(ValueError, match=r"0.7.1 is older than fastppo's drop-ins support \(0.8.0 to 0.11.0\)"):
        with peer.pinned("0.7.1"):
            pass
    for installed, followed, says in (
        ("0.12.0", "0.11.0", "newer than"),
        ("0.10.0", "0.9.3", "not one of"),
        ("0.9.3rc1", "0.8.0.post1", "not one of"),
    ):
        monkeypatch.setattr(peer, "installed", lambda installed=installed: parse_version(installed))
        with pytest.warns(UserWarning, match=f"{installed} is {says} the releases .* they follow {followed}"):
            assert str(peer.check_supported()) == followed
    for installed, followed, says in (
        ("0.9.3.dev4", "0.8.0.post1", "not one of"),  # before the release it leads to
        ("0.9.3.dev4+g1a2b", "0.8.0.post1", "not one of"),
        ("0.10.0+cu130", "0.9.3", "not one of"),  # a local build of a release not declared
    ):
        monkeypatch.setattr(peer, "installed", lambda installed=installed: parse_version(installed))
        with pytest.warns(
            UserWarning, match=rf"{re.escape(installed)} is {says} the releases .* they follow {followed}"
        ):
            assert str(peer.check_supported()) == followed
    monkeypatch.setattr(peer, "installed", lambda: parse_version("0.9.3+cu130"))  # a local build of a release
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # is that release: no warning
        assert str(peer.check_supported()) == str(peer.release) == "0.9.3"


def test_nested_patch_blocks_restore_when_the_outermost_exits(package):
    core, _ = package
    patch = make_patch()
    with patch.install(PEER):
        with patch.install(PEER):
            assert core.loss is drop_in_loss
        assert patch.active and core.loss is drop_in_loss  # the outer block still holds it
    assert not patch.active and core.loss is original_loss
    patch.install(PEER)
    patch.install(PEER)
    patch.remove()  # unpatch(): at once, whoever holds it
    assert not patch.active and core.loss is original_loss


def test_a_drop_in_takes_each_releases_parameters():
    peer = Peer("fastppo-no-such-distribution", {"1.0": (), "2.0": ()})

    @peer.follows({"1.0": parameters("x", "y", mode="a"), "2.0": parameters("x", "y", old=None, mode="a")})
    def f(x, y, mode, old=None):
        return x, y, mode, old

    assert f(1, 2, 3, "b") == (1, 2, "b", 3)  # 2.0: old is third
    assert list(inspect.signature(f).parameters) == ["x", "y", "old", "mode"]
    with peer.pinned("1.0"):
        assert f(1, 2, "b") == (1, 2, "b", None)  # 1.0: mode is third
        assert list(inspect.signature(f).parameters) == ["x", "y", "mode"]
        with pytest.raises(TypeError, match="unexpected keyword argument 'old'"):
            f(1, 2, old=3)


def test_ci_runs_the_differential_suite():
    from scripts import generate_docs as generated

    ci = (generated.ROOT / ".ci" / "run").read_text()
    assert "pytest -q -p no:cacheprovider -m peers" in ci  # CI runs the differential suite
