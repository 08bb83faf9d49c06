"""The files a run reads, pinned to the run: resolved when it starts, checked when it resumes.

A run started with relative paths (``--prompts p.jsonl``, a reward module found in the working
directory or through ``PYTHONPATH=.``) and resumed from another directory would read whatever is
there under those names, or fail late. So a new run writes its path fields absolute into
``config.json``, and ``inputs.json`` beside it records the size and sha256 of each prompt file
and chat template, and where each reward module was found. A resume refuses a prompt file or
template that changed or is gone (which prompts an iteration draws, and their tokens, depend on
them; ``eval_prompts`` may be replaced on resume, so only its path is kept), imports each reward
module from where the run found it (first on ``sys.path``, so another module of the same name
elsewhere never scores instead), refuses one whose file is gone, and warns when its source
changed since.
"""

import hashlib
import json
import sys
import warnings
from pathlib import Path

from ...errors import UsageError

INPUTS_FILE = "inputs.json"
PATH_FIELDS = ("model", "prompts", "eval_prompts", "chat_template", "reward_model")
PINNED_FILES = ("prompts", "chat_template")  # their contents decide what the resumed run computes


def resolved(flat: dict) -> dict:
    """``flat`` config fields with each path field that names something here made absolute."""
    return {
        **flat,
        **{
            name: str(Path(flat[name]).resolve())
            for name in PATH_FIELDS
            if flat.get(name) and Path(flat[name]).exists()
        },
    }


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fingerprint(path: Path) -> dict:
    return {"path": str(path), "size": path.stat().st_size, "sha256": sha256_of(path)}


def _module_root(name: str, file: Path) -> Path:
    """The ``sys.path`` entry that module ``name`` (dotted) was imported from, given its file."""
    root = file.parent.parent if file.name == "__init__.py" else file.parent
    for _ in name.split(".")[1:]:
        root = root.parent
    return root


def pinned(flat: dict) -> str:
    """What ``INPUTS_FILE`` holds: the pinned files' fingerprints and the reward modules' files
    (those imported by now)."""
    files = {name: _fingerprint(Path(flat[name])) for name in PINNED_FILES if flat.get(name)}
    modules = {}
    for spec in flat.get("reward") or ():
        name = spec.partition(":")[0]
        file = getattr(sys.modules.get(name), "__file__", None)
        if ":" in spec and file:
            modules[name] = {**_fingerprint(Path(file)), "root": str(_module_root(name, Path(file)))}
    return json.dumps({"files": files, "reward_modules": modules}, indent=1)


def check(run_dir: Path) -> None:
    """Before a resume loads anything: refuse a pinned file that changed, and put each reward
    module's directory first on ``sys.path``, warning when its source changed. A run directory
    from before ``INPUTS_FILE`` is not checked."""
    path = Path(run_dir) / INPUTS_FILE
    if not path.is_file():
        return
    try:
        pinned = json.loads(path.read_text())
        files, modules = pinned["files"], pinned["reward_modules"]
    except (ValueError, KeyError, TypeError) as error:
        raise UsageError(f"--resume {run_dir}: {INPUTS_FILE} does not parse ({error})") from None
    for name, was in files.items():
        file = Path(was["path"])
        if not file.is_file():
            raise UsageError(
                f"--resume {run_dir}: --{name.replace('_', '-')} {file} is gone; the run started "
                "with it and resumes only with it"
            )
        now = _fingerprint(file)
        if (now["size"], now["sha256"]) != (was["size"], was["sha256"]):
            raise UsageError(
                f"--resume {run_dir}: --{name.replace('_', '-')} {file} changed since the run started "
                f"({was['size']} bytes, sha256 {was['sha256'][:12]}...; now {now['size']} bytes, "
                f"{now['sha256'][:12]}...); it resumes only with the file it started with"
            )
    for name, was in modules.items():
        file = Path(was["path"])
        if not file.is_file():  # another module of that name elsewhere on the path would score instead
            raise UsageError(
                f"--resume {run_dir}: reward module {name} ({file}) is gone; the run started with it and "
                "resumes only with it"
            )
        if was["root"] not in sys.path:
            sys.path.insert(0, was["root"])
        if _fingerprint(file)["sha256"] != was["sha256"]:
            warnings.warn(
                f"reward module {name} ({file}) changed since the run started: the resumed run scores with its new code"
            )
