"""Which release of a peer trainer the drop-ins follow, and what changed in each, declared once.

A peer's signatures and semantics change between releases (what a loss returns, how an empty row
counts, which argument comes third), so each drop-in module declares every release it follows,
oldest first, with the changes that release brought, by name. Code asks ``PEER.has("change")``
where releases differ, and functions whose parameters changed declare each release's signature
(:meth:`Peer.follows`), so a call binds its arguments exactly as the followed release would.

The release followed is the installed one, read from the package metadata (importing verl or
OpenRLHF would pull in Ray, vLLM and more), or the newest declared when the peer is not installed.
A local build of a declared release (``0.9.1+cu130``) is that release. Any other installed
version that is not declared (newer than the newest, a pre-release or ``.devN`` build, which
comes before the release it leads to) follows the newest declared release before it, and
``patch()`` warns naming both; one older than the oldest is refused by name. ``pinned`` makes a
module follow another release, for comparing against a peer that lives elsewhere and for the
tests. The differential suite (``tests/peers``) runs every
declared release's own code against the drop-ins, so what is declared here is what is tested.
"""

import functools
import inspect
import warnings
from contextlib import contextmanager
from importlib import metadata
from typing import Optional

from packaging.version import InvalidVersion, Version


def parse_version(text: str) -> Version:
    """``"0.10.1.post1"`` -> ``Version("0.10.1.post1")``; a ValueError naming the text otherwise."""
    try:
        return Version(str(text).strip())
    except InvalidVersion:
        raise ValueError(f"not a version: {text!r}") from None


@functools.lru_cache(maxsize=None)
def _installed(distribution: str) -> Optional[str]:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def parameters(*required: str, **optional) -> inspect.Signature:
    """A signature of positional-or-keyword parameters: ``required`` first, then ``optional`` with
    their defaults, in order (``parameters("x", "y", mode="k1")`` is ``(x, y, mode="k1")``)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature(
        [inspect.Parameter(name, kind) for name in required]
        + [inspect.Parameter(name, kind, default=value) for name, value in optional.items()]
    )


class Peer:
    """A peer trainer: its distribution name and every release the drop-ins follow.

    ``releases`` maps each release, oldest first, to the names of the changes it brought (an
    empty tuple for a release that changed nothing the drop-ins reproduce).
    """

    def __init__(self, distribution: str, releases: dict):
        self.distribution = distribution
        self.releases = sorted(parse_version(release) for release in releases)
        if [str(v) for v in self.releases] != list(releases):
            raise ValueError(f"{distribution}: declare the releases oldest first, each once")
        self._introduced = {}
        for release, changes in releases.items():
            for change in changes:
                if change in self._introduced:
                    raise ValueError(f"{distribution}: change {change!r} is declared twice")
                self._introduced[change] = parse_version(release)
        self._pinned: Optional[Version] = None

    @property
    def oldest(self) -> Version:
        return self.releases[0]

    @property
    def newest(self) -> Version:
        return self.releases[-1]

    def installed(self) -> Optional[Version]:
        """The installed version, or None when the peer is not installed."""
        text = _installed(self.distribution)
        return None if text is None else parse_version(text)

    def _declared(self) -> Version:
        return self._pinned or self.installed() or self.newest

    @property
    def release(self) -> Version:
        """The declared release followed: the installed (or pinned) one, else the newest declared
        before it (the oldest, for a version older than every release)."""
        version = Version(self._declared().public)  # a local build (+cu130) is its release
        earlier = [release for release in self.releases if release <= version]
        return earlier[-1] if earlier else self.oldest

    def has(self, change: str) -> bool:
        """Whether the release followed includes ``change`` (a name this peer declares)."""
        if change not in self._introduced:
            raise KeyError(f"{self.distribution} declares no change named {change!r}")
        return self.release >= self._introduced[change]

    def check_supported(self) -> Version:
        """The release followed: a version older than the oldest declared is a ValueError naming the
        range; one that is not declared is a warning naming the release followed instead."""
        version = self._declared()
        if version < self.oldest:
            raise ValueError(f"{self.distribution} {version} is older than fastppo's drop-ins support ({self.range()})")
        if Version(version.public) not in self.releases:  # a local build of a declared release is that release
            newer = version > self.newest
            warnings.warn(
                f"{self.distribution} {version} is {'newer than' if newer else 'not one of'} the "
                f"releases fastppo's drop-ins were tested with ({self.range()}); they follow "
                f"{self.release}",
                stacklevel=3,
            )
        return self.release

    def range(self) -> str:
        return f"{self.oldest} to {self.newest}"

    def follows(self, signatures: dict):
        """Decorate a drop-in whose parameters changed between releases: ``signatures`` maps the
        release that introduced each parameter list (a :func:`parameters`) to it. Calls bind as the
        followed release binds them (a TypeError as Python's where it would fail), and the
        implementation gets every parameter of that release by name, defaults applied."""
        table = sorted((parse_version(release), signature) for release, signature in signatures.items())
        if table[0][0] != self.oldest:
            raise ValueError(f"{self.distribution}: the first signature must be the oldest release's ({self.oldest})")

        def decorate(implementation):
            return _Following(self, table, implementation)

        return decorate

    @contextmanager
    def pinned(self, version: str):
        """Follow ``version`` inside the block, whatever is installed."""
        previous, self._pinned = self._pinned, parse_version(version)
        try:
            self.check_supported()
            yield self
        finally:
            self._pinned = previous


class _Following:
    """A drop-in taking the followed release's parameters (see :meth:`Peer.follows`); ``inspect``
    sees that release's signature, and as a class attribute it binds ``self`` like a function."""

    def __init__(self, peer: Peer, table: list, implementation):
        functools.update_wrapper(self, implementation)
        self._peer, self._table, self._implementation = peer, table, implementation

    @property
    def __signature__(self) -> inspect.Signature:
        release = self._peer.release
        return [signature for introduced, signature in self._table if introduced <= release][-1]

    def bind(self, *args, **kwargs) -> dict:
        """Every parameter of the followed release by name, as a call with these arguments gets them."""
        bound = self.__signature__.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def __call__(self, *args, **kwargs):
        return self._implementation(**self.bind(*args, **kwargs))

    def __get__(self, instance, owner=None):
        return self if instance is None else functools.partial(self, instance)


class ConstructorSignature:
    """``__signature__ = ConstructorSignature()`` on a class whose ``__init__`` follows releases and
    whose ``__new__`` takes ``*args``: ``inspect.signature(cls)`` is then the release's constructor."""

    def __get__(self, instance, owner):
        if instance is not None:
            raise AttributeError("__signature__")  # an instance is signed by its type's __call__
        parameters = list(owner.__init__.__signature__.parameters.values())[1:]  # without self
        return inspect.Signature(parameters)
