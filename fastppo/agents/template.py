"""The chat template's side of an episode: the tools in the prompt, and the tokens after a turn.

After an assistant turn that called tools, the model must read the results as its chat template
renders them, and then the header of its next turn. Those tokens are the difference between two
renderings of one conversation (the form TRL's trainer uses too): with the assistant turn alone,
and with the tool messages and the generation prompt after it. The turn the model wrote ends at
its stop token; whatever the template puts after that token (ChatML's newline) comes first. The
text after a special token tokenises the same whatever preceded it, so the continuation is
tokenised alone and prefilled onto the row's cache.

A template that cannot show a tool call and its result (most base templates drop one or the
other) is refused at start-up with a one-line error naming ``--chat-template``.

A tool's result is text the tokenizer reads like any other, so a result holding a token's text
(``<|im_end|>``, ``<tool_call>``) becomes that token: a result can write a forged turn into the
model's context (never a turn the episode parses, and masked from the loss like every tool token).
With ``escape_tokens`` each added token's text in a result gets a zero-width space after its first
character (:meth:`ToolTemplate.escaped`), so it tokenises as plain text.
"""

import re
from pathlib import Path

from ..errors import UsageError

SHIPPED_TEMPLATE = Path(__file__).with_name("chatml_tools.jinja")  # ChatML with tools, for ChatML models
SHIPPED = "fastppo/agents/chatml_tools.jinja"  # as recipes and errors name it, from the repository
_NAME, _KEY, _VALUE, _RESULT = "tool_name_7f3a", "argument_9c1e", "value_4b2d", "result_5e8f"
ZERO_WIDTH_SPACE = "\u200b"


class ToolTemplate:
    """Renders with ``chat_template`` (None: the tokenizer's) and the tools' ``schemas``; with
    ``escape_tokens``, results never hold a token's text (:meth:`escaped`)."""

    def __init__(self, tokenizer, chat_template, schemas: list, stop_id: int, escape_tokens: bool = False):
        self.tokenizer, self.chat_template, self.schemas = tokenizer, chat_template, schemas
        self.stop_text = tokenizer.decode([stop_id])
        self._tokens = _added_tokens(tokenizer) if escape_tokens else None
        self.longest_token = max(map(len, tokenizer.get_vocab()), default=1)  # characters of text one token covers
        self._check()

    def cut(self, result: str, room: int) -> str:
        """``result`` cut where it would take ``room`` tokens or more whatever follows: no token
        covers more than ``longest_token`` characters, so a result of ``room x longest_token``
        characters tokenises to ``room`` tokens at least and its row is truncated either way. Never
        tokenising the rest keeps a result of megabytes from holding the rollout (tokenising is
        superlinear in a text's length, in C, where no signal is seen)."""
        return result[: max(room, 0) * self.longest_token + 1]

    def escaped(self, result: str) -> str:
        """``result`` as the model reads it: with ``escape_tokens``, each added token's text in it
        broken by a zero-width space after its first character; else unchanged."""
        if self._tokens is None:
            return result
        return self._tokens.sub(lambda m: m.group(0)[0] + ZERO_WIDTH_SPACE + m.group(0)[1:], result)

    def render(self, messages: list, generation_prompt: bool, schemas=None) -> str:
        """``messages`` rendered, listing the tools ``schemas`` (None: every tool of the run)."""
        return self.tokenizer.apply_chat_template(
            messages,
            tools=(self.schemas if schemas is None else schemas) or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            chat_template=self.chat_template,
        )

    def _refuse(self, why: str):
        return UsageError(
            f"the chat template {why}, so the model could not read its tool calls' results; give one "
            f"that can with --chat-template FILE ({SHIPPED} for ChatML models)"
        )

    def _check(self) -> None:
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise self._refuse("is missing (the tokenizer has none)")
        call = {"type": "function", "function": {"name": _NAME, "arguments": {_KEY: _VALUE}}}
        turn = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            text = self.render(turn + [{"role": "tool", "name": _NAME, "content": _RESULT}], True)
        except Exception as error:  # the template's own errors
            raise self._refuse(f"fails on a tool call ({type(error).__name__}: {error})") from None
        for part, what in ((_NAME, "a call's name"), (_KEY, "its arguments"), (_RESULT, "a tool's result")):
            if part not in text:
                raise self._refuse(f"does not show {what}")
        self.continuation([{"role": "tool", "name": _NAME, "content": _RESULT}], _NAME)

    def continuation(self, tool_messages: list, called: str) -> list:
        """The token ids that follow an assistant turn which called ``called`` (and perhaps more):
        the template's text after the turn's stop token, the ``tool_messages``, and the next
        assistant turn's header."""
        call = {"type": "function", "function": {"name": called, "arguments": {}}}
        turn = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        before, after = self.render(turn, False), self.render(turn + tool_messages, True)
        end = before.rfind(self.stop_text)
        if not after.startswith(before) or end < 0:
            raise self._refuse(
                "renders an assistant turn differently once tool results follow it"
                if end >= 0
                else f"does not end an assistant turn with the stop token {self.stop_text!r}"
            )
        text = before[end + len(self.stop_text) :] + after[len(before) :]
        return self.tokenizer(text, add_special_tokens=False).input_ids


def _added_tokens(tokenizer):
    """A pattern matching the text of any token of two characters or more that the tokenizer adds
    whole (special or not), longest first (one that matches nothing when it has none)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = sorted({t for t in map(str, (getattr(t, "content", t) for t in decoder.values())) if len(t) > 1})
    texts.sort(key=len, reverse=True)  # one character cannot be broken, nor need be
    return re.compile("|".join(map(re.escape, texts))) if texts else re.compile(r"(?!)")
