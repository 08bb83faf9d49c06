"""Prompt datasets: rows read from a local file, their columns mapped, chat prompts rendered with
the tokenizer's template, lengths checked once, and an epoch order to visit them in.

A file is read by its suffix: ``.jsonl`` (one JSON object per line), ``.json`` (a list of objects,
or one per line as ``datasets``' ``to_json`` writes), ``.parquet`` (through pyarrow, the library
``datasets`` stores its files with) or ``.csv`` (a header row; every value a string). Each row keeps
where it came from (``file:line`` or ``file, row N``) so every error about it names the place. The
prompt column is ``--prompt-field``; ``--field-map column=name`` renames the other columns for the
reward functions (GSM8K's ``answer`` is already the verifiers' name; MATH's ``solution`` is not).

A prompt is a string, used as is, or a list of chat messages (``{"role", "content"}``), which
the chat template renders with the generation prompt, as TRL's conversational format does.
``--chat`` renders string prompts too, as one user message; ``--system-prompt`` opens every
rendered conversation. The token ids are computed here, once, not at every rollout.

Prompts are visited in epochs: each a permutation drawn from the seed and the epoch number, read
from a cursor (the number of prompts drawn so far), so an iteration's prompts depend only on the
cursor, which a checkpoint stores: a resumed run draws exactly what the uninterrupted run would.
"""

import csv
import json
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# what reward calls pass besides the fields (``environments``: each row's, in a run with one)
REWARD_ARGUMENTS = ("prompts", "completions", "environments")


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

    def select(self, keep: list) -> "Prompts":
        kept = (self.texts, self.ids, self.fields, self.origins, self.messages, self.rows)
        return Prompts(*([values[i] for i in keep] for values in kept))


def read_rows(path: str, option: str = "--prompts") -> tuple:
    """``(rows, origins)``: the file's rows as dicts and where each is; an unreadable file, an
    unknown suffix or a row that is not an object is an error naming the option and the place."""
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise UsageError(
            f"{option} {path}: unknown format {suffix or '(no suffix)'!r}; expected one of {', '.join(SUFFIXES)}"
        )
    if not Path(path).is_file():
        raise UsageError(f"{option} {path}: no such file")
    read = {".jsonl": _jsonl, ".json": _json, ".parquet": _parquet, ".csv": _csv}[suffix]
    rows, origins = read(path, option)
    for row, origin in zip(rows, origins):
        if not isinstance(row, dict):
            raise UsageError(f"{origin}: each row must be an object of named fields, got {type(row).__name__}")
    if not rows:
        raise UsageError(f"{option} {path}: no rows")
    return rows, origins


def _text(path: str, option: str) -> str:
    try:
        return Path(path).read_bytes().decode("utf-8-sig")  # a byte-order mark (Excel's) is no part of the text
    except OSError as error:
        raise UsageError(f"{option} {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        line = Path(path).read_bytes()[: error.start].count(b"\n") + 1
        raise UsageError(f"{path}:{line}: not UTF-8 text") from None


def _jsonl(path: str, option: str) -> tuple:
    rows, origins = [], []
    for number, line in enumerate(_text(path, option).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise UsageError(f"{path}:{number}: not JSON ({error.msg})") from None
        origins.append(f"{path}:{number}")
    return rows, origins


def _json(path: str, option: str) -> tuple:
    try:
        rows = json.loads(_text(path, option))
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # one object per line, as datasets' to_json writes by default
            return _jsonl(path, option)
        raise UsageError(f"{path}:{error.lineno}: not JSON ({error.msg})") from None
    if not isinstance(rows, list):
        raise UsageError(
            f"{option} {path}: a .json file must hold a list of rows, got {type(rows).__name__} "
            "(one object per line is .jsonl)"
        )
    return rows, [f"{path}, row {i + 1}" for i in range(len(rows))]


def _parquet(path: str, option: str) -> tuple:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UsageError(f"{option} {path}: reading Parquet needs pyarrow: pip install 'fastppo[data]'") from None
    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as error:
        raise UsageError(f"{option} {path}: not a readable Parquet file ({error})") from None
    return rows, [f"{path}, row {i + 1}" for i in range(len(rows))]


def _csv(path: str, option: str) -> tuple:
    reader = csv.DictReader(_text(path, option).splitlines())
    rows, origins = [], []
    try:
        for row in reader:
            if None in row:
                raise UsageError(f"{path}:{reader.line_num}: more values than the header has columns")
            rows.append(row)
            origins.append(f"{path}:{reader.line_num}")
    except csv.Error as error:
        raise UsageError(f"{path}:{reader.line_num}: not CSV ({error})") from None
    return rows, origins


def parse_field_map(pairs: list) -> dict:
    """``{column: name}`` from ``["column=name", ...]``."""
    mapping = {}
    for pair in pairs or ():
        column, sep, name = pair.partition("=")
        if not sep or not column or not name.isidentifier():
            raise UsageError(f"--field-map entries are column=name, name a Python identifier, got {pair!r}")
        mapping[column] = name
    return mapping


def map_columns(rows: list, origins: list, prompt_field: str, field_map: dict, source: str) -> tuple:
    """``(prompts, fields)``: each row's prompt column and its other columns renamed by
    ``field_map``; a column named in either that no row of ``source`` has is an error listing
    the ones there."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    for flag, name in [("--prompt-field", prompt_field)] + [("--field-map", c) for c in field_map]:
        if name not in columns:
            raise UsageError(
                f"{flag} {name}: {source} has no column {name!r} (its columns: {', '.join(map(str, columns))})"
            )
    for column in columns:
        name = field_map.get(column, column)
        if column != prompt_field and name in REWARD_ARGUMENTS:
            raise UsageError(
                f"{source}: column {column!r} would reach the reward functions as {name!r}, the name "
                f"of their own argument; rename it with --field-map {column}=another_name"
            )
    prompts, fields = [], []
    for row, origin in zip(rows, origins):
        if prompt_field not in row:
            raise UsageError(f"{origin}: the row has no {prompt_field!r} field")
        prompts.append(row[prompt_field])
        fields.append({field_map.get(k, k): v for k, v in row.items() if k != prompt_field})
    return prompts, fields


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


def sources(config, rows=None) -> tuple:
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


def configured(config, tokenizer, context, read: tuple, schemas=None) -> tuple:
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


class EpochOrder:
    """Indices into ``count`` prompts in shuffled epochs: position ``p`` of the stream is
    ``permutation(p // count)[p % count]``, each epoch's permutation drawn from ``(seed, epoch)``."""

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed
        self._epoch, self._permutation = None, None

    def take(self, start: int, k: int) -> list:
        """The indices at stream positions ``start .. start + k - 1`` (crossing epochs as needed)."""
        return [self._at(p) for p in range(start, start + k)]

    def _at(self, position: int) -> int:
        epoch, offset = divmod(position, self.count)
        if epoch != self._epoch:
            order = list(range(self.count))
            random.Random(f"fastppo prompts {self.seed} {epoch}").shuffle(order)
            self._epoch, self._permutation = epoch, order
        return self._permutation[offset]
