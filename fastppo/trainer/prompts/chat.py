"""Chat prompts rendered to text: a prompt's messages (a string becomes one user message, with the
``--system-prompt`` before it) through the tokenizer's chat template or ``--chat-template``.
"""

from pathlib import Path

from ...errors import UsageError


def read_chat_template(path):
    """The text of the ``--chat-template`` file ``path`` (None: None)."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--chat-template {path}: {getattr(error, 'strerror', None) or error}") from None


class ChatRenderer:
    """Prompt -> text: strings as they are (or, with ``chat``, as one user message), message lists
    through the chat template with the generation prompt, ``system_prompt`` first, and the tools'
    schemas of the row (the template lists them)."""

    def __init__(self, tokenizer, chat: bool = False, system_prompt: str = None, chat_template: str = None):
        self.tokenizer, self.chat, self.system_prompt = tokenizer, chat, system_prompt
        self.template = read_chat_template(chat_template)

    def __call__(self, prompt, origin: str, schemas=None) -> tuple:
        """``(text, messages)``: the text the sampler sees, and the chat messages it was rendered
        from (None for a string prompt used as it is); ``schemas``: the tools its prompt lists."""
        if isinstance(prompt, str) and not self.chat:
            if not prompt:
                raise UsageError(f"{origin}: the prompt is empty")
            if self.system_prompt is not None:
                raise UsageError(
                    f"{origin}: a string prompt cannot take --system-prompt; add --chat to render it "
                    "as a user message with the chat template"
                )
            return prompt, None
        messages = self.messages(prompt, origin)
        return self.render(messages, origin, schemas), messages

    def render(self, messages: list, origin: str, schemas=None) -> str:
        """Checked ``messages`` through the chat template, with the generation prompt."""
        if self.template is None and not getattr(self.tokenizer, "chat_template", None):
            raise UsageError(
                f"{origin}: a chat prompt, and the tokenizer has no chat template (give one with --chat-template FILE)"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=schemas, tokenize=False, add_generation_prompt=True, chat_template=self.template
            )
        except Exception as error:  # a Jinja template's own errors
            raise UsageError(f"{origin}: the chat template failed ({type(error).__name__}: {error})") from None

    def messages(self, prompt, origin: str) -> list:
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not prompt:
            raise UsageError(
                f"{origin}: a prompt must be a non-empty string or a non-empty list of chat messages, "
                f"got {type(prompt).__name__}"
            )
        for i, message in enumerate(prompt):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise UsageError(f"{origin}: message {i} must be an object with string 'role' and 'content'")
        if self.system_prompt is not None and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": self.system_prompt}] + prompt
        return prompt
