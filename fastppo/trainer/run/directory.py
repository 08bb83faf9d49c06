"""Run directories that lose nothing: atomic saves, verified manifests, one run per directory.

A save is complete or absent, never half there. Everything is written into a hidden temporary
directory beside the target, with a manifest of every file's sha256 (``MANIFEST_FILE``), flushed
to disk (files, then directories), and renamed into place. A kill mid-save leaves the previous
version intact and at worst a ``.NAME.tmp-PID`` directory, which the next start or save of the
run clears; a kill between the two renames of a replacement leaves ``.NAME.old-PID``, which is
put back if ``NAME`` is missing. A directory whose bytes changed (a bad disk, a partial copy),
or whose manifest no longer lists every file it holds, fails :func:`verify_manifest`. A
filesystem that refuses a save (full, read-only) is :class:`SaveFailed`, one line, the previous
save intact.

A run directory belongs to one run: the live run holds its lock (``lock.py``), and a new run
refuses a non-empty directory unless told to clear it (``--overwrite``). ``metrics.jsonl`` is
append-only; a resume keeps its rows before the checkpoint and drops a line a kill cut short.
What a checkpoint holds, and resuming from one, are ``checkpoint.py``'s.
"""

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from ...errors import UsageError
from .inputs import sha256_of
from .lock import LOCK_FILE, RunLock

if TYPE_CHECKING:  # for the annotations only
    from ..parallel.distributed import Ranks

MANIFEST_FILE = "MANIFEST.sha256"
_LEFTOVER = re.compile(r"\.(.+)\.(tmp|old)-\d+")
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")


# atomic saves -----------------------------------------------------------------------------------


class SaveFailed(UsageError):
    """The filesystem refused a save (full, read-only, a quota); nothing already saved changed."""


def _failed_write(error: BaseException) -> bool:
    """Whether ``error`` is the filesystem refusing a write, however the writer reports it: an
    ``OSError``, safetensors' error, or torch.save's stream writer failing."""
    from safetensors import SafetensorError

    return isinstance(error, (OSError, SafetensorError)) or (
        isinstance(error, RuntimeError) and "PytorchStreamWriter failed" in str(error)
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest_entries(manifest: Path) -> dict:
    """``{relative/path: sha256}`` of a manifest."""
    entries = {}
    for line in manifest.read_text().splitlines():
        digest, _, name = line.partition("  ")
        entries[name] = digest
    return entries


def write_manifest(directory: Path) -> None:
    """``MANIFEST_FILE`` in ``directory``: ``sha256  relative/path`` for every file below it.

    A subdirectory saved atomically inside this save (a checkpoint's ``policy/``) has just written
    its own manifest: its sums are taken from there, so no file is hashed twice.
    """
    known = {}
    for inner in directory.rglob(MANIFEST_FILE):
        prefix = inner.parent.relative_to(directory)
        known.update({(prefix / name).as_posix(): digest for name, digest in _manifest_entries(inner).items()})
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    names = [p.relative_to(directory).as_posix() for p in files]
    lines = [f"{known.get(name) or sha256_of(p)}  {name}\n" for p, name in zip(files, names)]
    (directory / MANIFEST_FILE).write_text("".join(lines))


def verify_manifest(directory: Path, required: tuple = ()) -> None:
    """Raise ``ValueError`` unless the manifest lists every file below ``directory`` (and the
    ``required`` names), and each is there with its sha256: an emptied or edited manifest, a file
    added or removed, fails as surely as changed bytes do."""
    manifest = Path(directory) / MANIFEST_FILE
    if not manifest.is_file():
        raise ValueError(f"no {MANIFEST_FILE}")
    entries = _manifest_entries(manifest)
    present = {
        p.relative_to(directory).as_posix()
        for p in Path(directory).rglob("*")
        if p.is_file() and p.name != MANIFEST_FILE
    }
    unlisted = sorted(present.difference(entries)) + [name for name in required if name not in entries]
    if unlisted:
        raise ValueError(
            f"{MANIFEST_FILE} does not list {', '.join(unlisted[:3])}"
            + (f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else "")
        )
    for name, expected in entries.items():
        path = Path(directory) / name
        if not path.is_file():
            raise ValueError(f"{name} is missing")
        if sha256_of(path) != expected:
            raise ValueError(f"{name} does not match its sha256 in {MANIFEST_FILE}")


def clear_leftovers(directory: Path) -> None:
    """Remove what interrupted saves left in ``directory``; put back a replaced save that a kill
    between the two renames left only as ``.NAME.old-PID``."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        match = _LEFTOVER.fullmatch(path.name)
        if not match:
            continue
        if not path.is_dir():  # a file written by write_text_atomically
            path.unlink(missing_ok=True)
            continue
        target = directory / match.group(1)
        if match.group(2) == "old" and not target.exists():
            os.replace(path, target)
        else:
            shutil.rmtree(path, ignore_errors=True)


def save_atomically(target: Path, write: Callable[[Path], None], ranks: Optional["Ranks"] = None) -> Path:
    """Call ``write(directory)`` on a temporary directory, add the manifest, make it ``target`` in
    one rename. With ``ranks`` (a sharded save) every rank calls this and writes its part into
    rank 0's temporary directory; rank 0 alone makes it ``target``."""
    target = Path(target)
    main = ranks is None or ranks.main
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if main:
        target.parent.mkdir(parents=True, exist_ok=True)
        clear_leftovers(target.parent)
        tmp.mkdir()
    if ranks is not None:  # rank 0's names
        tmp, old = ranks.gather((tmp, old) if main else None)[0]
    try:
        write(tmp)
        if ranks is not None:
            ranks.barrier()  # every part is written
        if main:
            _commit(tmp, old, target)
    except BaseException as error:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = error.__cause__ if isinstance(error, SaveFailed) else error  # a save inside this one failed
        if _failed_write(cause):
            raise SaveFailed(
                f"could not write {target} ({type(cause).__name__}: {cause}); what was saved before "
                "is intact: free some space (or fix the directory's permissions) and resume"
            ) from cause
        raise
    if ranks is not None:
        ranks.barrier()  # no rank goes on before target is in place
    return target


def _commit(tmp: Path, old: Path, target: Path) -> None:
    """The written ``tmp`` with its manifest, flushed to disk and renamed to ``target``."""
    write_manifest(tmp)
    for path in sorted(tmp.rglob("*"), reverse=True):  # files before the directories holding them
        _fsync(path)
    _fsync(tmp)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_text_atomically(path: Path, text: str) -> None:
    """``path`` holds the old text or the new one, never a part: a temporary file, then a rename."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def numbered_checkpoints(run_dir: Path) -> list:
    """``[(N, path)]`` of the ``checkpoint-N`` directories, oldest first."""
    found = [
        (int(m.group(1)), p) for p in Path(run_dir).iterdir() if p.is_dir() and (m := CHECKPOINT_NAME.fullmatch(p.name))
    ]
    return sorted(found)


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Remove ``checkpoint-N`` directories but the ``keep`` newest (``keep`` 0 keeps all)."""
    if keep <= 0:
        return
    for _, path in numbered_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path)


# the run directory ------------------------------------------------------------------------------


def check_run_directory(out: Path, overwrite: bool) -> None:
    """Refuse ``out`` for a new run if it holds anything, unless ``overwrite`` and it is a fastppo
    run directory (has a config.json): :func:`clear_run_directory` then empties it when the run
    starts, so a run that fails to start deletes nothing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    if not out.exists() or not any(p.name != LOCK_FILE for p in out.iterdir()):
        return
    if not overwrite:
        raise UsageError(
            f"--out {out} is not empty; continue that run with --resume {out}, clear it with "
            "--overwrite, or choose another --out"
        )
    if not (out / "config.json").is_file():
        raise UsageError(
            f"--out {out} is not empty and not a fastppo run directory (no config.json); "
            "--overwrite clears only run directories"
        )


def claim_run_directory(run, resuming: bool) -> RunLock:
    """Hold ``run.out`` for this run (``lock.py``), check that a new run may start there (see
    :func:`check_run_directory`), and clear what interrupted saves left."""
    out = Path(run.out)
    lock = RunLock.acquire(out)
    try:
        if not resuming:
            check_run_directory(out, run.overwrite)
        clear_leftovers(out)
    except BaseException:
        lock.release()
        raise
    return lock


def clear_run_directory(out: Path) -> None:
    """Empty the run directory ``out`` (checked by :func:`check_run_directory`) but for the lock
    this run holds."""
    for path in Path(out).iterdir():
        if path.name == LOCK_FILE:
            continue
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def read_metrics(path: Path) -> list:
    """``[(line, row)]`` of a ``metrics.jsonl``, dropping (with a warning naming it) any line that is
    not a complete JSON row, such as the last one of a run killed mid-write."""
    rows = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), start=1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("iteration"), int):
                raise ValueError
        except ValueError:
            warnings.warn(f"{path}:{number}: dropping a line that is not a complete metrics row")
            continue
        rows.append((line, row))
    return rows


def metrics_before(path: Path, start: int) -> list:
    """The lines of ``metrics.jsonl`` for iterations before ``start`` (see :func:`read_metrics`)."""
    if not path.is_file():
        warnings.warn(f"{path} is missing; the resumed run logs from iteration {start} only")
        return []
    return [line for line, row in read_metrics(path) if row["iteration"] < start]
