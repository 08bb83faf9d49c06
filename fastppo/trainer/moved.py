"""The flat trainer's old module paths, forwarding with a warning for one release.

Each path of fastppo 0.2's flat trainer still imports until 0.4, with a ``DeprecationWarning``
naming where it went. A module that moved whole is itself under its old path (a name patched
through it is patched where the code reads it); a split one is a module that forwards each name to
the new module holding it. The table is the CHANGELOG's list of moves."""

import importlib
import importlib.abc
import importlib.util
import types
import warnings

T = "fastppo.trainer"
# old path -> the modules that hold its names now, searched in order
MOVED = {
    f"{T}.batch": (f"{T}.update.batch",),
    f"{T}.checkpoint": (f"{T}.run.checkpoint",),
    f"{T}.config": (f"{T}.configuration.config", f"{T}.configuration.arguments"),
    f"{T}.data": (
        f"{T}.prompts.dataset",
        f"{T}.prompts.files",
        f"{T}.prompts.columns",
        f"{T}.prompts.chat",
        f"{T}.prompts.order",
    ),
    f"{T}.distributed": (f"{T}.parallel.distributed",),
    f"{T}.errors": ("fastppo.errors",),
    f"{T}.estimators": (f"{T}.update.estimators",),
    f"{T}.evaluation": (f"{T}.experience.evaluation",),
    f"{T}.fields": (f"{T}.configuration.fields", "fastppo.limits"),
    f"{T}.host_memory": (f"{T}.modeling.host_memory",),
    f"{T}.inputs": (f"{T}.run.inputs",),
    f"{T}.layout": (f"{T}.update.row_layout",),
    f"{T}.lora": (f"{T}.modeling.lora",),
    f"{T}.loss": (f"{T}.update.loss",),
    f"{T}.models": (
        f"{T}.modeling.default",
        f"{T}.modeling.loading",
        f"{T}.modeling.weights",
        f"{T}.modeling.critic",
        "fastppo.hf",
        "fastppo.rewards.model",
    ),
    f"{T}.optimizers": (f"{T}.update.optimizers",),
    f"{T}.plan": (f"{T}.memory.plan", "fastppo.limits"),
    f"{T}.plot": (f"{T}.run.plot",),
    f"{T}.precision": (f"{T}.modeling.precision",),
    f"{T}.responses": (f"{T}.experience.responses",),
    f"{T}.rollout_weights": (f"{T}.modeling.rollout_weights",),
    f"{T}.rollouts": (f"{T}.experience.rollouts",),
    f"{T}.run_directory": (f"{T}.run.directory",),
    f"{T}.run_lock": (f"{T}.run.lock",),
    f"{T}.run_log": (f"{T}.run.log",),
    f"{T}.sharding": (f"{T}.parallel.sharding",),
    f"{T}.shared_prefix": (f"{T}.update.probe",),
    f"{T}.signals": (f"{T}.run.signals",),
    f"{T}.state": (f"{T}.run.state",),
    f"{T}.summary": (f"{T}.run.summaries",),
    f"{T}.tasks": (
        f"{T}.prompts.tasks",
        "fastppo.rewards.loading",
        "fastppo.rewards.scoring",
        "fastppo.user_code",
        f"{T}.build",
    ),
}
RENAMED = {(f"{T}.summary", "summary"): "start_summary"}  # (old path, old name) -> its name now


class Forwarding(types.ModuleType):
    """An old path whose module was split: each name read from the first of its new modules that holds
    it; a name set through it is set there, and deleting it again puts back what it was (how a test's
    patch is undone)."""

    def __init__(self, name: str, homes: tuple):
        super().__init__(name, f"Moved: {', '.join(homes)}.")
        self.__dict__["_homes"] = homes
        self.__dict__["_replaced"] = {}  # name -> (module, its name there, the value before it was set)

    def _home(self, attr: str):
        attr = RENAMED.get((self.__name__, attr), attr)
        for home in self._homes:
            module = importlib.import_module(home)
            if hasattr(module, attr):
                return module, attr
        return None, attr

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # the import system's own questions (__path__, ...) are not forwarded
            raise AttributeError(attr)
        module, name = self._home(attr)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} (moved: {', '.join(self._homes)}) has no {attr!r}")
        return getattr(module, name)

    def __setattr__(self, attr: str, value) -> None:
        module, name = (None, attr) if attr.startswith("__") else self._home(attr)
        if module is None:
            super().__setattr__(attr, value)
            return
        self._replaced.setdefault(attr, (module, name, getattr(module, name)))
        setattr(module, name, value)

    def __delattr__(self, attr: str) -> None:
        if attr in self._replaced:
            module, name, before = self._replaced.pop(attr)
            setattr(module, name, before)
        else:
            super().__delattr__(attr)


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths (after every other finder: no file holds them any more). A module that
    moved whole is itself under its old path; a split one is a :class:`Forwarding` module."""

    def __init__(self):
        self.own_specs = {}  # old path -> the spec of the module it is, while the import system runs

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        homes = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {' and '.join(homes)}; the old path goes in fastppo 0.4", DeprecationWarning
        )
        if len(homes) > 1 or any(old == spec.name for old, _ in RENAMED):
            return Forwarding(spec.name, homes)
        module = importlib.import_module(homes[0])
        self.own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        own = self.own_specs.pop(module.__spec__.name, None)
        if own is not None:  # the import system gave the module the old path's spec: its own goes back
            module.__spec__ = own
