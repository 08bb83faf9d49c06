"""One live run per run directory: a lock file that names the run holding it.

``fastppo train`` (rank 0 alone, under torchrun) holds ``RUN_DIR/.lock`` from start-up until the
run ends: an advisory ``flock`` on the file, which the kernel drops when the process dies however
it dies (kill -9 included), with the holder's pid, host and start time written inside for the
refusal to name. Any other run into the directory (a new one, ``--overwrite`` or ``--resume``)
is refused before it reads or writes anything there, so two runs never interleave their metrics,
and a resume never clears a live run's save in progress.

A lock file nobody holds is stale (its run died): the next run takes it over and says whose it
was. Where the filesystem has no ``flock``, the pid and host inside decide: a live pid on this
host holds the directory, anything else is stale. The lock is the process's: a second trainer in
the same process shares it (a notebook that builds a new trainer after a failed one), and the
last one to let go removes the file; acquiring checks that the file it locked is still the one
at the path, so a release racing an acquisition never leaves two holders.
"""

import contextlib
import errno
import json
import os
import socket
import time
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: only the pid and host inside decide
    fcntl = None

from ...errors import UsageError

LOCK_FILE = ".lock"
_HELD = {}  # resolved directory -> [file descriptor, holders, created] of the locks this process holds


class RunDirectoryBusy(UsageError):
    """Another live run holds the run directory."""


def _describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (started {started})"


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        holder = json.loads(os.read(fd, 4096).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _alive_here(holder: dict) -> bool:
    """Whether ``holder`` names a process alive on this host (the test where there is no flock)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return holder["pid"] != os.getpid()


def _try_lock(fd: int) -> bool:
    """Take the flock without waiting; False when another process holds it. Without flock
    (no ``fcntl``, or a filesystem that refuses it) the pid and host inside decide."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
    return not _alive_here(_read(fd))


def _open(path: Path) -> int:
    """The lock file's descriptor, created if missing; a path that is not a regular file this
    process can write (a directory, a symbolic link, a read-only filesystem) is a :class:`UsageError`."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as error:
        what = "a symbolic link" if path.is_symlink() else "a directory" if path.is_dir() else None
        why = f"it is {what}; remove it" if what else error.strerror or str(error)
        raise UsageError(f"cannot take the run directory's lock file {path}: {why}") from None


class RunLock:
    """This process's hold on one run directory; :meth:`release` lets go (once, however often called)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.held = True

    @classmethod
    def acquire(cls, directory) -> "RunLock":
        """Hold ``directory`` (created if missing) for this run, or raise :class:`RunDirectoryBusy`
        naming the live run that holds it."""
        directory = Path(directory)
        created = not directory.exists()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise UsageError(f"--out {directory}: a file is in the way (a run directory must be a directory)") from None
        except OSError as error:
            raise UsageError(f"--out {directory}: cannot create it ({error.strerror or error})") from None
        key = directory.resolve()
        if key in _HELD:
            _HELD[key][1] += 1
            return cls(key)
        path = key / LOCK_FILE
        while True:
            fd = _open(path)
            if not _try_lock(fd):
                holder = _read(fd)
                os.close(fd)
                raise RunDirectoryBusy(
                    f"{directory} is in use by a live run, {_describe(holder)}; wait for it to "
                    f"end or stop it, or choose another --out"
                )
            try:  # a holder releasing between our open and our lock unlinked the file we locked
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        previous = _read(fd)
        if previous:
            warnings.warn(
                f"{path}: taking over the lock of a run that ended without releasing it, {_describe(previous)}"
            )
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
            os.fsync(fd)
        except OSError as error:  # a full disk
            os.close(fd)
            raise UsageError(f"cannot write the run directory's lock file {path}: {error.strerror or error}") from None
        _HELD[key] = [fd, 1, created]  # a directory made here goes again if left empty
        return cls(key)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        held = _HELD[self.directory]
        held[1] -= 1
        if held[1] == 0:  # the last holder in this process
            del _HELD[self.directory]
            with_lock = self.directory / LOCK_FILE
            try:
                if os.stat(with_lock).st_ino == os.fstat(held[0]).st_ino:
                    os.unlink(with_lock)  # still holding it: nobody can lock this file in between
            except FileNotFoundError:
                pass
            os.close(held[0])
            if held[2]:
                with contextlib.suppress(OSError):
                    self.directory.rmdir()  # only if the run wrote nothing there: a failed start leaves nothing

    def __del__(self):
        self.release()
