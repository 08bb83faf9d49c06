"""The trainer behind ``fastppo train``: the loop, its wiring and a package per concern.

The loop (``ppo.py``) and the wiring of a run (``build.py``) at the top, the ``fastppo train``
command (``cli.py``), and one package per concern below them (each package's own docstring says what
it holds; the import order between them is declared in ``pyproject.toml``). The flat layout's old
module paths still import, with a warning, for one release (``moved.py``)."""

import sys

from .configuration.config import TrainConfig
from .moved import OldPaths
from .ppo import PPOTrainer

if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
    sys.meta_path.append(OldPaths())

__all__ = ["TrainConfig", "PPOTrainer"]
