"""The import order the package declares (``[tool.importlinter]`` in ``pyproject.toml``) holds: the
contracts pass, ``import fastppo.agents`` loads no trainer module, and ``kernels/`` (outside the
tree the contracts walk) imports nothing of fastppo's."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "0 broken" in result.stdout


def test_the_agents_load_no_trainer_module():
    script = "import sys, fastppo.agents; print(sorted(m for m in sys.modules if m.startswith('fastppo.trainer')))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_the_kernels_import_nothing_of_fastppo():
    for path in (ROOT / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1 and not (node.module or "").startswith("fastppo"), f"{path.name}:{node.lineno}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("fastppo") for a in node.names), f"{path.name}:{node.lineno}"
