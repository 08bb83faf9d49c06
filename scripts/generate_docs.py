"""The documentation's parts that are written from the code: the estimators (from their registry),
the peer releases the drop-ins follow (from their declarations) and the README's map of the
package (each package's and module's summary line, from its docstring). Each sits between
two HTML comment markers in its page; ``python scripts/generate_docs.py`` (from anywhere) rewrites
every one, and a test fails while a page's copy is stale, so the documentation cannot drift from the
code. A tool of the repository's, not of the installed package."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _estimators() -> str:
    from fastppo.trainer.update.estimators import markdown_table

    return markdown_table()


def _peers() -> str:
    from fastppo.integrations.table import table

    return table()


# The map: what it shows, in reading order; each entry's line is its docstring's first line.
PACKAGE = ["ops", "rollout", "agents", "rewards", "trainer", "integrations", "bench"]
LEAVES = ["errors.py", "hf.py", "limits.py", "machine.py", "user_code.py", "windows.py", "cli.py", "demo.py"]
TRAINER = [
    "ppo.py",
    "build.py",
    "cli.py",
    "moved.py",
    "configuration",
    "prompts",
    "modeling",
    "parallel",
    "update",
    "experience",
    "memory",
    "run",
]
# the folders outside the package, which hold no docstring
OUTSIDE = {
    "bench/": "pytest-benchmark files, gpu_check.sh, results/",
    "recipes/": "runs as config files (gsm8k.toml, tools_multiply.toml), each run by a test",
    "scripts/": "the repository's tools: these generated parts, the default model",
    "tests/": "mirrors the package; float64 oracles; every kernel in the Triton interpreter and for sm_90",
    "docs/": "the manual",
}


def summary_line(path: Path) -> str:
    """The first line of a module's docstring (a package's ``__init__``), its markup removed."""
    module = path / "__init__.py" if path.is_dir() else path
    return ast.get_docstring(ast.parse(module.read_text())).splitlines()[0].replace("``", "")


def _tree() -> str:
    def entry(depth: int, path: Path) -> str:
        name = path.name + ("/" if path.is_dir() else "")
        return f"{'  ' * depth}{name:<{25 - 2 * depth}}{summary_line(path)}".rstrip()

    package, trainer = ROOT / "fastppo", ROOT / "fastppo" / "trainer"
    lines = [entry(0, ROOT / "kernels"), entry(0, package)]
    for name in PACKAGE:
        lines.append(entry(1, package / name))
        if name == "trainer":
            lines += [entry(2, trainer / part) for part in TRAINER]
    lines += [entry(1, package / name) for name in LEAVES]
    lines += [f"{name:<25}{what}" for name, what in OUTSIDE.items()]
    return "```\n" + "\n".join(lines) + "\n```"


# (page, marker name, the part's source)
TABLES = [
    ("docs/training.md", "estimators-table", _estimators),
    ("docs/integrations.md", "peers-table", _peers),
    ("README.md", "peers-table", _peers),
    ("README.md", "package-map", _tree),
]


def between(name: str, body: str) -> str:
    return f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->"


def current(page: Path, name: str) -> str:
    """What ``page`` holds between the markers ``name``, markers included."""
    text = page.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    return text[text.index(begin) : text.index(end) + len(end)]


def rewrite(root: Path = ROOT) -> list:
    """Every table written afresh; the pages that changed."""
    changed = []
    for page, name, source in TABLES:
        path = root / page
        old, new = current(path, name), between(name, source())
        if old != new:
            path.write_text(path.read_text().replace(old, new))
            changed.append(page)
    return changed


if __name__ == "__main__":
    print("\n".join(f"{page}: rewritten" for page in rewrite()) or "every table is up to date")
