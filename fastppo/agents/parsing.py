"""Tool calls read from the text of an assistant turn.

A tokenizer that declares how its responses parse (transformers' ``response_template`` or
``response_schema``) is asked first (``tokenizer.parse_response``). Otherwise two forms are read:

* Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them;
* Llama 3: the whole turn is one JSON object ``{"name": ..., "parameters": {...}}`` (after an
  optional ``<|python_tag|>``).

A call that cannot be read (bad JSON, JSON nested past what the decoder recurses into, no name, an
unclosed tag) is still a :class:`Call`, with its ``error``: the model is told what was wrong with
it, as with any failed call. The text is the model's: nothing in it may raise out of here.
"""

import json
import re

from .calls import Call

HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
UNREADABLE = (ValueError, RecursionError)  # json's errors on bad text (JSONDecodeError is a ValueError)


def _call(body, form: str) -> Call:
    """A call from the decoded JSON ``body`` of one ``form``."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return Call("unknown", error=f"a {form} tool call must be a JSON object with a string 'name'")
    arguments = body.get("arguments", body.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except UNREADABLE:
            return Call(body["name"], error=f"the arguments of {body['name']} are not valid JSON")
    return Call(body["name"], arguments)


def _hermes(text: str) -> tuple:
    calls = []
    for match in HERMES.finditer(text):
        if not match.group(0).endswith("</tool_call>"):
            calls.append(Call("unknown", error="a <tool_call> was not closed with </tool_call>"))
            continue
        try:
            calls.append(_call(json.loads(match.group(1).strip()), "<tool_call>"))
        except json.JSONDecodeError as error:
            calls.append(Call("unknown", error=f"the <tool_call> is not valid JSON ({error.msg})"))
        except UNREADABLE:
            calls.append(Call("unknown", error="the <tool_call> is not JSON this parser can read (nested too deeply)"))
    return HERMES.sub("", text).strip(), calls


def _llama3(text: str):
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not (body.startswith("{") and body.endswith("}")):
        return None
    try:
        decoded = json.loads(body)
    except UNREADABLE:
        return None
    if not (isinstance(decoded, dict) and "name" in decoded and ("parameters" in decoded or "arguments" in decoded)):
        return None
    return "", [_call(decoded, "JSON")]


def _declared(text: str, tokenizer):
    """The tokenizer's own parse, or None when it has none (or it fails on this text)."""
    if not (getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)):
        return None
    try:
        try:  # transformers >= 5.2x wants the prompt's tail; the turn's text is all the model wrote
            parsed = tokenizer.parse_response(text, prefix="")
        except TypeError:  # an older parse_response, without ``prefix``
            parsed = tokenizer.parse_response(text)
    except Exception:  # a parser that cannot read the text: the forms below may
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("tool_calls") or [], list):
        return None
    calls = []
    for entry in parsed.get("tool_calls") or []:
        function = entry.get("function", entry) if isinstance(entry, dict) else None
        calls.append(_call(function, "declared"))
    content = parsed.get("content")
    return content if isinstance(content, str) else "", calls


def parse_turn(text: str, tokenizer=None) -> tuple:
    """``(content, calls)`` of an assistant turn's text: the text without its calls, and each
    :class:`Call` in order (none for a final answer)."""
    declared = _declared(text, tokenizer) if tokenizer is not None else None
    if declared is not None and declared[1]:
        return declared
    if "<tool_call>" in text:
        return _hermes(text)
    return _llama3(text) or (text.strip(), [])
