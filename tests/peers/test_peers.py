"""The drop-ins against the peers' own released code, for every release fastppo declares.

For each release in ``VERL``, ``OPENRLHF`` and ``TRL`` (``fastppo.integrations``), its wheel is
fetched from the package registry (``environment.py``) and, in a child interpreter:

* every replaced function is compared with the peer's own on random and adversarial inputs,
  values and gradients, each deliberate deviation checked as the transform ``docs/integrations.md``
  documents (``inside/peer_check.py``);
* every call the peer's package makes to a replaced function is bound to the drop-in, and every
  unpacking of its results checked against what the drop-in returns (``inside/peer_call_sites.py``);
* the peer's own CPU tests of these functions run twice, as released and with ``patch()``
  applied, and must pass the same tests.

Marked ``peers``: ``pytest -m peers`` runs it (CI does); the default test command leaves it out.
"""

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fastppo.integrations import openrlhf, trl, verl
from fastppo.integrations.peers import parse_version
from tests.peers import environment

pytestmark = pytest.mark.peers

MODULES = {"verl": verl, "openrlhf": openrlhf, "trl": trl}
PEERS = {"verl": verl.VERL, "openrlhf": openrlhf.OPENRLHF, "trl": trl.TRL}
RELEASES = [(name, str(release)) for name, peer in PEERS.items() for release in peer.releases]
# The modules the replaced functions live in: a test file naming one of them, or a replaced
# function, tests what fastppo replaces.
OWN_TEST_MARKERS = {"verl": ("core_algos", "torch_functional"), "openrlhf": ("models.loss", "models.utils")}
TIMEOUT = 900  # seconds for one child interpreter


def _dependency_paths(peer: str, release: str) -> list:
    names = [peer]
    if peer == "verl" and parse_version(release) < parse_version("0.7.1"):
        names.insert(0, "verl-transformers-4")
    return [environment.dependencies(name) for name in names]


def _fetch(peer: str, release: str):
    """``(root, source)`` of the unpacked release; a skip naming the reason when it cannot be had."""
    try:
        root = environment.release(peer, release)
    except environment.Unreachable as error:
        pytest.skip(f"{peer} {release} could not be fetched from the package registry: {error}")
    return root, environment.source(root)


def _run_check(peer: str, items: list, paths: list, out) -> dict:
    """Run ``inside/peer_check.py`` on ``items`` (``release=source``) in a child interpreter."""
    extra = {"TRITON_INTERPRET": "1"} if peer == "trl" else {}  # TRL 1.15's LM head is a Triton kernel
    env = environment.environment(paths, **extra)
    command = [sys.executable, str(environment.INSIDE / "peer_check.py"), "--peer", peer, "--out", str(out), *items]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if not out.exists():
        raise AssertionError(f"peer_check for {peer} failed:\n{result.stderr[-4000:]}")
    return json.loads(out.read_text())


_REPORTS = {}


def _report(peer: str, release: str, tmp_path_factory) -> dict:
    """The comparison report of ``peer`` ``release``; computed for every release of the peer at once
    (two child interpreters at a time; OpenRLHF's releases share one, its files being loaded by path)."""
    if (peer, release) in _REPORTS:
        return _REPORTS[(peer, release)]
    releases = [str(r) for r in PEERS[peer].releases]
    try:
        roots = {r: environment.release(peer, r) for r in releases}
        paths = {r: [roots[r], *_dependency_paths(peer, r)] for r in releases}
    except environment.Unreachable as error:
        pytest.skip(f"{peer}: the package registry could not provide the releases or their dependencies: {error}")
    items = {r: f"{r}={environment.source(roots[r])}" for r in releases}
    folder = tmp_path_factory.mktemp(f"{peer}-reports")
    if peer == "openrlhf":  # loaded by path: its dependencies alone on the path
        reports = _run_check(peer, list(items.values()), paths[release][1:], folder / "all.json")
        _REPORTS.update({(peer, r): reports[r] for r in releases})
    else:

        def one(r):
            return r, _run_check(peer, [items[r]], paths[r], folder / f"{r}.json")[r]

        with ThreadPoolExecutor(max_workers=2) as pool:
            _REPORTS.update({(peer, r): report for r, report in pool.map(one, releases)})
    return _REPORTS[(peer, release)]


DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
HEADINGS = {"trl": "TRL", "verl": "verl", "openrlhf": "OpenRLHF"}


def documented_deviations(peer: str) -> set:
    """The deviation names ``docs/integrations.md`` lists for ``peer`` (``* `name`: ...`` bullets after
    "Deliberate deviations" in its section)."""
    section = DOCS.read_text().split(f"### {HEADINGS[peer]}, release by release\n", 1)[1].split("\n## ", 1)[0]
    section = section.split("\n### ", 1)[0].split("Deliberate deviations", 1)[1]
    return set(re.findall(r"^\* `([a-z0-9-]+)`", section, flags=re.MULTILINE))


@pytest.mark.parametrize("peer, release", RELEASES, ids=[f"{p}-{r}" for p, r in RELEASES])
def test_drop_ins_equal_the_peers_own_functions(peer, release, tmp_path_factory):
    report = _report(peer, release, tmp_path_factory)
    assert "error" not in report, report.get("error")
    functions = report["functions"]
    expected = {name for (_, name) in MODULES[peer]._PATCH.replacements}
    compared = {name.split(".")[-1] for name in functions}
    assert {name.split(".")[-1].lstrip("_") for name in expected} - {
        n.lstrip("_") for n in compared
    } <= _not_in_release(peer, release), f"not compared: {sorted(expected)} vs {sorted(compared)}"
    mismatches = [f"{name}: {m}" for name, entry in functions.items() for m in entry["mismatches"]]
    assert not mismatches, f"{len(mismatches)} mismatches, e.g.\n" + "\n".join(mismatches[:20])
    for name, entry in functions.items():
        assert entry["cases"] >= 8, f"{name}: only {entry['cases']} cases"
    used = {deviation for entry in functions.values() for deviation in entry["deviations"]}
    assert used <= documented_deviations(peer), used - documented_deviations(peer)


def _not_in_release(peer: str, release: str) -> set:
    """Replaced names a release does not have (nothing to compare)."""
    if peer == "trl" and parse_version(release) < parse_version("1.14.0"):
        return {"selective_log_softmax_and_entropy"}
    return set()


def test_every_documented_deviation_is_exercised(tmp_path_factory):
    for peer in MODULES:
        used = set()
        for release in PEERS[peer].releases:
            report = _report(peer, str(release), tmp_path_factory)
            used |= {d for entry in report.get("functions", {}).values() for d in entry["deviations"]}
        assert documented_deviations(peer) <= used, (peer, documented_deviations(peer) - used)


@pytest.mark.parametrize("peer, release", RELEASES, ids=[f"{p}-{r}" for p, r in RELEASES])
def test_every_call_site_in_the_peer_binds_to_the_drop_in(peer, release, tmp_path_factory):
    sites = _report(peer, release, tmp_path_factory)["call_sites"]
    assert sites["bound"] + sites["partial"] > 0, "no call site found: the scan is broken"
    assert not sites["failures"], "\n".join(sites["failures"])


def _outcomes(junit) -> dict:
    """``{test id: "passed" | "failed" | "skipped"}`` from a JUnit XML report."""
    outcomes = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return outcomes


def _own_tests(source, peer: str) -> list:
    names = {name.split(".")[-1] for (_, name) in MODULES[peer]._PATCH.replacements} | set(OWN_TEST_MARKERS[peer])
    found = []
    for path in sorted((source / "tests").rglob("test_*.py")) if (source / "tests").is_dir() else []:
        text = path.read_text(encoding="utf-8", errors="replace")
        if "on_gpu" not in path.name and any(name in text for name in names):
            found.append(str(path.relative_to(source)))
    return found


def _run_own_tests(peer, release, root, source, files, patched: bool, junit) -> dict:
    plugins = ["-p", "peer_stubs"] + (["-p", "peer_patch"] if patched else [])
    env = environment.environment(
        [root, source, *_dependency_paths(peer, release)], FASTPPO_PEER=peer, FASTPPO_PEER_SOURCE=str(source)
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        *plugins,
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        f"--junitxml={junit}",
        *files,
    ]
    result = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if not junit.exists():
        raise AssertionError(
            f"{peer} {release}'s own tests did not run:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return _outcomes(junit)


@pytest.mark.parametrize(
    "peer, release",
    [(p, r) for p, r in RELEASES if p in OWN_TEST_MARKERS],
    ids=[f"{p}-{r}" for p, r in RELEASES if p in OWN_TEST_MARKERS],
)
def test_the_peers_own_tests_pass_as_well_patched(peer, release, tmp_path):
    root, source = _fetch(peer, release)
    files = _own_tests(source, peer)
    if not files:
        pytest.skip(f"{peer} {release} ships no CPU tests of the functions fastppo replaces")
    try:
        plain = _run_own_tests(peer, release, root, source, files, False, tmp_path / "plain.xml")
        patched = _run_own_tests(peer, release, root, source, files, True, tmp_path / "patched.xml")
    except environment.Unreachable as error:
        pytest.skip(f"{peer} {release}: the package registry could not provide its dependencies: {error}")
    passed = {test for test, outcome in plain.items() if outcome == "passed"}
    assert passed, f"none of {peer} {release}'s own tests passed unpatched: {plain}"
    lost = sorted(test for test in passed if patched.get(test) != "passed")
    assert not lost, f"{len(lost)} of {len(passed)} pass only unpatched: {lost[:10]}"
    print(
        f"{peer} {release}: {len(passed)} of {len(plain)} own tests pass unpatched, "
        f"{sum(o == 'passed' for o in patched.values())} patched ({', '.join(files)})"
    )
