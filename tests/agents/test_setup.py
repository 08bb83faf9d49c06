"""What a user names for tools is checked at start-up, each problem one line naming it: a tool that
is not importable or has no schema, an environment without ``reset``, two tools of one name, a
chat template that cannot show tool calls, ``--stop`` with tools."""

import sys

import pytest

from fastppo.agents import Agent
from fastppo.agents.tools import as_text
from fastppo.errors import UsageError
from tests.agents.runs import NO_CALLS, TEMPLATE, Counter, char_tokenizer
from tests.trainer.test_hostile_input import TINY, one_line_error

MODULE = '''
def no_doc(x: int) -> int:
    return x

def no_hints(x):
    """Echo.

    Args:
        x: a thing
    """
    return x

def letters(text: str) -> int:
    """Count letters.

    Args:
        text: a text
    """
    return len(text)

class NoReset:
    def act(self, x: str) -> str:
        """Act.

        Args:
            x: a thing
        """
        return x

class Clash:
    def reset(self, **fields):
        pass

    def letters(self, text: str) -> int:
        """Count letters.

        Args:
            text: a text
        """
        return 0
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_tools.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_tools", raising=False)


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"tools": ["nosuch_module:f"]}, "--tools nosuch_module:f: cannot import nosuch_module"),
        ({"tools": ["user_tools:missing"]}, "--tools user_tools:missing: user_tools has no missing"),
        ({"tools": ["user_tools:no_doc"]}, "--tools user_tools:no_doc: Cannot generate JSON schema for no_doc"),
        ({"tools": ["user_tools:no_hints"]}, "--tools user_tools:no_hints: "),
        ({"tools": ["plain"]}, "give 'module:function' or a built-in (python, calculator)"),
        (
            {"environment": "user_tools:NoReset"},
            "--environment user_tools:NoReset: the class NoReset has no reset method",
        ),
        ({"tools": ["user_tools:letters"], "environment": "user_tools:Clash"}, "two tools are named 'letters'"),
    ],
)
def test_bad_tools_are_named_before_any_model_loads(user_module, fields, says):
    with pytest.raises(UsageError, match=None) as error:
        Agent(tools=fields.get("tools", ()), environment=fields.get("environment"))
    assert says in str(error.value) and "\n" not in str(error.value)


def test_a_template_that_cannot_show_tool_calls_is_refused_naming_the_option():
    tokenizer = char_tokenizer()
    agent = Agent(tools=["calculator"])
    with pytest.raises(UsageError, match="does not show a call's name.*--chat-template FILE"):
        agent.use(tokenizer, NO_CALLS, tokenizer.eos_token_id)
    tokenizer.chat_template = None
    with pytest.raises(UsageError, match="is missing.*--chat-template"):
        agent.use(tokenizer, None, tokenizer.eos_token_id)
    assert agent.use(tokenizer, TEMPLATE, tokenizer.eos_token_id).template is not None


def test_an_environments_methods_are_its_tools_and_its_reward_one_more():
    agent = Agent(environment=Counter)
    assert [s["function"]["name"] for s in agent.schemas] == ["step"]
    assert agent.environment_rewards and [name for name, _ in agent.environment.named_rewards()] == ["Counter"]


def test_what_a_tool_returns_reaches_the_model_as_text():
    assert as_text("x") == "x" and as_text(3) == "3" and as_text(None) == "None"
    assert as_text({"a": [1, "é"]}) == '{"a": [1, "é"]}' and as_text({1: object()}).startswith("{1: <object")


def test_the_command_line_says_it_in_one_line(user_module, capsys):
    line = one_line_error(capsys, ["--tools", "user_tools:no_doc", *TINY])
    assert "--tools user_tools:no_doc" in line
    line = one_line_error(capsys, ["--tools", "calculator", "--stop", "END", *TINY])
    assert "config field stop cannot be given with tools" in line
    line = one_line_error(capsys, ["--tools", "calculator", "--max-tool-calls", "0", *TINY])
    assert "max_tool_calls must be >= 1" in line


def test_the_memory_plan_counts_the_tool_results_room():
    from transformers import LlamaConfig

    from fastppo.trainer import TrainConfig
    from fastppo.trainer.memory.plan import memory_plan

    model = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)

    def kv_positions(**fields):
        config = TrainConfig.from_flat({"max_new_tokens": 32, **fields}).validate()
        line = next(
            line for line in memory_plan(config, model, prompt_tokens=100, device_type="cpu") if line.name == "KV cache"
        )
        return line.how

    assert "at the cap (132)" in kv_positions()
    assert "at the cap (632)" in kv_positions(tools=["calculator"], max_tool_tokens=500)
