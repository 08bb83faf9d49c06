"""The README's commands, CI and the command line stay what they claim to be."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from fastppo.demo import run_demo

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    install_and_run, install_and_test = blocks[:2]
    assert "fastppo train" in install_and_run
    assert "pytest" in install_and_test
    ci_commands = [
        line
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci_commands[0] == install_and_test  # first, verbatim; then ruff, the slow runs, the peers, older TRLs
    assert ci_commands[1] == ".venv/bin/ruff format --check . && .venv/bin/ruff check . && .venv/bin/lint-imports"
    # the wheel, built, installed into a fresh environment and trained from outside the repository
    assert "pip wheel" in ci_commands[2] and "-m venv .wheel/venv" in ci_commands[2]
    assert ci_commands[3].startswith(".wheel/venv/bin/pip install") and ".wheel/fastppo-" in ci_commands[3]
    assert "mktemp -d" in ci_commands[4] and '.wheel/venv/bin/fastppo" train --iterations 2' in ci_commands[4]
    assert ci_commands[5] == ".venv/bin/python -m pytest -q -p no:cacheprovider -m slow"
    assert ci_commands[6] == ".venv/bin/python -m pytest -q -p no:cacheprovider -m peers"
    assert all("trl" in line or line == "done" for line in ci_commands[7:-2])
    # Last, the kernel and op tests under the oldest triton pyproject.toml allows.
    oldest = re.search(r'"triton>=([\d.]+)', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f'"triton=={oldest}.0"' in ci_commands[-2] and "--target .triton36" in ci_commands[-2]
    assert ci_commands[-1].startswith("PYTHONPATH=.triton36 ") and "tests/kernels tests/ops" in ci_commands[-1]


def test_the_documentation_s_tables_are_generated_from_the_code():
    """The peers table (from the drop-ins' declared releases), the estimators table (from the registry)."""
    from scripts import generate_docs as generated

    for page, name, source in generated.TABLES:
        assert generated.current(ROOT / page, name) == generated.between(name, source()), (
            f"{page} is stale: run python scripts/generate_docs.py"
        )


def test_every_documented_script_command_runs():
    """Each ``python scripts/...`` command the documentation gives runs from another directory as written
    (the generator, with every table up to date, rewrites nothing)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    commands = {m for page in pages for m in re.findall(r"`python (scripts/[^`]+)`", page.read_text())}
    assert commands == {"scripts/generate_docs.py"}, "a new documented command needs its check here"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/generate_docs.py")], cwd=ROOT / "docs", capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "every table is up to date"


def test_kernels_import_as_a_subpackage():
    import fastppo.kernels

    assert callable(fastppo.kernels.token_logprobs.logprobs_forward) and callable(fastppo.kernels.gae.gae)
    assert fastppo.__version__


def test_the_cpu_path_needs_no_triton():
    # As on a machine without triton: the twins, and the contract they share with the kernels, import
    # and run; the kernel families are not imported with the package.
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, fastppo, fastppo.kernels.contract\n"
        "m = torch.ones(2, 5, dtype=torch.bool)\n"
        "loss, _ = fastppo.ppo_policy_loss(-torch.rand(2, 5), -torch.rand(2, 5), torch.randn(2, 5), m)\n"
        "logp = fastppo.token_logprobs(torch.randn(2, 5, 7), torch.zeros(2, 5, dtype=torch.long))\n"
        "assert torch.isfinite(loss) and logp.shape == (2, 5)\n"
        "assert 'fastppo.kernels.ppo_policy_loss' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_demo_matches_float64_pytorch():
    r = run_demo(batch=2, seq_len=16, vocab_size=1000)
    for name in ("token_logprobs", "token_logprobs_from_hidden"):
        assert r[name]["logp_err"] < 2e-5 and r[name]["entropy_err"] < 2e-5
        assert r[name]["grad_rel_err"] < 1e-5
    assert r["tokens"] == 30


def test_cli_usage_and_unknown_command():
    result = subprocess.run([sys.executable, "-m", "fastppo", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "demo" in result.stdout
    result = subprocess.run([sys.executable, "-m", "fastppo", "fly"], capture_output=True, text=True)
    assert result.returncode == 2


def test_the_repository_kernels_folder_does_not_hide_the_kernels_distribution():
    # kernels/ installs as fastppo.kernels; with the repository root first on sys.path (pytest,
    # `python -m` from the root) a top-level `import kernels`, which transformers 5.25 on makes,
    # gets the installed `kernels` distribution; without one it gets this folder, as before.
    import importlib.metadata
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    probe = (
        f"import sys; sys.path.insert(0, {str(root)!r}); import fastppo.kernels.contract as ours\n"
        "import kernels\nprint('found', kernels.__file__)\n"
        "print('ours', ours.__file__)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=root)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert Path(lines["ours"]).resolve() == root / "kernels" / "contract.py"
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert Path(lines["found"]).resolve().parent == root / "kernels", result.stdout
    else:
        assert Path(lines["found"]).resolve().parent != root / "kernels", result.stdout


def test_the_wheel_holds_every_package_and_its_data(tmp_path):
    """Built from a copy of the tree (no stale build/ to hide a missing package): every folder of
    fastppo/ with an __init__.py, kernels/ as fastppo.kernels, the default model and the templates."""
    source = tmp_path / "source"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "dist", "runs", "*.egg-info", "__pycache__")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("fastppo-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    packages = [p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "fastppo").rglob("__init__.py")]
    expected = {f"{p}/__init__.py" for p in packages} | {"fastppo/kernels/__init__.py"}
    expected |= {f.relative_to(ROOT).as_posix() for f in (ROOT / "fastppo/trainer/modeling/default_model").iterdir()}
    expected |= {f.relative_to(ROOT).as_posix() for f in (ROOT / "fastppo").rglob("*.jinja")}
    expected |= {"fastppo/kernels/" + f.name for f in (ROOT / "kernels").glob("*.py")}
    assert "fastppo/agents/__init__.py" in expected and expected <= shipped, sorted(expected - shipped)
