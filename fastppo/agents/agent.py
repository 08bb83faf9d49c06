"""``Agent``: a run's tools, environment, chat template and limits, and the episodes of a batch.

Made in two steps, so that every problem with what the user named is a one-line error before any
model loads: the tools and the environment when it is made (a tool that is not importable or has
no schema, an environment without ``reset``, two tools of one name), the chat template when the
tokenizer is there (:meth:`Agent.use`: a template that cannot show tool calls). For each batch
:meth:`Agent.reset` opens the rows' environments and :meth:`Agent.episodes` gives the sampler
their turns.
"""

from ..errors import UsageError
from .calls import ToolRunner
from .environment import Environments, load_environment
from .episodes import Episode, Episodes
from .template import ToolTemplate
from .tools import Tool, check_names, load_tool, tool


class Agent:
    def __init__(
        self, *, tools=(), environment=None, max_tool_calls: int = 8, timeout: float = 30.0, escape_tokens=False
    ):
        """``tools``: specs (``module:function`` or a built-in's name), callables or :class:`Tool`;
        ``environment``: a spec ``module:name``, or what it names: a class, a function returning an
        instance, or a dict of them by name (``environment.py``); ``max_tool_calls``: the most turns
        with calls in an episode; ``timeout``: the seconds one call may take; ``escape_tokens``:
        whether a token's text in a result is read as text, not as the token (``template.py``)."""
        self.max_tool_calls, self.escape_tokens = max_tool_calls, escape_tokens
        self.tools = [
            load_tool(t, timeout) if isinstance(t, str) else t if isinstance(t, Tool) else tool(t) for t in tools
        ]
        if isinstance(environment, str):
            environment = load_environment(environment)
        elif environment is not None:
            environment = Environments(environment, f"environment {getattr(environment, '__name__', environment)}")
        self.environment = environment
        own = [t.schema for t in self.tools]
        each = environment.schemas.values() if environment is not None else [[]]
        for schemas in each:  # every row's tools: the run's and its environment's
            check_names([s["function"]["name"] for s in own + schemas])
        #: every tool any row may have (what the template is checked with, and the summary lists)
        self.schemas = own + [s for schemas in each for s in schemas]
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
        self.template = ToolTemplate(tokenizer, chat_template, self.schemas, stop_id, self.escape_tokens)
        return self

    def schemas_of(self, row: dict, origin: str) -> list:
        """The tools of the prompt ``row`` (from ``origin``) as its prompt lists them: the run's,
        and those of the environment it takes."""
        own = [t.schema for t in self.tools]
        return own if self.environment is None else own + self.environment.schemas_of(row, origin)

    def reset(self, rows: list, origins: list, pool: int = 0) -> tuple:
        """``(instances, observations)`` of a batch of ``rows`` (dicts: each prompt row whole, from
        ``origins``): each row's environment reset, from the instances of ``pool`` (one per batch in
        flight at once), and what its reset returned (None each without an environment)."""
        if self.environment is None:
            return [None] * len(rows), [None] * len(rows)
        return self.environment.reset(rows, origins, pool)

    def episodes(self, instances: list) -> Episodes:
        """The episodes of a batch of rows whose environments are ``instances`` (None each, without
        an environment)."""
        rows = []
        for instance in instances:
            own = self.environment.tools(instance) if instance is not None else []
            rows.append(Episode({t.name: t for t in self.tools + own}, instance))
        return Episodes(self.tokenizer, self.template, self.runner, self.max_tool_calls, (self.stop_id,), rows)
