"""Environments: a class whose instance is one episode's world, as TRL's ``environment_factory``.

The class takes no arguments. ``reset(**fields)`` opens an episode with the prompt row's fields
(what the rewards get) and may return an observation, a string added to the end of the prompt's
last message (the prompt must then be a chat prompt). Its other public methods are tools, bound
to that episode's instance (their schemas from their type hints and docstrings, as any tool's).
A ``get_reward()`` method, if it has one, is one more reward, named after the class. Instances are
made once and reset for each episode: a batch of B rows holds B of them.
"""

import inspect

from ..trainer.errors import UsageError
from .tools import named, tool

HOOKS = ("reset", "get_reward")  # methods that are not tools


def load_environment(spec: str) -> "Environments":
    """The environment class ``module:Class`` names."""
    return Environments(named(spec, "--environment", "module:Class"), f"--environment {spec}")


class Environments:
    def __init__(self, cls, what: str):
        if not isinstance(cls, type):
            raise UsageError(f"{what} is not a class")
        if not callable(getattr(cls, "reset", None)):
            raise UsageError(f"{what}: the class has no reset method (it opens each episode)")
        self.cls, self.what, self.pool = cls, what, []
        self.names = [n for n, _ in inspect.getmembers(cls, inspect.isfunction) if n not in HOOKS and n[0] != "_"]
        self.rewards = callable(getattr(cls, "get_reward", None))
        probe = self._make()
        self.pool.append(probe)
        self.schemas = [t.schema for t in self.tools(probe)]  # checked once, at start-up

    @property
    def name(self) -> str:
        return self.cls.__name__

    def _make(self):
        try:
            return self.cls()
        except Exception as error:
            raise UsageError(f"{self.what}: {self.name}() raised {type(error).__name__}: {error}") from None

    def tools(self, instance) -> list:
        """The tools of one episode: ``instance``'s public methods."""
        return [tool(getattr(instance, n), f"{self.what}: method {n}") for n in self.names]

    def reset(self, fields: list) -> tuple:
        """``(instances, observations)``: one instance per row, reset with its ``fields`` (dicts)."""
        while len(self.pool) < len(fields):
            self.pool.append(self._make())
        instances = self.pool[: len(fields)]
        observations = []
        for instance, row in zip(instances, fields):
            try:
                observations.append(instance.reset(**row))
            except Exception as error:  # the user's code: named, not a crash deep in the sampler
                raise UsageError(f"{self.what}: reset raised {type(error).__name__}: {error}") from None
        for observation in observations:
            if observation is not None and not isinstance(observation, str):
                raise UsageError(
                    f"{self.what}: reset returned {type(observation).__name__}; it must return a string "
                    "(an observation added to the prompt) or None"
                )
        return instances, observations

    def named_reward(self) -> tuple:
        """``(name, function)``: the environments' ``get_reward()`` as a reward function, named after
        the class (it reads the ``environments`` keyword every reward call gets with an environment)."""

        def environment_reward(prompts, completions, environments, **_):
            return [e.get_reward() for e in environments]

        return self.name, environment_reward
