"""The supported-versions table, generated from the releases the drop-ins declare.

Every release a drop-in module declares (``TRL``, ``VERL``, ``OPENRLHF``) is what the differential
suite (``tests/peers``, ``pytest -m peers``) fetches and runs against, so this table, written from
those declarations, states exactly what is tested. ``python scripts/generate_docs.py`` rewrites it in
the pages that show it.
"""

from itertools import groupby


def _series(peer) -> str:
    """``0.8.0-0.8.11, 0.9.0-0.9.10``: each minor series' first and last release."""
    parts = []
    for _, releases in groupby(peer.releases, key=lambda v: v.release[:2]):
        releases = list(releases)
        parts.append(str(releases[0]) if len(releases) == 1 else f"{releases[0]}-{releases[-1]}")
    return ", ".join(parts)


def table() -> str:
    from . import openrlhf, trl, verl

    rows = []
    for name, module, peer in (
        ("TRL", trl, trl.TRL),
        ("verl", verl, verl.VERL),
        ("OpenRLHF", openrlhf, openrlhf.OPENRLHF),
    ):
        replaced = sorted({entry.split(".")[-1].lstrip("_") for _, entry in module._PATCH.replacements})
        posts = sum(1 for release in peer.releases if release.is_postrelease)
        count = f"{len(peer.releases)} releases" + (f", {posts} of them post releases" if posts else "")
        rows.append(f"| {name} | {_series(peer)} ({count}) | {', '.join(f'`{n}`' for n in replaced)} |")
    return "\n".join(
        ["| peer | releases followed, each with its own semantics | replaced |", "| --- | --- | --- |", *rows]
    )
