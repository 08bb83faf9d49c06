"""Environments: an object per episode that is its world, as TRL's ``environment_factory`` makes them.

A factory is anything that, called with no argument, returns an environment: its class, a
function, a lambda or a ``functools.partial``. Or a dict of them by name: each prompt row then
names its environment in an ``environment`` field, and its prompt lists only that environment's
tools (with the run's other tools). ``reset(**row)`` opens an episode with the whole row, its
prompt column included (the ``environment`` field left out where it chose the factory), and may
return an observation, a string added to the end of the prompt's last message (the prompt must
then be a chat prompt). The environment's other public methods are tools, bound to that episode's
instance (their schemas from their type hints and docstrings, as any tool's). Each class with a
``get_reward()`` (plain or ``async``) is one more reward, named after the class: it scores the rows
whose environment is of exactly that class and gives the others no score (None), as TRL's does.
Instances are made once and reset for each episode: a batch of B rows holds B of them. Batches
that are in flight at once (rollouts streaming ahead, ``--max-staleness``) each reset a pool of
their own, so that no batch resets an instance another batch's episode still uses.
"""

import asyncio
import inspect
from collections.abc import Mapping

from ..errors import UsageError
from .tools import named, tool

HOOKS = ("reset", "get_reward")  # methods that are not tools
CHOOSER = "environment"  # the row field that names its environment, with several


def load_environment(spec: str) -> "Environments":
    """The environment factory (or dict of them) ``module:name`` names."""
    return Environments(named(spec, "--environment", "module:Class"), f"--environment {spec}")


class Environments:
    def __init__(self, factory, what: str):
        self.what, self.several = what, isinstance(factory, Mapping)
        factories = dict(factory) if self.several else {None: factory}
        if not factories:
            raise UsageError(f"{what} is an empty dict: it names no environment")
        self.factories, self.pools, self.methods = {}, {}, {}  # by name; instances by (pool, name); by class
        for name, made_by in factories.items():
            label = what if name is None else f"{what}[{name!r}]"
            if not callable(made_by):
                raise UsageError(
                    f"{label} is {type(made_by).__name__}: give a class, or a function returning an instance"
                )
            self.factories[name] = (made_by, label)
            probe = self._make(name)
            kind = type(probe)
            if not callable(getattr(probe, "reset", None)):
                raise UsageError(f"{label}: the class {kind.__name__} has no reset method (it opens each episode)")
            members = inspect.getmembers(kind, inspect.isfunction)
            self.methods[kind] = [n for n, _ in members if n not in HOOKS and n[0] != "_"]
            self.pools[0, name] = [probe]
        self.schemas = {name: [t.schema for t in self.tools(pool[0])] for (_, name), pool in self.pools.items()}

    @property
    def name(self) -> str:
        return ", ".join(kind.__name__ for kind in self.methods)

    @property
    def rewards(self) -> bool:
        """Whether some environment gives a reward (``get_reward``)."""
        return bool(self.named_rewards())

    def _make(self, name):
        made_by, label = self.factories[name]
        try:
            return made_by()
        except Exception as error:
            raise UsageError(f"{label}: making an environment raised {type(error).__name__}: {error}") from None

    def tools(self, instance) -> list:
        """The tools of one episode: ``instance``'s public methods."""
        return [tool(getattr(instance, n), f"{self.what}: method {n}") for n in self.methods[type(instance)]]

    def chosen(self, row: dict, origin: str):
        """The name of the environment ``row`` (from ``origin``) takes: None with one factory."""
        if not self.several:
            return None
        name = row.get(CHOOSER)
        if name not in self.factories:
            names = ", ".join(map(repr, self.factories))
            given = f"has {CHOOSER}={name!r}" if CHOOSER in row else f"has no {CHOOSER!r} field"
            raise UsageError(f"{origin} {given}: {self.what} chooses by it among {names}")
        return name

    def schemas_of(self, row: dict, origin: str) -> list:
        """The tool schemas of the environment ``row`` takes."""
        return self.schemas[self.chosen(row, origin)]

    def reset(self, rows: list, origins: list, pool: int = 0) -> tuple:
        """``(instances, observations)``: one instance per row, of the environment it takes, reset with
        the row (dicts, whole; from ``origins``); the instances of ``pool`` (a batch in flight beside
        others resets a pool of its own)."""
        handed = {name: 0 for name in self.factories}
        instances, observations = [], []
        for row, origin in zip(rows, origins):
            name = self.chosen(row, origin)
            instances_of = self.pools.setdefault((pool, name), [])
            if handed[name] == len(instances_of):
                instances_of.append(self._make(name))
            instance = instances_of[handed[name]]
            handed[name] += 1
            arguments = {k: v for k, v in row.items() if k != CHOOSER} if self.several else row
            try:
                observation = instance.reset(**arguments)
            except Exception as error:  # the user's code: named, not a crash deep in the sampler
                raise UsageError(f"{self.what}: reset raised {type(error).__name__}: {error}") from None
            if inspect.iscoroutine(observation):
                observation.close()  # never run: closed, so no "never awaited" warning beside the error
                raise UsageError(f"{self.what}: reset is async; it must be a plain method (get_reward may be async)")
            if observation is not None and not isinstance(observation, str):
                raise UsageError(
                    f"{self.what}: reset returned {type(observation).__name__}; it must return a string "
                    "(an observation added to the prompt) or None"
                )
            instances.append(instance)
            observations.append(observation)
        return instances, observations

    def named_rewards(self) -> list:
        """``[(name, function)]``: each environment class's ``get_reward()`` as a reward function
        named after the class (reading the ``environments`` keyword every reward call gets with an
        environment), None for the rows of other classes; an ``async`` one awaited."""
        return [
            (kind.__name__, _reward_of(kind)) for kind in self.methods if callable(getattr(kind, "get_reward", None))
        ]


def _reward_of(kind: type):
    def environment_reward(prompts, completions, environments, **_):
        scores = [e.get_reward() if type(e) is kind else None for e in environments]
        if any(inspect.isawaitable(s) for s in scores):
            scores = asyncio.run(_awaited(scores))
        return scores

    environment_reward.__qualname__ = f"{kind.__qualname__}.get_reward"  # what errors name
    return environment_reward


async def _awaited(values: list) -> list:
    """``values`` with each awaitable awaited, in order."""
    return [await v if inspect.isawaitable(v) else v for v in values]
