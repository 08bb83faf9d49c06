"""The ``fastppo train`` command line, generated from the config's fields (``--field-name``, its help
from the field's), and the ``--config`` JSON or TOML file that may set any of them (flat keys):
defaults, then the file, then the command line.
"""

import argparse
import dataclasses
import json
import typing
from pathlib import Path

from ...errors import UsageError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package (a dependency there)
    import tomli as tomllib
from .config import TrainConfig, _base_type, sections


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--field-name`` option per config field, its help from the field's. A bool option alone
    means true (``--overwrite``); it also takes a value (``--save false``)."""
    parser.add_argument("--config", type=Path, help="JSON or TOML file of config fields (flat keys)")
    for section in sections():
        group = parser.add_argument_group(section.__name__)
        for f in dataclasses.fields(section):
            base = _base_type(f)[0]
            listed = typing.get_origin(base) is list
            if listed:  # --reward a b, or --reward a --reward b
                base = typing.get_args(base)[0]
            kind = {bool: _parse_bool, int: int, float: float}.get(base, str)
            flag = dict(nargs="?", const=True) if base is bool else dict(nargs="+", action="extend") if listed else {}
            text = f.metadata["help"]  # a default said in words, or none to say, gets no "(default: None)"
            text = text() if callable(text) else text
            if "default:" not in text and f.default is not None:
                text += f" (default: {f.default})"
            group.add_argument(
                f"--{f.name.replace('_', '-')}",
                dest=f.name,
                type=kind,
                default=argparse.SUPPRESS,
                help=text.replace("%", "%%"),
                **flag,
            )  # argparse formats help with %


def read_config_file(path: Path) -> dict:
    """The fields of a JSON or TOML config file (TOML by its ``.toml`` suffix), type-checked."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        values = tomllib.loads(text) if Path(path).suffix == ".toml" else json.loads(text)
    except OSError as error:
        raise UsageError(f"--config {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--config {path}: not UTF-8 text") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"--config {path}: does not parse ({error})") from None
    TrainConfig.from_flat(values, source=str(path))  # the types, named with the file
    return values


def given_fields(args: argparse.Namespace) -> dict:
    """The fields the user set: the ``--config`` file's, then the command line's over them."""
    values = read_config_file(args.config) if getattr(args, "config", None) is not None else {}
    values.update(
        {k: v for k, v in vars(args).items() if k not in ("config", "resume", "debug") and not k.startswith("plan")}
    )
    return values


def from_arguments(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the ``--config`` file, then the command line; validated."""
    return TrainConfig.from_flat(given_fields(args)).validate()
