"""Tool calls run off the decode loop: concurrently, each bounded by the timeout, and whatever goes
wrong (unknown tool, bad arguments, an exception, a timeout, a tool that never returns) is a
result the model reads, never a hang or a crash."""

import asyncio
import signal
import threading
import time

import pytest

from fastppo.agents.calls import Call, ToolRunner
from fastppo.agents.tools import tool


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: one number
        b: another
    """
    return a + b


def table(n: int) -> dict:
    """A table.

    Args:
        n: its size
    """
    return {"n": n, "squares": [i * i for i in range(n)]}


def fails(x: str) -> str:
    """Fail.

    Args:
        x: anything
    """
    raise RuntimeError(f"bad {x}")


def never(x: str) -> str:
    """Never return.

    Args:
        x: anything
    """
    threading.Event().wait()


async def later(x: str) -> str:
    """Answer after a while.

    Args:
        x: anything
    """
    await asyncio.sleep(0.01)
    return x.upper()


async def forever(x: str) -> str:
    """Never answer.

    Args:
        x: anything
    """
    await asyncio.Event().wait()


TOOLS = {t.name: t for t in map(tool, (add, table, fails, never, later, forever))}


def run(calls, timeout=2.0):
    runner = ToolRunner(timeout)
    try:
        return runner.results(runner.submit(calls, TOOLS))
    finally:
        runner.close()


def test_results_and_their_conversion_to_text():
    results = run([Call("add", {"a": 2, "b": 3}), Call("table", {"n": 3}), Call("later", {"x": "hi"})])
    assert [(r.text, r.status) for r in results] == [
        ("5", "ok"),
        ('{"n": 3, "squares": [0, 1, 4]}', "ok"),
        ("HI", "ok"),
    ]


def test_every_failure_is_a_result_saying_what_went_wrong():
    results = run(
        [
            Call("nope", {}),
            Call("add", {"a": 1}),
            Call("add", {"a": 1, "b": 2, "c": 3}),
            Call("add", ["not", "an", "object"]),
            Call("fails", {"x": "input"}),
            Call("unknown", error="the <tool_call> is not valid JSON"),
        ]
    )
    assert all(r.status == "failed" and r.text.startswith("error: ") for r in results)
    texts = [r.text for r in results]
    assert "there is no tool 'nope'" in texts[0] and "add, fails, forever" in texts[0]
    assert "missing a required argument: 'b'" in texts[1]
    assert "unexpected keyword argument 'c'" in texts[2]
    assert "must be a JSON object" in texts[3]
    assert texts[4] == "error: fails raised RuntimeError: bad input"
    assert "not valid JSON" in texts[5]


def test_a_tool_that_never_returns_times_out_and_the_others_still_answer():
    runner = ToolRunner(0.3)
    try:
        calls = [Call("never", {"x": "a"}), Call("forever", {"x": "b"}), Call("add", {"a": 1, "b": 1})]
        results = runner.results(runner.submit(calls, TOOLS))
        assert runner.hung == 1  # the results came back while the plain tool that never returns still runs
    finally:
        runner.close()
    assert [r.status for r in results] == ["timeout", "timeout", "ok"]
    assert "took longer than 0.3 s" in results[0].text


@pytest.mark.parametrize("slow", ["never", "forever"])
def test_calls_are_ready_when_all_have_answered_or_passed_their_timeout(slow):
    runner = ToolRunner(0.3)
    try:
        answered = runner.submit([Call("later", {"x": "a"}), Call("add", {"a": 1, "b": 1}), Call("nope", {})], TOOLS)
        deadline = time.monotonic() + 5
        while not runner.ready(answered):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert all(p.done is not None or p.future.done() for p in answered)  # ready: nothing left to wait for
        assert [r.status for r in runner.results(answered)] == ["ok", "ok", "failed"]
        hanging = runner.submit([Call(slow, {"x": "a"})], TOOLS)
        assert not runner.ready(hanging)
        time.sleep(0.35)
        assert runner.ready(hanging)  # past its timeout: its result is the timeout's, at once
        assert [r.status for r in runner.results(hanging)] == ["timeout"]
    finally:
        runner.close()


def test_calls_run_at_once():
    """Two calls that each wait for the other to start can both finish only if they run together."""
    meet = threading.Barrier(2, timeout=5)

    def rendezvous(x: str) -> str:
        """Meet.

        Args:
            x: a name
        """
        meet.wait()
        return x

    tools = {"rendezvous": tool(rendezvous)}
    runner = ToolRunner(10.0)
    results = runner.results(runner.submit([Call("rendezvous", {"x": "a"}), Call("rendezvous", {"x": "b"})], tools))
    assert [r.text for r in results] == ["a", "b"]


class Stop(BaseException):
    """What a stop signal's handler raises in the main thread (Ctrl-C's KeyboardInterrupt)."""


def test_a_stop_signal_during_the_wait_for_a_tool_stops_the_caller(monkeypatch):
    """The stop must leave ``results``: caught as the tool's result, the iteration would finish and
    be saved as if nothing happened."""

    def handler(signum, frame):
        raise Stop

    previous = signal.signal(signal.SIGUSR1, handler)
    main = threading.main_thread().ident

    def signals_the_caller(x: str) -> str:
        """Signal the main thread, then answer.

        Args:
            x: anything
        """
        signal.pthread_kill(main, signal.SIGUSR1)
        time.sleep(0.2)
        return x

    runner = ToolRunner(5.0)
    try:
        with pytest.raises(Stop):
            runner.results(runner.submit([Call("signals", {"x": "a"})], {"signals": tool(signals_the_caller)}))
    finally:
        signal.signal(signal.SIGUSR1, previous)
        runner.close()


async def interrupts(x: str) -> str:
    """Raise what a Ctrl-C raises.

    Args:
        x: anything
    """
    raise KeyboardInterrupt(x)


async def exits(x: str) -> str:
    """Raise what sys.exit raises.

    Args:
        x: anything
    """
    raise SystemExit(x)


def test_an_async_tool_raising_keyboard_interrupt_or_system_exit_fails_and_the_loop_lives_on():
    tools = {**TOOLS, **{t.name: t for t in map(tool, (interrupts, exits))}}
    runner = ToolRunner(2.0)
    try:
        first = runner.results(runner.submit([Call("interrupts", {"x": "a"}), Call("exits", {"x": "b"})], tools))
        assert [(r.status, r.text) for r in first] == [
            ("failed", "error: interrupts raised KeyboardInterrupt: a"),
            ("failed", "error: exits raised SystemExit: b"),
        ]
        later_calls = runner.results(runner.submit([Call("later", {"x": "c"}), Call("later", {"x": "d"})], tools))
        assert [(r.status, r.text) for r in later_calls] == [("ok", "C"), ("ok", "D")]
    finally:
        runner.close()


class Unprintable:
    def __str__(self):
        raise ValueError("no text")


def huge(x: str) -> int:
    """A number past Python's 4,300 digits of str().

    Args:
        x: anything
    """
    return 10**5000


def unprintable(x: str) -> object:
    """An object whose str() raises.

    Args:
        x: anything
    """
    return Unprintable()


def surrogate(x: str) -> str:
    """Text with a lone surrogate, which no encoding takes.

    Args:
        x: anything
    """
    return "x\udcff"


async def async_huge(x: str) -> int:
    """The huge number, from the event loop.

    Args:
        x: anything
    """
    return 10**5000


def test_results_that_cannot_be_text_fail_and_lone_surrogates_are_replaced():
    tools = {t.name: t for t in map(tool, (huge, unprintable, surrogate, async_huge))}
    runner = ToolRunner(2.0)
    try:
        names = ("huge", "unprintable", "surrogate", "async_huge")
        results = runner.results(runner.submit([Call(n, {"x": "a"}) for n in names], tools))
    finally:
        runner.close()
    assert [r.status for r in results] == ["failed", "failed", "ok", "failed"]
    assert results[0].text.startswith("error: huge returned a value that cannot be shown as text: ValueError")
    assert results[1].text == "error: unprintable returned a value that cannot be shown as text: ValueError: no text"
    assert results[2].text == "x\ufffd"
    results[2].text.encode("utf-8")  # valid text: the tokenizer takes it
    assert "cannot be shown as text" in results[3].text


def test_hung_calls_are_bounded_counted_and_warned_of(monkeypatch):
    from fastppo.agents import calls

    monkeypatch.setattr(calls, "MAX_RUNNING", 2)
    release = threading.Event()

    def stuck(x: str) -> str:
        """Wait to be released.

        Args:
            x: anything
        """
        release.wait(30)
        return x

    tools = {"stuck": tool(stuck)}
    runner = ToolRunner(0.2)
    try:
        with pytest.warns(UserWarning, match=r"still running 0.2 s after it was called.*\(1 such now"):
            first = runner.results(runner.submit([Call("stuck", {"x": "a"})], tools))
        with pytest.warns(UserWarning, match=r"\(2 such now"):
            second = runner.results(runner.submit([Call("stuck", {"x": "b"}), Call("stuck", {"x": "c"})], tools))
        assert [r.status for r in first + second] == ["timeout", "timeout", "failed"]
        assert second[1].text == "error: stuck was not started: 2 tool calls are still running (1 past their timeout)"
        assert runner.hung == 2
        release.set()
        deadline = time.monotonic() + 10
        while runner.hung and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.hung == 0  # their threads ended: room again
        assert [r.status for r in runner.results(runner.submit([Call("stuck", {"x": "d"})], tools))] == ["ok"]
    finally:
        release.set()
        runner.close()


@pytest.mark.parametrize("timeout", [0, -1, 86400.5, 1e10, float("inf"), float("nan"), True, "30"])
def test_a_timeout_outside_its_bound_is_refused(timeout):
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds in \(0, 86400\]"):
        ToolRunner(timeout)
