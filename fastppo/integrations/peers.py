"""Which version of a peer trainer the drop-ins follow, read without importing the peer.

A peer's signatures and semantics change between releases (what a loss returns, how an empty
row counts), so each drop-in module follows one version: the installed one, read from the
package metadata (importing verl or OpenRLHF would pull in Ray, vLLM and more), or, when the
peer is not installed, the newest version fastppo supports. ``pinned`` makes a module follow
another version, for comparing against a peer that lives elsewhere and for the tests.
"""

import re
import warnings
from contextlib import contextmanager
from functools import lru_cache
from importlib import metadata
from typing import Optional


def parse_version(text: str) -> tuple:
    """``"0.10.1.post1"`` -> ``(0, 10, 1)``: the leading release numbers (dev and post tags dropped)."""
    release = re.match(r"\d+(\.\d+)*", text.strip())
    if release is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in release.group(0).split("."))


@lru_cache(maxsize=None)
def _installed(distribution: str) -> Optional[tuple]:
    try:
        return parse_version(metadata.version(distribution))
    except metadata.PackageNotFoundError:
        return None


def _text(version: tuple) -> str:
    return ".".join(map(str, version))


class Peer:
    """A peer trainer: its distribution name, the oldest and newest version the drop-ins follow."""

    def __init__(self, distribution: str, oldest: str, newest: str):
        self.distribution = distribution
        self.oldest, self.newest = parse_version(oldest), parse_version(newest)
        self._pinned: Optional[tuple] = None

    def installed(self) -> Optional[tuple]:
        return _installed(self.distribution)

    @property
    def version(self) -> tuple:
        """The version followed: pinned, else installed (newer ones as the newest supported), else
        the newest supported."""
        return min(self._declared(), self.newest)

    def _declared(self) -> tuple:
        return self._pinned or self.installed() or self.newest

    def at_least(self, version: str) -> bool:
        return self.version >= parse_version(version)

    def check_supported(self) -> tuple:
        """The version followed: older than supported is a ValueError naming the range; newer is a
        warning (the newest supported semantics are followed)."""
        version = self._declared()
        if version < self.oldest:
            raise ValueError(f"{self.distribution} {_text(version)} is older than fastppo's drop-ins support "
                             f"({self.range()})")
        if version > self.newest:
            warnings.warn(f"{self.distribution} {_text(version)} is newer than fastppo's drop-ins were tested "
                          f"with ({self.range()}); they follow {_text(self.newest)}", stacklevel=3)
        return self.version

    def range(self) -> str:
        return f"{_text(self.oldest)} to {_text(self.newest)}"

    @contextmanager
    def pinned(self, version: str):
        """Follow ``version`` inside the block, whatever is installed."""
        previous, self._pinned = self._pinned, parse_version(version)
        try:
            self.check_supported()
            yield self
        finally:
            self._pinned = previous
