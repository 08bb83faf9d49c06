"""Tools: Python callables the policy may call during an episode, each with the JSON schema the chat
template shows it.

A tool is a plain or ``async`` function with type hints and a Google-style docstring (the form
TRL's ``GRPOTrainer(tools=...)`` takes, so the same functions serve both); its schema is
transformers' ``get_json_schema``. ``--tools`` names them as ``module:function`` or a built-in
(``python``, ``calculator``: ``builtin.py``). Whatever a tool returns reaches the model as text:
a string as it is, a dict or list as JSON, anything else through ``str``.
"""

import inspect
import json
import re
from dataclasses import dataclass
from typing import Callable

from ..errors import UsageError
from ..user_code import import_from_here


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.function)


def tool(function: Callable, what: str = None) -> Tool:
    """``function`` as a :class:`Tool`; one that cannot have a schema (no docstring, a parameter
    without a type hint or without a line in the docstring) is a ``UsageError`` naming it."""
    from transformers.utils import get_json_schema

    what = what or f"tool {getattr(function, '__name__', function)!r}"
    if isinstance(function, type):  # calling it would make an instance, the model's "result"
        raise UsageError(
            f"{what} is a class, not a function: a class whose instances are each episode's world is an "
            "--environment (its methods are the tools)"
        )
    if not callable(function):
        raise UsageError(f"{what} is not callable")
    try:
        schema = get_json_schema(function)
    except Exception as error:  # transformers' own: no docstring, a missing type hint or description
        raise UsageError(f"{what}: {error}".replace("\n", " ")) from None
    return Tool(schema["function"]["name"], function, schema)


def named(spec: str, option: str, form: str = "module:function", builtin: str = ""):
    """What ``spec`` (``module:name``, ``form`` in errors) names, imported from the working
    directory too; a ``UsageError`` naming ``option`` when it cannot be had (``builtin``: the
    built-in names, said as the other choice)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UsageError(f"{option} {spec}: give '{form}'" + (f" or a built-in ({builtin})" if builtin else ""))
    try:
        module = import_from_here(module_name)
    except Exception as error:  # not found, or its own code failing as it is imported
        raise UsageError(f"{option} {spec}: cannot import {module_name} ({type(error).__name__}: {error})") from None
    if not hasattr(module, name):
        raise UsageError(f"{option} {spec}: {module_name} has no {name}")
    return getattr(module, name)


def load_tool(spec: str, timeout: float) -> Tool:
    """The tool ``spec`` names: a built-in of ``builtin.py`` (``python`` stopped after ``timeout``
    seconds) or ``module:function``."""
    from .builtin import builtin_tools

    builtin = builtin_tools(timeout)
    function = builtin[spec] if spec in builtin else named(spec, "--tools", builtin=", ".join(builtin))
    return tool(function, f"--tools {spec}")


SURROGATES = re.compile("[\ud800-\udfff]")  # halves of UTF-16 pairs: no text any tokenizer takes


def as_text(result) -> str:
    """What a tool returned, as the text the model reads: valid Unicode (a lone surrogate becomes
    U+FFFD). Raises what ``str`` of the result raises (a caller's failed call)."""
    if isinstance(result, str):
        text = result
    elif isinstance(result, (dict, list)):
        try:
            text = json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            text = str(result)
    else:
        text = str(result)
    return SURROGATES.sub("\ufffd", text)


def check_names(names: list) -> None:
    """Two tools of one name is a ``UsageError``: the model could not tell them apart."""
    for i, name in enumerate(names):
        if name in names[:i]:
            raise UsageError(f"two tools are named {name!r}: the model could not tell them apart")
