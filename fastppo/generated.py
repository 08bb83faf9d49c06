"""The documentation's tables that are written from the code: the estimators (from their
registry) and the peer releases the drop-ins follow (from their declarations). Each sits between
two HTML comment markers in its page; ``python -m fastppo.generated`` rewrites every one, and a
test fails while a page's copy is stale, so the documentation cannot drift from the code."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _estimators() -> str:
    from .trainer.estimators import markdown_table

    return markdown_table()


def _peers() -> str:
    from .integrations.table import table

    return table()


# (page, marker name, the table's source)
TABLES = [
    ("docs/training.md", "estimators-table", _estimators),
    ("docs/integrations.md", "peers-table", _peers),
    ("README.md", "peers-table", _peers),
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
