"""Tool calls read from a turn's text: Hermes/Qwen tags, Llama 3's JSON, a tokenizer's own parser,
and malformed calls kept as calls whose error the model is told."""

from fastppo.agents.parsing import parse_turn


def test_hermes_calls_in_order_and_the_text_around_them():
    text = (
        'Let me see. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    )
    content, calls = parse_turn(text)
    assert content == "Let me see."
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2*3"}, None),
        ("python", {"code": "print(1)"}, None),  # arguments written as a JSON string
    ]


def test_llama3_json_calls():
    for text in ('{"name": "f", "parameters": {"a": 1}}', '<|python_tag|>{"name": "f", "arguments": {"a": 1}}'):
        content, calls = parse_turn(text)
        assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", {"a": 1})]


def test_a_final_answer_has_no_call_even_when_it_is_json():
    assert parse_turn("The answer is 6.") == ("The answer is 6.", [])
    assert parse_turn('{"answer": 6}') == ('{"answer": 6}', [])


def test_malformed_calls_are_calls_with_the_reason():
    cases = {
        "<tool_call>{bad}</tool_call>": "not valid JSON",
        '<tool_call>{"name": "x"': "not closed",
        '<tool_call>{"arguments": {}}</tool_call>': "string 'name'",
        '<tool_call>["x"]</tool_call>': "string 'name'",
        '<tool_call>{"name": "x", "arguments": "{nope"}</tool_call>': "arguments of x are not valid JSON",
    }
    for text, reason in cases.items():
        _, calls = parse_turn(text)
        assert len(calls) == 1 and reason in calls[0].error, text


class Declaring:
    """A tokenizer that declares its own response parser (transformers' response_template)."""

    response_template = {"some": "template"}

    def parse_response(self, text):
        if text.startswith("CALL "):
            name, argument = text[5:].split(" ", 1)
            return {
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"x": argument}}}],
            }
        raise ValueError("cannot parse")


def test_a_tokenizers_own_parser_is_asked_first_and_the_known_forms_after():
    _, calls = parse_turn("CALL f 42", Declaring())
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": "42"})]
    _, calls = parse_turn('<tool_call>{"name": "g", "arguments": {}}</tool_call>', Declaring())
    assert [c.name for c in calls] == ["g"]


def test_json_nested_past_the_decoders_depth_is_a_failed_call_not_a_crash():
    deep = "[" * 1000
    for text, failed in (
        (f"<tool_call>{deep}", True),  # Hermes, never closed
        (f"<tool_call>{deep}{']' * 1000}</tool_call>", True),
        (f'<tool_call>{{"name": "f", "arguments": "{deep}"}}</tool_call>', True),  # arguments as a string
        (f'{{"name": "f", "parameters": {deep}{"]" * 1000}}}', False),  # Llama 3: no call, plain text
        (f"<|python_tag|>{deep}", False),
    ):
        content, calls = parse_turn(text)
        if failed:
            assert len(calls) == 1 and calls[0].error, text[:40]
            assert any(why in calls[0].error for why in ("nested too deeply", "not valid JSON", "not closed"))
        else:
            assert calls == [] and content, text[:40]


class Odd(Declaring):
    """A declared parser returning shapes that are not a parsed response."""

    def __init__(self, parsed):
        self.parsed = parsed

    def parse_response(self, text):
        return self.parsed


def test_a_declared_parser_returning_no_response_leaves_the_known_forms_to_read():
    for parsed in (None, "text", ["a"], {"tool_calls": "f"}, {"content": 3, "tool_calls": []}):
        content, calls = parse_turn('<tool_call>{"name": "g", "arguments": {}}</tool_call>', Odd(parsed))
        assert isinstance(content, str) and [c.name for c in calls] in (["g"], []), parsed
