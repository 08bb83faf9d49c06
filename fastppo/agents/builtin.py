"""The built-in tools: ``python`` (code run in a bounded process tree) and ``calculator``.

``python`` runs the model's code in a fresh interpreter (``python -I``: no user site, no
``PYTHON*`` variables read) in an empty temporary directory, with none of the trainer's environment
variables, under the supervisor of ``sandbox.py``: at most ``sandbox.MAX_PROCESSES`` processes,
each with limits on CPU seconds, address space and the size of any file it writes, and the wall
clock (the run's ``--tool-timeout``), after which every process it started is killed, those that
left its session too. Its output goes to a file (bounded by the file-size limit), of which
``OUTPUT_BYTES`` come back. As root with namespaces the code is isolated from the trainer (a uid
and namespaces of its own: ``sandbox.isolation()`` says so at start-up); elsewhere it is not, and
docs/agents.md lists what it can reach.

``calculator`` evaluates arithmetic (numbers, + - * / // % **, parentheses) without ``eval``:
an expression tree with a bound on exponents, so no input can take long.
"""

import ast
import operator
import os
import signal
import sys
import tempfile

from . import sandbox

CPU_SECONDS = 10  # the python tool's CPU time
MEMORY_BYTES = 1 << 30  # its address space
FILE_BYTES = 16 << 20  # the largest file it may write
OUTPUT_BYTES = 8192  # of its stdout and stderr, together, shown to the model
MAX_EXPONENT = 1000  # the calculator's largest power


def run_python(code: str, wall_seconds: float) -> str:
    """``code`` run as described above: its output (stdout then stderr, cut at ``OUTPUT_BYTES``),
    or why it was stopped."""
    limits = {"cpu": CPU_SECONDS, "memory": MEMORY_BYTES, "file": FILE_BYTES}
    with tempfile.TemporaryDirectory(prefix="fastppo-python-") as here:
        # its output goes to a file of its directory, which the file-size limit bounds (a pipe is unbounded)
        with open(os.path.join(here, ".output"), "w+b") as sink:
            outcome = sandbox.run([sys.executable, "-I", "-c", code], here, sink, wall_seconds, limits)
            sink.seek(0)
            output = sink.read(OUTPUT_BYTES + 1)
    stopped = outcome["stopped"]
    if stopped == "time":
        return f"error: the code ran longer than {wall_seconds:g} s and was stopped"
    text = output[:OUTPUT_BYTES].decode("utf-8", errors="replace")
    if len(output) > OUTPUT_BYTES:
        text += f"\n[output cut at {OUTPUT_BYTES} bytes]"
    if stopped == "processes":
        return text + f"\n[stopped: it ran more than {sandbox.MAX_PROCESSES} processes at once]"
    if stopped == "supervisor":
        return text + "\n[stopped: it killed the process that watched it]"
    returncode = os.waitstatus_to_exitcode(outcome["status"])
    if returncode < 0:
        name = signal.Signals(-returncode).name
        text += f"\n[stopped by {name}{' (CPU time limit)' if name == 'SIGXCPU' else ''}]"
    elif returncode != 0:
        text += f"\n[exit status {returncode}]"
    return text


def python_tool(wall_seconds: float):
    """The ``python`` tool with a wall-clock limit of ``wall_seconds``."""

    def python(code: str) -> str:
        """Run a Python program in a fresh interpreter and return what it prints.

        Args:
            code: The program; print() what you want to see.
        """
        return run_python(code, wall_seconds)

    return python


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents are limited to {MAX_EXPONENT}")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, for example "(12 + 7) * 3".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def builtin_tools(wall_seconds: float) -> dict:
    """``{name: function}`` of the built-in tools, ``python`` limited to ``wall_seconds``."""
    return {"python": python_tool(wall_seconds), "calculator": calculator}
