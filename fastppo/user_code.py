"""Importing a user's module for a ``module:name`` spec (rewards, tools, environments)."""

import importlib
import os
import sys


def import_from_here(name: str):
    """``import name``, finding a module in the working directory as ``python -m`` would: the
    ``fastppo`` script, unlike ``python -m fastppo``, has no working directory on ``sys.path``."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        here = os.getcwd()
        if error.name != name.partition(".")[0] or here in sys.path:
            raise
        sys.path.insert(0, here)
        return importlib.import_module(name)
