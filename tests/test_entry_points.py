"""The README's commands, CI and the command line stay what they claim to be."""

import re
import subprocess
import sys
from pathlib import Path

import fastppo
from fastppo.demo import run_demo

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    install_and_run, install_and_test = blocks[:2]
    assert "fastppo train" in install_and_run
    assert "pytest" in install_and_test
    ci_commands = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci_commands[0] == install_and_test  # first, verbatim; then the older TRLs (tests/integrations/test_trl.py)
    assert all("trl" in line or line == "done" for line in ci_commands[1:])


def test_kernels_import_as_a_subpackage():
    import fastppo.kernels

    assert callable(fastppo.kernels.logprobs.logprobs_forward) and callable(fastppo.kernels.gae.gae)
    assert fastppo.__version__


def test_demo_matches_float64_pytorch():
    r = run_demo(batch=2, seq_len=16, vocab_size=1000)
    for name in ("token_logprobs", "linear_token_logprobs"):
        assert r[name]["logp_err"] < 2e-5 and r[name]["entropy_err"] < 2e-5
        assert r[name]["grad_rel_err"] < 1e-5
    assert r["tokens"] == 30


def test_cli_usage_and_unknown_command():
    result = subprocess.run([sys.executable, "-m", "fastppo", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "demo" in result.stdout
    result = subprocess.run([sys.executable, "-m", "fastppo", "fly"], capture_output=True, text=True)
    assert result.returncode == 2
