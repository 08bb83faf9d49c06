"""Every repository path a docstring, a comment or a page names exists: a file that moved leaves no
stale name behind. A path is a name in backquotes ending in .py, .md, .sh or .toml; one with a
directory is looked for from the repository's root, from ``fastppo/`` and from each folder above the
file naming it, and one without from anywhere in the repository. A path under another project's
folders (a peer's ``models/loss.py``) is not this repository's and is left alone, as is
CHANGELOG.md, whose entries name the files of their day."""

import ast
import re
from pathlib import Path, PurePath

ROOT = Path(__file__).resolve().parents[1]
TREES = ("fastppo", "kernels", "tests", "bench", "docs", "scripts", "recipes")
NAMED = re.compile(r"``([\w./-]+\.(?:py|md|sh|toml))``|`([\w./-]+\.(?:py|md|sh|toml))`")


def _files() -> list:
    found = [p for p in ROOT.iterdir() if p.is_file()]  # README.md, pyproject.toml, ...
    for tree in TREES:
        found += [p for p in (ROOT / tree).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return found


def _prose(path: Path) -> str:
    """A page whole; of a Python file its docstrings and comments."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = [ast.get_docstring(n) or "" for n in ast.walk(ast.parse(text)) if isinstance(n, nodes)]
    comments = [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]
    return "\n".join(docstrings + comments)


def test_every_path_named_exists():
    files = _files()
    names = {f.name for f in files}
    folders = {part for f in files for part in f.relative_to(ROOT).parts[:-1]}
    stale = []
    for path in files:
        if path.suffix not in (".py", ".md") or path.name == "CHANGELOG.md" or "peers" in path.relative_to(ROOT).parts:
            continue
        for match in NAMED.finditer(_prose(path)):
            named = match.group(1) or match.group(2)
            parts = PurePath(named).parts
            if len(parts) == 1:
                found = named in names
            elif parts[0] not in folders:
                continue  # another project's path
            else:
                found = any((base / named).exists() for base in (ROOT, ROOT / "fastppo", *path.parents))
            if not found:
                stale.append(f"{path.relative_to(ROOT)}: {named}")
    assert not stale, stale
