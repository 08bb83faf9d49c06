"""Stand-ins for the peers' distributed and GPU-only dependencies, installed on import.

The differential suite runs verl's and OpenRLHF's own files on a CPU machine; they import Ray,
vLLM, flash-attn and (verl 0.9) TransferQueue at module level, though none of the functions
compared touches them. Each of those packages becomes a module whose every attribute is an inert
object (callable, usable as a decorator, a base class or a type in ``X | None``), except
``flash_attn.ops``, which stays absent: the peers import its cross-entropy inside a
``try``/``except ImportError`` and fall back to their PyTorch code, which is what is compared.

Loaded with ``-p peer_stubs`` (a pytest plugin with no hooks) or by importing it first.
"""

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("ray", "vllm", "flash_attn", "transfer_queue")
ABSENT = ("flash_attn.ops",)


class Inert:
    """Whatever a module-level use of a stubbed package needs, doing nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # a decorator: the decorated function or class, unchanged
        return Inert()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Inert()

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):
        return Inert()

    __ror__ = __or__

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Inert()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == absent or name.startswith(absent + ".") for absent in ABSENT):
            raise ModuleNotFoundError(f"No module named {name!r} (left out on purpose)", name=name)
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
