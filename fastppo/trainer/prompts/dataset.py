"""A run's prompts: the built-in task's or the ``--prompts`` file's rows, mapped, rendered and
tokenized, and fitted to the context (a prompt too long is cut or dropped, as asked); the same
for the held-out prompts.
"""

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import UsageError
from .chat import ChatRenderer
from .columns import map_columns, parse_field_map
from .files import read_rows

if TYPE_CHECKING:  # for the annotations only
    from ..configuration.config import TrainConfig


@dataclass
class Prompts:
    """Prompt rows ready for the sampler: the text each renders to, its token ids, the row's other
    fields (as the reward functions receive them) and where each came from."""

    texts: list
    ids: list  # token-id lists
    fields: list  # one dict per row, without the prompt
    origins: list
    messages: list  # the chat messages each rendered from (None for a string prompt used as is)
    rows: list  # each row whole, its prompt column as given and its fields: what an environment's reset gets

    def __len__(self) -> int:
        return len(self.texts)

    def field_names(self) -> list:
        """Every field any row has, in order of first appearance: each reward call gets all of them."""
        return list(dict.fromkeys(k for row in self.fields for k in row))

    def row_texts(self, chosen: list, n: int) -> list:
        """The text of each of ``n`` rows (samples) for each prompt ``chosen``."""
        return [self.texts[i] for i in chosen for _ in range(n)]

    def select(self, keep: list) -> "Prompts":
        kept = (self.texts, self.ids, self.fields, self.origins, self.messages, self.rows)
        return Prompts(*([values[i] for i in keep] for values in kept))


def load(rows: list, origins: list, tokenizer, data, source: str, schemas=None) -> Prompts:
    """Rows (dicts with a prompt column) of ``source`` (what errors call them) as
    :class:`Prompts`: mapped, rendered (the tools ``schemas(row, origin)`` gives listed, with
    tools) and tokenised."""
    prompts, fields = map_columns(rows, origins, data.prompt_field, parse_field_map(data.field_map), source)
    render = ChatRenderer(tokenizer, data.chat, data.system_prompt, data.chat_template)
    texts, messages = [], []
    whole = [{data.prompt_field: prompt, **row} for prompt, row in zip(prompts, fields)]
    for prompt, row, origin in zip(prompts, whole, origins):
        text, chat = render(prompt, origin, schemas and schemas(row, origin))
        texts.append(text)
        messages.append(chat)
    ids = []
    for text, origin in zip(texts, origins):
        ids.append(tokenizer(text, add_special_tokens=False).input_ids)
        if not ids[-1]:
            raise UsageError(f"{origin}: the prompt is no tokens at all")
    return Prompts(texts, ids, fields, origins, messages, whole)


def fitting(
    prompts: Prompts, context, max_new_tokens: int, max_prompt_tokens, drop_too_long: bool, room: str = "max_new_tokens"
) -> Prompts:
    """The prompts of at most ``max_prompt_tokens`` tokens (the others dropped and counted) that fit
    the model's ``context`` with ``max_new_tokens`` (the fields that make it up: ``room``); one that
    does not fit is an error naming where it came from, or with ``drop_too_long`` is dropped and
    counted."""
    keep, too_long = [], 0
    for i, (ids, origin) in enumerate(zip(prompts.ids, prompts.origins)):
        n = len(ids)
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            too_long += 1
            continue
        if context is not None and n + max_new_tokens > context:
            if not drop_too_long:
                raise UsageError(
                    f"{origin}: the prompt is {n} tokens, and with {room}={max_new_tokens} that "
                    f"exceeds the model's context of {context} positions (--drop-long-prompts drops "
                    "such prompts)"
                )
            continue
        keep.append(i)
    dropped_for_context = len(prompts) - len(keep) - too_long
    if too_long:
        warnings.warn(f"dropped {too_long} of {len(prompts)} prompts longer than max_prompt_tokens={max_prompt_tokens}")
    if dropped_for_context:
        warnings.warn(
            f"dropped {dropped_for_context} of {len(prompts)} prompts longer than the model's context of "
            f"{context} positions less {room}={max_new_tokens}"
        )
    if not keep:
        raise UsageError(
            f"no prompt fits: each is longer than max_prompt_tokens={max_prompt_tokens} or than the "
            f"model's context of {context} positions less {room}={max_new_tokens}"
        )
    return prompts.select(keep)


def sources(config: "TrainConfig", rows=None) -> tuple:
    """``(training, held-out or None)`` rows of a run, each ``(rows, origins, source)``, read before
    any model loads (so a bad file costs no wait): from ``rows`` (the Python API's dicts) or the
    ``--prompts`` file, else the built-in task's; from ``--eval-prompts``, else (for a built-in
    task) its held-out prompts."""
    from . import tasks

    d, ev = config.data, config.eval
    from_task = rows is None and not d.prompts
    if rows is not None:
        training = (rows, [f"prompt {i}" for i in range(len(rows))], "the prompts given")
    elif d.prompts:
        training = (*read_rows(d.prompts), f"--prompts {d.prompts}")
    else:
        training = (*tasks.task_rows(d.task, config.run.seed), f"task {d.task}")
    held_out = None
    if ev.evaluate and ev.eval_prompts:
        held_out = (*read_rows(ev.eval_prompts, "--eval-prompts"), f"--eval-prompts {ev.eval_prompts}")
    elif ev.evaluate and from_task:
        held_out = (*tasks.task_rows(d.task, config.run.seed, held_out=True), f"task {d.task}'s held-out prompts")
    return training, held_out


def configured(config: "TrainConfig", tokenizer, context, read: tuple, schemas=None) -> tuple:
    """``(training prompts, held-out prompts or None)`` as :class:`Prompts` fitting the model's
    ``context`` (with room for a whole response, tools' results included), from what
    :func:`sources` ``read``; the tools' ``schemas`` in the chat prompts."""
    d = config.data
    training, held_out = read

    def prepared(rows, origins, source):
        return fitting(
            load(rows, origins, tokenizer, d, source, schemas),
            context,
            config.response_tokens,
            d.max_prompt_tokens,
            d.drop_long_prompts,
            "max_new_tokens + max_tool_tokens" if config.episodes else "max_new_tokens",
        )

    return prepared(*training), held_out and prepared(*held_out)
