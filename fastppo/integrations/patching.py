"""``patch()`` and ``unpatch()`` for a peer package: fastppo's drop-ins swapped in by identity.

A trainer reaches a helper through many names: the module that defines it, every module that
did ``from ... import helper``, and registries (verl looks its policy losses and advantage
estimators up in module-level dicts). Patching by identity covers them all: every attribute, and
every value of a module-level dict, of every imported module of the package that *is* the
original becomes the replacement. Unpatching walks the package's modules again, so modules
imported while patched (they copied the replacement) are restored too. Modules outside the
package are never touched: a user's own ``from fastppo.integrations.trl import ...`` stays.

``with patch():`` blocks nest: the drop-ins stay in until the outermost block exits (each
``patch()`` call holds the patch once; ``unpatch()`` restores at once, whoever holds it).

A name ``"Class.method"`` is a method: the class gets the drop-in as a static method (it takes
the method's arguments after ``self``), and gets its own back on unpatching.

Nothing fails silently: without the package, ``install`` raises the ImportError that says how to
install it; with the package present but a module of it failing to import (a missing dependency
such as flash-attn, a version conflict), the error names that module and the import that failed,
as an ImportError when nothing could be patched and as a warning for each module left out
otherwise. Only a module the installed release does not have at all is skipped without a word.
"""

import importlib
import sys
import warnings
from types import ModuleType


class Patch:
    """Replacements ``{(module, name): drop_in}`` for the modules of ``package``."""

    def __init__(self, package: str, replacements: dict, caller: str, install_hint: str):
        self.package = package
        self.replacements = replacements
        self.caller = caller  # who patches, for messages: "fastppo.integrations.verl.patch()"
        self.install_hint = install_hint  # how to install the package: "pip install verl"
        self._swapped = []  # (original, drop-in) pairs while patched
        self._methods = []  # (class, name, original) while patched
        self._holders = 0  # the patch() calls not yet exited: nested contexts restore at the outermost

    @property
    def active(self) -> bool:
        return bool(self._swapped or self._methods)

    def original(self, module: str, name: str):
        """The peer's own object for ``module.name``, patched or not."""
        current = getattr(importlib.import_module(module), name)
        for original, drop_in in self._swapped:
            if current is drop_in:
                return original
        return current

    def install(self, peer) -> "Patch":
        """Swap the drop-ins in, once the installed ``peer`` (a ``peers.Peer``) is supported; while
        they are in, one more holder of the patch."""
        if self.active:
            self._holders += 1
            return self
        try:
            importlib.import_module(self.package)
        except ImportError as error:
            if _absent(self.package, error):
                raise ImportError(f"{self.caller} needs {self.package}: {self.install_hint}") from error
            raise ImportError(
                f"{self.caller}: {self.package} is installed but importing it failed: {error}; nothing was patched"
            ) from error
        peer.check_supported()
        owners = self._import_owners()
        pairs = []
        for (module, name), drop_in in self.replacements.items():
            if module not in owners:
                continue
            if "." in name:
                self._swap_method(owners[module], name, drop_in)
                continue
            original = getattr(owners[module], name, None)
            if original is not None and original is not drop_in:
                pairs.append((original, drop_in))
        self._swapped = pairs
        self._swap({id(original): drop_in for original, drop_in in pairs})
        self._holders = 1
        return self

    def _import_owners(self) -> dict:
        """``{module name: module}`` for the replacements' modules this release has; a module that
        exists but fails to import is a warning naming its error, or an ImportError if all do."""
        owners, failed = {}, {}
        for module, _ in self.replacements:
            try:
                owners[module] = importlib.import_module(module)
            except ImportError as error:
                if not _absent(module, error):  # an absent module is one this release does not have
                    failed[module] = error
        if failed and not owners:
            module, error = next(iter(failed.items()))
            raise ImportError(f"{self.caller}: importing {module} failed: {error}; nothing was patched") from error
        for module, error in failed.items():
            names = ", ".join(name for owner, name in self.replacements if owner == module)
            warnings.warn(
                f"{self.caller}: importing {module} failed: {error}; its {names} stay {self.package}'s", stacklevel=4
            )
        return owners

    def remove(self) -> None:
        """Restore the peer's own, whoever holds the patch (``unpatch()``)."""
        self._holders = 0
        self._swap({id(drop_in): original for original, drop_in in self._swapped})
        self._swapped = []
        while self._methods:
            cls, name, original = self._methods.pop()
            setattr(cls, name, original)

    def _swap_method(self, module: ModuleType, dotted: str, drop_in) -> None:
        class_name, name = dotted.split(".")
        cls = getattr(module, class_name, None)
        if cls is not None and name in vars(cls):
            self._methods.append((cls, name, vars(cls)[name]))
            setattr(cls, name, staticmethod(drop_in))

    def _swap(self, mapping: dict) -> None:
        for module in self._modules():
            for attribute, value in list(vars(module).items()):
                if attribute.startswith("__"):
                    continue
                if id(value) in mapping:
                    setattr(module, attribute, mapping[id(value)])
                elif type(value) is dict:  # a registry
                    for key, entry in list(value.items()):
                        if id(entry) in mapping:
                            value[key] = mapping[id(entry)]

    def _modules(self) -> list:
        prefix = self.package + "."
        return [
            module
            for name, module in list(sys.modules.items())
            if isinstance(module, ModuleType) and (name == self.package or name.startswith(prefix))
        ]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        """The end of a ``with patch():`` block: restores only when no outer block holds the patch."""
        self._holders -= 1
        if self._holders <= 0:
            self.remove()


def _absent(module: str, error: ImportError) -> bool:
    """Whether ``error``, raised importing ``module``, says that it (or a package above it) does not
    exist, as opposed to existing and failing to import something else."""
    missing = getattr(error, "name", None)
    return (
        isinstance(error, ModuleNotFoundError)
        and missing is not None
        and (module == missing or module.startswith(missing + "."))
    )
