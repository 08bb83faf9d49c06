"""Fixtures of the agents' tests: a random tiny model never writes a tool call, so these read each of
its turns as one."""

import pytest

from fastppo.agents import parsing
from fastppo.agents.calls import Call


@pytest.fixture
def every_turn_calls(monkeypatch):
    """Every turn calls ``letters`` on its own text."""
    monkeypatch.setattr(parsing, "parse_turn", lambda text, tokenizer=None: (text, [Call("letters", {"text": text})]))


@pytest.fixture
def steps(monkeypatch):
    """Every turn calls the environment's ``step``."""
    monkeypatch.setattr(parsing, "parse_turn", lambda text, tokenizer=None: (text, [Call("step", {"word": "go"})]))
