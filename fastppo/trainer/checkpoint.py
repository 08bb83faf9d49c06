"""Writing run directories atomically: a save is complete or absent, never half there.

Everything is written into a hidden temporary directory beside the target, flushed to disk
(files, then directories), and renamed into place in one step. A crash mid-save leaves the
previous version intact and at worst a ``.tmp-*`` directory, which the next save of that name
clears. Older numbered checkpoints beyond the ones to keep are removed after a save succeeds.
"""

import os
import re
import shutil
from pathlib import Path
from typing import Callable


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomically(target: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(directory)`` on a temporary directory, then make it ``target`` in one rename."""
    target = Path(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        for path in sorted(tmp.rglob("*"), reverse=True):  # files before the directories holding them
            _fsync(path)
        _fsync(tmp)
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return target


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Remove ``checkpoint-N`` directories but the ``keep`` newest (``keep`` 0 keeps all)."""
    if keep <= 0:
        return
    numbered = [(int(m.group(1)), p) for p in Path(run_dir).iterdir()
                if p.is_dir() and (m := re.fullmatch(r"checkpoint-(\d+)", p.name))]
    for _, path in sorted(numbered)[:-keep]:
        shutil.rmtree(path)
