"""Episodes: the sampler's :class:`~fastppo.rollout.turns.Turns` for tool-calling rows.

Each row keeps its conversation after the prompt as messages (what chat rewards read, as TRL's
do): an assistant message per turn, with the ``tool_calls`` parsed from it, and a ``tool``
message per call. When a turn calls tools and the episode may go on (the sampler says so; at
most ``max_tool_calls`` calling turns per episode), the calls start on the runner and the row
pauses; its continuation is the results rendered by the template. Counts per episode feed the
``tools/*`` metrics.
"""

from dataclasses import dataclass, field
from typing import Optional

from ..rollout.turns import Turns
from . import parsing


@dataclass
class Episode:
    tools: dict  # name -> Tool, this row's (an environment's methods bound to its instance)
    environment: Optional[object] = None
    messages: list = field(default_factory=list)  # after the prompt: assistant and tool messages
    calling_turns: int = 0
    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    seconds: float = 0.0
    hung: int = 0  # the run's tool calls still running past their timeout, after this episode's last
    truncated: bool = False
    started: Optional[list] = None  # the calls under way
    called: str = ""  # the first tool the last turn called (some templates head results with it)

    @property
    def turns(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)


class Episodes(Turns):
    def __init__(self, tokenizer, template, runner, max_tool_calls: int, stop_ids: tuple, rows: list):
        self.tokenizer, self.template, self.runner = tokenizer, template, runner
        self.max_tool_calls, self.stop_ids, self.rows = max_tool_calls, set(stop_ids), rows

    def turn_ended(self, row: int, turn: list, may_continue: bool) -> bool:
        episode = self.rows[row]
        ids = turn[:-1] if turn and turn[-1] in self.stop_ids else turn
        content, calls = parsing.parse_turn(self.tokenizer.decode(ids, skip_special_tokens=False), self.tokenizer)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments or {}}} for c in calls
            ]
        episode.messages.append(message)
        if not (calls and may_continue and episode.calling_turns < self.max_tool_calls):
            return False
        episode.calling_turns += 1
        episode.called = calls[0].name
        episode.started = self.runner.submit(calls, episode.tools)
        return True

    def continuation(self, row: int, room: int) -> list:
        episode = self.rows[row]
        results, episode.started = self.runner.results(episode.started), None
        for result in results:
            text = self.template.escaped(self.template.cut(result.text, room))
            episode.messages.append({"role": "tool", "name": result.name, "content": text})
            episode.calls += 1
            episode.failures += result.status == "failed"
            episode.timeouts += result.status == "timeout"
            episode.seconds += result.seconds
        episode.hung = self.runner.hung
        return self.template.continuation(episode.messages[-len(results) :], episode.called)

    def ready(self, row: int) -> bool:
        started = self.rows[row].started
        return started is None or self.runner.ready(started)

    def truncated(self, row: int) -> None:
        episode = self.rows[row]
        while episode.messages and episode.messages[-1]["role"] == "tool":
            episode.messages.pop()  # the model never read them
        episode.truncated = True

    def metrics(self) -> dict:
        return episode_metrics(self.rows)


def episode_metrics(episodes: list) -> dict:
    """The ``tools/*`` metrics of ``episodes``: per episode, the calls, failed calls, timed-out
    calls, seconds in tools and turns; the shares of episodes that called a tool and that were
    truncated by a result; and the most tool calls still running past their timeout (``hung``:
    threads a plain function holds, which cannot be stopped)."""
    n = max(len(episodes), 1)
    return {
        "tools/calls": sum(e.calls for e in episodes) / n,
        "tools/failures": sum(e.failures for e in episodes) / n,
        "tools/timeouts": sum(e.timeouts for e in episodes) / n,
        "tools/seconds": sum(e.seconds for e in episodes) / n,
        "tools/turns": sum(e.turns for e in episodes) / n,
        "tools/calling": sum(e.calls > 0 for e in episodes) / n,
        "tools/truncated": sum(e.truncated for e in episodes) / n,
        "tools/hung": float(max((e.hung for e in episodes), default=0)),
    }
