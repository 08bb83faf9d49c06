"""Prompt files read into rows: JSON Lines, JSON, Parquet and CSV, by suffix, each row a dict and
each named by its origin (file and line) for the errors that name it.
"""

import csv
import json
from pathlib import Path

from ...errors import UsageError

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


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
