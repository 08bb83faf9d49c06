"""Compare one peer's releases with fastppo's drop-ins; write a JSON report.

    python peer_check.py --peer verl --out report.json 0.9.1=/cache/verl-0.9.1

Runs in an interpreter set up by ``tests/peers/environment.py``: each release's unpacked wheel
on the path (one release per process for verl and TRL, whose functions are imported as packages;
OpenRLHF's files are loaded by path, so one process takes every release), its light dependencies
installed, its heavy ones stubbed. For each release, with the drop-ins following it:

* every replaced function against the peer's own, case by case (``peer_compare``), with the
  mismatches, the deviations exercised and how many values each side returns;
* every call site in the peer's package bound to the drop-in (``peer_call_sites``).
"""

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

import peer_stubs  # noqa: F401 - installs the stand-ins before any peer module is imported
from peer_call_sites import scan
from peer_compare import compare

CASES = {"verl": "peer_cases_verl", "openrlhf": "peer_cases_openrlhf", "trl": "peer_cases_trl"}


def _arity(result):
    return len(result) if isinstance(result, tuple) else None


def check_release(cases, release: str, root: Path) -> dict:
    report = {"functions": {}, "call_sites": None}
    arities = {}
    for name, peer_fn, our_fn, function_cases in cases.functions(release, root):
        entry = {"cases": 0, "deviations": {}, "mismatches": []}
        for case in function_cases:
            entry["cases"] += 1
            if case.deviation:
                entry["deviations"][case.deviation] = entry["deviations"].get(case.deviation, 0) + 1
            try:
                message = compare(peer_fn, our_fn, case)
            except Exception as error:  # noqa: BLE001 - a harness failure is reported, not raised
                message = f"the comparison itself failed: {type(error).__name__}: {error}"
            if message:
                entry["mismatches"].append(f"{case.label}: {message}")
            if arities.get(name) is None:
                arities[name] = _arities(peer_fn, our_fn, case)
        report["functions"][name] = entry
    package, targets = cases.targets(release, root, arities)
    report["call_sites"] = scan(root, package, targets)
    return report


def _arities(peer_fn, our_fn, case):
    """How many values each side returns on this case's inputs (None: not a tuple)."""
    try:
        args, kwargs = case.inputs()[:2]
        peer = peer_fn(*args, **kwargs)
        args, kwargs = case.inputs()[:2]
        return _arity(peer), _arity(our_fn(*args, **kwargs))
    except Exception:  # noqa: BLE001 - an input both sides refuse says nothing about arity
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer", choices=sorted(CASES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("releases", nargs="+", help="release=root of its unpacked wheel")
    args = parser.parse_args()
    cases = importlib.import_module(CASES[args.peer])
    reports = {}
    for item in args.releases:
        release, _, root = item.partition("=")
        started = time.perf_counter()
        try:
            with cases.PEER.pinned(release):
                reports[release] = check_release(cases, release, Path(root))
        except Exception:  # noqa: BLE001 - one release's failure must not hide the others'
            reports[release] = {"error": traceback.format_exc()}
        reports[release]["seconds"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(reports, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
