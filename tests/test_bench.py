"""The bench suite never rots: every family runs at --quick size on the CPU, timed once.

(On a GPU machine the full bench runs right after the tests in bench/gpu_check.sh.)"""

import json
import math

import pytest
import torch

from fastppo.bench.cli import main as bench_main
from fastppo.bench.runner import FAMILIES, run_suite


CPU = torch.device("cpu")


@pytest.mark.parametrize("op", list(FAMILIES))
def test_every_contender_gets_a_row(op):
    device = CPU
    meta, rows = run_suite([op], device, quick=True, smoke=True)
    cases = FAMILIES[op](device, quick=True)
    passes = 2 if cases[0].bytes_fwd_bwd else 1
    assert len(rows) == sum(len(c.contenders) for c in cases) * passes
    statuses = {r["contender"]: r["status"] for r in rows}
    baseline = next((c.name for c in cases[0].contenders if c.baseline), None)
    assert all(status == "ok" for name, status in statuses.items() if not name.startswith(("torch.compile", "HF generate (static", "liger", "flash-attn", "trl")))
    assert baseline is None or statuses[baseline] == "ok"
    for row in rows:
        assert row["bytes"] > 0
        assert row["status"] == "ok" or row["median_ms"] is None  # unavailable rows say why, with no numbers
        assert not row["status"].startswith("error"), row
        if row["status"] == "ok":
            assert math.isfinite(row["gbps"]) and row["gbps"] > 0
            assert baseline is None or (math.isfinite(row["speedup"]) and row["speedup"] > 0)
            assert row["memory_bytes"] > 0
    assert meta["copy_gbps"] > 0 and meta["device"] == device.type


def test_cli_writes_json_and_markdown(tmp_path, capsys):
    assert bench_main(["--op", "gae", "--device", "cpu", "--quick", "--json", str(tmp_path / "r.json"),
                       "--markdown", str(tmp_path / "r.md")]) == 0
    printed = capsys.readouterr().out
    assert "## gae" in printed and "| fastppo | fwd |" in printed
    assert (tmp_path / "r.md").read_text() == printed
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"]["device"] == "cpu" and {r["op"] for r in data["rows"]} == {"gae"}


def test_time_budget_skips_the_rest():
    _, rows = run_suite(["whiten"], CPU, quick=True, smoke=True, time_budget_s=-1.0)
    assert {r["status"] for r in rows if r["contender"] == "fastppo"} == {"skipped: time budget"}
