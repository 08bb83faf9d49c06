"""A pytest plugin: the peer's own tests, with fastppo's ``patch()`` applied before they import.

``-p peer_patch`` with ``FASTPPO_PEER`` naming the peer (verl, openrlhf) and
``FASTPPO_PEER_SOURCE`` the directory its package sits in. Patching swaps fastppo's drop-ins into
every module of the installed peer. Some peer tests load a file of the peer under a private name
instead of importing it (OpenRLHF's load ``models/loss.py`` so); such a copy gets the drop-ins for
the names its file defines as it is executed, the same ones ``patch()`` swaps into the package.
"""

import importlib
import os
from importlib.machinery import SourceFileLoader
from pathlib import Path


def pytest_configure(config):
    patch = importlib.import_module(f"fastppo.integrations.{os.environ['FASTPPO_PEER']}").patch()
    source = Path(os.environ["FASTPPO_PEER_SOURCE"]).resolve()
    by_module = {}
    for (module, name), drop_in in patch.replacements.items():
        if "." not in name:
            by_module.setdefault(module, {})[name] = drop_in
    execute = SourceFileLoader.exec_module

    def exec_module(loader, module):
        execute(loader, module)
        path = Path(getattr(module, "__file__", "") or "").resolve()
        if source not in path.parents:
            return
        dotted = ".".join(path.relative_to(source).with_suffix("").parts)
        if module.__name__ == dotted:
            return  # the package's own module: patch() reached it
        for name, drop_in in by_module.get(dotted, {}).items():
            if hasattr(module, name):
                setattr(module, name, drop_in)

    SourceFileLoader.exec_module = exec_module
