"""Running tool calls off the sampler's loop, each bounded by a timeout, their failures results.

Plain tools run each in a daemon thread of its own and ``async`` ones on one event loop in a
thread of its own, so the calls of every paused row run at once while the other rows decode. A
call's timeout counts from its submission; waiting for it never outlasts that (nor
``MAX_TOOL_TIMEOUT``, which bounds the option). Whatever goes wrong with a call (a malformed call,
an unknown tool, bad arguments, an exception of any kind, a result that cannot be made text, a
timeout) becomes an error message the model reads, and is counted.

Errors are caught where the tool runs, never around the wait for it: the thread (or the event
loop's task) that calls a tool turns its outcome into a :class:`Result`, and the main thread's wait
catches only the timeout, so a Ctrl-C or SIGTERM that arrives while the sampler waits stops the
run as it would anywhere else. A tool raising ``KeyboardInterrupt`` or ``SystemExit`` itself is a
failed call, and the event loop outlives it.

A plain function that never returns cannot be stopped from outside its thread: its result is a
timeout error, and its thread is left to run (a daemon: it keeps no process alive; the built-in
``python`` tool runs its code in a process tree it kills, so it never does this). Such threads are
counted (``hung``, the ``tools/hung`` metric), a warning says so as their number doubles, and
while ``MAX_RUNNING`` plain calls are running a new one is not started: it fails at once, saying
why, so hung tools cost a bounded number of threads, never a crash at the process's thread limit.
"""

import asyncio
import inspect
import threading
import time
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Optional

from .tools import as_text

MAX_TOOL_TIMEOUT = 86400.0  # a day: the longest a call may be given (threading's waits overflow far past it)
MAX_RUNNING = 256  # plain tool calls running at once, those past their timeout included


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
    status: str  # "ok", "failed" (malformed, unknown tool, bad arguments, raised, refused) or "timeout"
    seconds: float


class _Pending:
    """A submitted call: the future of its :class:`Result` and the time by which it must have one."""

    def __init__(self, call: Call, future: Optional[Future], deadline: float, start: float, done=None):
        self.call, self.future, self.deadline, self.start, self.done = call, future, deadline, start, done


def _settled(name: str, start: float, value) -> Result:
    """The result of a call that returned ``value``: its text, or a failure if it has none."""
    try:
        return Result(name, as_text(value), "ok", time.monotonic() - start)
    except BaseException as error:  # str() of the value raised (a huge int, a raising __str__)
        return _raised(name, start, error, "returned a value that cannot be shown as text: ")


def _raised(name: str, start: float, error: BaseException, what: str = "raised ") -> Result:
    try:
        detail = as_text(f"{type(error).__name__}: {error}")
    except BaseException:  # an exception whose own message raises
        detail = type(error).__name__
    return Result(name, f"error: {name} {what}{detail}", "failed", time.monotonic() - start)


class ToolRunner:
    def __init__(self, timeout: float):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TOOL_TIMEOUT:
            raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TOOL_TIMEOUT:g}], got {timeout!r}")
        self.timeout = float(timeout)
        self.loop = self._loop_thread = None  # started on the first async call
        self._lock = threading.Lock()
        self._running = {}  # one entry per plain call running: its deadline
        self._warned = 0  # the hung count of the last warning

    @property
    def hung(self) -> int:
        """Plain calls still running past their timeout (their threads cannot be stopped)."""
        now = time.monotonic()
        with self._lock:
            return sum(deadline < now for deadline in self._running.values())

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
                coroutine = self._guarded(tool.function, call.arguments, call.name, start)
                future = asyncio.run_coroutine_threadsafe(coroutine, self._event_loop())
            else:
                future = self._in_thread(tool.function, call.arguments, call.name, start, deadline)
            if isinstance(future, Result):  # not started
                started.append(_Pending(call, None, deadline, start, future))
            else:
                started.append(_Pending(call, future, deadline, start))
        return started

    def results(self, started: list) -> list:
        """The :class:`Result` of each call :meth:`submit` started, in order."""
        return [p.done or self._outcome(p) for p in started]

    def ready(self, started: list) -> bool:
        """Whether :meth:`results` would return at once: every call settled or past its deadline."""
        now = time.monotonic()
        return all(p.done is not None or p.future.done() or p.deadline <= now for p in started)

    def _outcome(self, pending: _Pending) -> Result:
        name = pending.call.name
        wait = min(max(0.0, pending.deadline - time.monotonic()), threading.TIMEOUT_MAX)
        try:  # only the timeout is caught here: a signal raised in this wait stops the run
            return pending.future.result(timeout=wait)
        except FutureTimeout:
            pending.future.cancel()  # an async call's task; a plain call's thread runs on
            self._warn_if_hung(name)
            return Result(name, f"error: {name} took longer than {self.timeout:g} s", "timeout", self.timeout)

    def _in_thread(self, function, arguments: dict, name: str, start: float, deadline: float):
        """``function(**arguments)`` in a daemon thread; its :class:`Result` in the future returned,
        or a failed Result when the thread is not started (``MAX_RUNNING``, or the thread limit)."""
        future, token = Future(), object()
        with self._lock:
            running = len(self._running)
            if running < MAX_RUNNING:
                self._running[token] = deadline
        if running >= MAX_RUNNING:
            why = f"{running} tool calls are still running ({self.hung} past their timeout)"
            return Result(name, f"error: {name} was not started: {why}", "failed", 0.0)

        def run():
            try:
                if not future.set_running_or_notify_cancel():
                    return
                try:
                    value = function(**arguments)
                except BaseException as error:  # the tool's own failure, whatever it is, is the model's to read
                    future.set_result(_raised(name, start, error))
                else:
                    future.set_result(_settled(name, start, value))
            finally:
                with self._lock:
                    del self._running[token]

        try:
            threading.Thread(target=run, name=f"fastppo-tool-{name}", daemon=True).start()
        except RuntimeError as error:  # the process's thread limit
            with self._lock:
                del self._running[token]
            return _raised(name, start, error, "could not be started: ")
        return future

    async def _guarded(self, function, arguments: dict, name: str, start: float) -> Result:
        """The async call inside the event loop's task, its outcome a :class:`Result` whatever it
        raises: a KeyboardInterrupt or SystemExit leaving a task would stop the loop every async
        tool shares. Its timeout is the wait's, which cancels the task."""
        try:  # awaited in this task itself: asyncio re-raises these two out of the loop from any other
            value = await function(**arguments)
        except asyncio.CancelledError:  # the wait's timeout cancels the task: nobody reads it
            raise
        except BaseException as error:  # KeyboardInterrupt and SystemExit of the tool's own too
            return _raised(name, start, error)
        return _settled(name, start, value)

    def _warn_if_hung(self, name: str) -> None:
        hung = self.hung
        if hung and hung >= 2 * self._warned:
            self._warned = hung
            warnings.warn(
                f"tool {name} is still running {self.timeout:g} s after it was called; a plain function "
                f"cannot be stopped, so its thread runs on ({hung} such now; past {MAX_RUNNING} running "
                "calls, new calls fail)"
            )

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
        if self.loop is None or self.loop.is_closed() or not self._loop_thread.is_alive():
            self.loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self.loop.run_forever, name="fastppo-async-tools", daemon=True)
            self._loop_thread.start()
        return self.loop

    def close(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop = None
