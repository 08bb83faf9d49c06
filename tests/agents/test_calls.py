"""Tool calls run off the decode loop: concurrently, each bounded by the timeout, and whatever goes
wrong (unknown tool, bad arguments, an exception, a timeout, a tool that never returns) is a
result the model reads, never a hang or a crash."""

import asyncio
import threading
import time

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
    start = time.monotonic()
    results = run([Call("never", {"x": "a"}), Call("forever", {"x": "b"}), Call("add", {"a": 1, "b": 1})], timeout=0.3)
    assert time.monotonic() - start < 5  # bounded by the timeout, not by the tools
    assert [r.status for r in results] == ["timeout", "timeout", "ok"]
    assert "took longer than 0.3 s" in results[0].text


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
