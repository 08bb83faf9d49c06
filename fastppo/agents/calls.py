"""Running tool calls off the sampler's loop, each bounded by a timeout, their failures results.

Plain tools run each in a daemon thread of its own and ``async`` ones on one event loop in a
thread of its own, so the calls of every paused row run at once while the other rows decode. A
call's timeout counts from its submission; waiting for it never outlasts that. A plain function
that never returns cannot be stopped from outside its thread: its result is a timeout error, and
its thread is left to run (a daemon: it keeps no process alive; the built-in ``python`` tool runs
its code in a subprocess it kills, so it never does this). Whatever goes wrong (a malformed call, an unknown
tool, bad arguments, an exception, a timeout) becomes an error message the model reads, and is
counted.
"""

import asyncio
import inspect
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Optional

from .tools import as_text


@dataclass
class Call:
    """One tool call as parsed from a turn: ``error`` says why it cannot run (malformed)."""

    name: str
    arguments: Optional[dict] = None
    error: Optional[str] = None


@dataclass
class Result:
    name: str
    text: str
    status: str  # "ok", "failed" (malformed, unknown tool, bad arguments, raised) or "timeout"
    seconds: float


class _Pending:
    """A submitted call: the future of its outcome and the time by which it must have one."""

    def __init__(self, call: Call, future: Optional[Future], deadline: float, start: float, done=None):
        self.call, self.future, self.deadline, self.start, self.done = call, future, deadline, start, done


class ToolRunner:
    def __init__(self, timeout: float):
        self.timeout = timeout
        self.loop = None  # started on the first async call

    def submit(self, calls: list, tools: dict) -> list:
        """Start ``calls`` with the tools ``{name: Tool}`` of their row; :meth:`results` waits."""
        started = []
        for call in calls:
            start = time.monotonic()
            deadline = start + self.timeout
            failed = self._refused(call, tools)
            if failed is not None:
                started.append(_Pending(call, None, deadline, start, Result(call.name, failed, "failed", 0.0)))
                continue
            tool = tools[call.name]
            if tool.is_async:
                coroutine = asyncio.wait_for(tool.function(**call.arguments), self.timeout)
                future = asyncio.run_coroutine_threadsafe(coroutine, self._event_loop())
            else:
                future = _in_thread(tool.function, call.arguments)
            started.append(_Pending(call, future, deadline, start))
        return started

    def results(self, started: list) -> list:
        """The :class:`Result` of each call :meth:`submit` started, in order."""
        return [p.done or self._outcome(p) for p in started]

    def _outcome(self, pending: _Pending) -> Result:
        name = pending.call.name
        try:
            value = pending.future.result(timeout=max(0.0, pending.deadline - time.monotonic()))
        except (FutureTimeout, asyncio.TimeoutError, TimeoutError):
            pending.future.cancel()
            return Result(name, f"error: {name} took longer than {self.timeout:g} s", "timeout", self.timeout)
        except BaseException as error:  # the tool's own failure, whatever it is, is the model's to read
            text = f"error: {name} raised {type(error).__name__}: {error}"
            return Result(name, text, "failed", time.monotonic() - pending.start)
        return Result(name, as_text(value), "ok", time.monotonic() - pending.start)

    @staticmethod
    def _refused(call: Call, tools: dict) -> Optional[str]:
        """Why ``call`` cannot run, or None."""
        if call.error is not None:
            return f"error: {call.error}"
        if call.name not in tools:
            return f"error: there is no tool {call.name!r}; the tools are {', '.join(sorted(tools)) or 'none'}"
        if not isinstance(call.arguments, dict):
            return f"error: the arguments of {call.name} must be a JSON object"
        try:
            inspect.signature(tools[call.name].function).bind(**call.arguments)
        except TypeError as error:
            return f"error: {call.name}: {error}"
        return None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, name="fastppo-async-tools", daemon=True).start()
        return self.loop

    def close(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop = None


def _in_thread(function, arguments: dict) -> Future:
    """``function(**arguments)`` in a daemon thread; its outcome in the future returned."""
    future = Future()

    def run():
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function(**arguments))
        except BaseException as error:  # handed to whoever waits, as the tool's failure
            future.set_exception(error)

    threading.Thread(target=run, name="fastppo-tool", daemon=True).start()
    return future
