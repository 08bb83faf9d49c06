"""Episodes as the sampler drives them, turn by turn: a turn is read without its stop token, an
episode calls tools in at most ``max_tool_calls`` turns, every result of a turn is rendered, a
truncated episode keeps no result the model never read, and each call counts by its outcome."""

import json
import time

import pytest

from fastppo.agents import Agent
from tests.agents.runs import char_tokenizer, letters


def fails(text: str) -> str:
    """Fail.

    Args:
        text: anything
    """
    raise ValueError("no such thing")


def sleeps(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def episodes_of(max_tool_calls: int = 8, timeout: float = 30.0):
    tokenizer = char_tokenizer()
    agent = Agent(tools=[letters, fails, sleeps], max_tool_calls=max_tool_calls, timeout=timeout)
    return tokenizer, agent.use(tokenizer, None, tokenizer.eos_token_id).episodes([None])


def turn(tokenizer, text: str, *calls) -> list:
    """The ids of an assistant turn: ``text``, a Hermes call per ``(name, arguments)``, the stop token."""
    body = text + "".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls)
    return tokenizer(body, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


def test_a_turn_is_read_without_its_stop_token():
    tokenizer, episodes = episodes_of()
    assert not episodes.turn_ended(0, turn(tokenizer, "hi there"), True)
    assert episodes.rows[0].messages == [{"role": "assistant", "content": "hi there"}]


def test_an_episode_calls_tools_in_at_most_max_tool_calls_turns():
    tokenizer, episodes = episodes_of(max_tool_calls=1)
    call = ("letters", {"text": "abc"})
    assert episodes.turn_ended(0, turn(tokenizer, "", call), True)
    episodes.continuation(0, 1000)
    assert not episodes.turn_ended(0, turn(tokenizer, "again", call), True)  # its one calling turn is spent
    episode = episodes.rows[0]
    assert (episode.calling_turns, episode.calls, episode.turns) == (1, 1, 2)
    assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant"]


def test_every_result_of_a_turn_is_rendered_in_order():
    tokenizer, episodes = episodes_of()
    calls = ("letters", {"text": "abcdefghijkl"}), ("letters", {"text": "abcdefg"})
    assert episodes.turn_ended(0, turn(tokenizer, "", *calls), True)
    text = tokenizer.decode(episodes.continuation(0, 1000))
    assert text == "\nt:12<eos>\nt:7<eos>\na:"  # the template's text after the turn's stop, both results
    assert [m["content"] for m in episodes.rows[0].messages[1:]] == ["12", "7"]


def test_a_truncated_episode_keeps_no_result_the_model_never_read():
    tokenizer, episodes = episodes_of()
    calls = ("letters", {"text": "ab"}), ("letters", {"text": "abc"})
    assert episodes.turn_ended(0, turn(tokenizer, "calling", *calls), True)
    episodes.continuation(0, 1000)
    episodes.truncated(0)  # the results did not fit the context
    episode = episodes.rows[0]
    assert episode.truncated and [m["role"] for m in episode.messages] == ["assistant"]
    assert episode.calls == 2  # the calls were made all the same


def test_each_call_counts_by_its_outcome():
    tokenizer, episodes = episodes_of(timeout=0.2)
    calls = (("letters", {"text": "ok"}), ("fails", {"text": "x"}), ("no_such_tool", {}), ("sleeps", {"seconds": 2.0}))
    assert episodes.turn_ended(0, turn(tokenizer, "", *calls), True)
    with pytest.warns(UserWarning, match="tool sleeps is still running"):  # its thread cannot be stopped
        episodes.continuation(0, 1000)
    episode = episodes.rows[0]
    assert (episode.calls, episode.failures, episode.timeouts) == (4, 2, 1)
    metrics = episodes.metrics()
    assert (metrics["tools/failures"], metrics["tools/timeouts"]) == (2.0, 1.0)


def huge(size: int) -> str:
    """A result of ``size`` characters.

    Args:
        size: how many
    """
    return "A" * size


class Recorded:
    """A tokenizer that records the length of every text it is asked to tokenise."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, **options):
        self.lengths.append(len(text))
        return self.tokenizer(text, **options)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("size", [10_000_000, 100_000_000], ids=["10 MB", "100 MB"])
def test_a_huge_result_is_cut_to_the_rows_room_before_it_is_tokenised(size):
    tokenizer = char_tokenizer()
    episodes = Agent(tools=[huge]).use(tokenizer, None, tokenizer.eos_token_id).episodes([None])
    recorded = episodes.template.tokenizer = Recorded(tokenizer)
    room = 300
    assert episodes.turn_ended(0, turn(tokenizer, "", ("huge", {"size": size})), True)
    tokens = episodes.continuation(0, room)
    assert len(tokens) >= room  # the row is truncated, as with the whole result
    bound = room * episodes.template.longest_token + 1
    assert max(recorded.lengths) < bound + 100  # the cut result and the template's few characters
    assert len(episodes.rows[0].messages[-1]["content"]) == bound


def test_a_result_that_fits_the_room_is_whole():
    tokenizer, episodes = episodes_of()
    assert episodes.turn_ended(0, turn(tokenizer, "", ("letters", {"text": "a" * 40})), True)
    assert tokenizer.decode(episodes.continuation(0, 12)) == "\nt:40<eos>\na:"
