"""``Agent``: a run's tools, environment, chat template and limits, and the episodes of a batch.

Made in two steps, so that every problem with what the user named is a one-line error before any
model loads: the tools and the environment when it is made (a tool that is not importable or has
no schema, an environment without ``reset``, two tools of one name), the chat template when the
tokenizer is there (:meth:`Agent.use`: a template that cannot show tool calls). For each batch
:meth:`Agent.reset` opens the rows' environments and :meth:`Agent.episodes` gives the sampler
their turns.
"""

from ..trainer.errors import UsageError
from .calls import ToolRunner
from .environment import Environments, load_environment
from .episodes import Episode, Episodes
from .template import ToolTemplate
from .tools import Tool, check_names, load_tool, tool


class Agent:
    def __init__(self, *, tools=(), environment=None, max_tool_calls: int = 8, timeout: float = 30.0):
        """``tools``: specs (``module:function`` or a built-in's name), callables or :class:`Tool`;
        ``environment``: a spec ``module:Class`` or a class; ``max_tool_calls``: the most turns
        with calls in an episode; ``timeout``: the seconds one call may take."""
        self.max_tool_calls = max_tool_calls
        self.tools = [
            load_tool(t, timeout) if isinstance(t, str) else t if isinstance(t, Tool) else tool(t) for t in tools
        ]
        if isinstance(environment, str):
            environment = load_environment(environment)
        elif environment is not None:
            environment = Environments(environment, f"environment {getattr(environment, '__name__', environment)}")
        self.environment = environment
        env_schemas = environment.schemas if environment is not None else []
        self.schemas = [t.schema for t in self.tools] + env_schemas
        check_names([s["function"]["name"] for s in self.schemas])
        if not self.schemas:
            raise UsageError("tools are on but there are none: give --tools, or an --environment with public methods")
        self.runner = ToolRunner(timeout)
        self.tokenizer = self.template = self.stop_id = None

    @property
    def environment_rewards(self) -> bool:
        """Whether the environment gives a reward (``get_reward``)."""
        return self.environment is not None and self.environment.rewards

    def use(self, tokenizer, chat_template, stop_id: int) -> "Agent":
        """Render with ``tokenizer`` and ``chat_template`` (its text; None: the tokenizer's), turns
        ending at ``stop_id``; refuses a template that cannot show tool calls."""
        self.tokenizer, self.stop_id = tokenizer, stop_id
        self.template = ToolTemplate(tokenizer, chat_template, self.schemas, stop_id)
        return self

    def reset(self, fields: list) -> tuple:
        """``(instances, observations)`` of a batch of rows with ``fields`` (dicts): each row's
        environment reset, and what its reset returned (None each without an environment)."""
        if self.environment is None:
            return [None] * len(fields), [None] * len(fields)
        return self.environment.reset(fields)

    def episodes(self, instances: list) -> Episodes:
        """The episodes of a batch of rows whose environments are ``instances`` (None each, without
        an environment)."""
        rows = []
        for instance in instances:
            own = self.environment.tools(instance) if instance is not None else []
            rows.append(Episode({t.name: t for t in self.tools + own}, instance))
        return Episodes(self.tokenizer, self.template, self.runner, self.max_tool_calls, (self.stop_id,), rows)


def configured(tools) -> Agent:
    """The :class:`Agent` of a run's tools section (``ToolsConfig``)."""
    return Agent(
        tools=tools.tools or (),
        environment=tools.environment,
        max_tool_calls=tools.max_tool_calls,
        timeout=tools.tool_timeout,
    )
