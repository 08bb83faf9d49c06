"""Agents: multi-turn episodes in which the policy calls tools, for the trainer and the sampler.

``Agent`` (``agent.py``) holds a run's tools (``tools.py``, built-ins in ``builtin.py``), its
environment (``environment.py``) and its chat template (``template.py``); its episodes
(``episodes.py``) are the sampler's turns: each turn's calls parsed (``parsing.py``) and run off
the decode loop with a timeout (``calls.py``), their results prefilled onto the row's cache.
"""

from .agent import Agent
from .tools import Tool, tool

__all__ = ["Agent", "Tool", "tool"]
