"""A reward function named by its spec: a built-in verifier's name (``verifiers.py``) or
``module:function``, imported as ``python -m`` would find it; every failure one line naming the spec.
"""

from ..errors import UsageError
from ..user_code import import_from_here
from .verifiers import BUILTIN, format_reward


def load_reward(spec: str, format_pattern: str = None):
    """The reward function named by ``spec``: a built-in of :mod:`fastppo.rewards` (``gsm8k``,
    ``math``, ``boxed``, ``format``, the last with ``format_pattern``) or ``module:function``."""
    if spec in BUILTIN:
        if spec != "format":
            return BUILTIN[spec]
        try:
            return format_reward(format_pattern) if format_pattern is not None else format_reward()
        except ValueError as error:
            raise UsageError(f"--format-pattern: {error}") from None
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UsageError(f"reward must be 'module:function' or one of {', '.join(BUILTIN)}, got {spec!r}")
    try:
        module = import_from_here(module_name)
    except ImportError as error:
        raise UsageError(f"reward {spec!r}: cannot import {module_name} ({error})") from None
    except Exception as error:  # a syntax error in it, or its own code raising as it is imported
        raise UsageError(f"reward {spec!r}: importing {module_name} raised {type(error).__name__}: {error}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"reward {spec!r}: {module_name} has no function {name}")
    return fn
