"""One live run per run directory: a second run into it (new, --overwrite, --resume) is refused in
one line naming the live one; the lock of a run that died is taken over; the lock goes with the run."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from fastppo.cli import main as fastppo_main
from fastppo.trainer import PPOTrainer
from fastppo.trainer.run.lock import LOCK_FILE, RunDirectoryBusy, RunLock
from tests.trainer.runs import HOLD, holder, untrained


@pytest.mark.slow  # the real command in a subprocess
def test_a_live_run_refuses_every_other_run_into_its_directory(tmp_path, capsys):
    """The real command, live in a subprocess: a resume, an --overwrite and a new run into its
    directory are each one line naming its pid, exit 2; its metrics go on uninterleaved."""
    run = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "fastppo",
        "train",
        "--iterations",
        "100000",
        "--save-every",
        "2",
        "--device",
        "cpu",
        "--evaluate",
        "false",
        "--out",
        str(run),
    ]
    live = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(run.glob("checkpoint-*")):  # checkpoint-2 may be pruned within 0.2 s on a fast CPU
            assert live.poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.2)
        for argv in (["--resume", str(run)], ["--out", str(run), "--overwrite"], ["--out", str(run)]):
            capsys.readouterr()
            assert fastppo_main(["train", "--device", "cpu", *argv]) == 2, argv
            err = capsys.readouterr().err
            assert (
                err.count("\n") == 1 and f"in use by a live run, pid {live.pid} on host {socket.gethostname()}" in err
            ), err
        assert live.poll() is None  # nothing was cleared under it
    finally:
        live.send_signal(signal.SIGINT)
        live.communicate(timeout=120)
    rows = [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(len(rows)))
    assert not (run / LOCK_FILE).exists()  # let go at the end
    assert PPOTrainer.resume(run)[1] == len(rows)


def test_the_lock_of_a_run_that_died_is_taken_over_naming_it(tmp_path):
    process = holder(tmp_path / "run")
    process.kill()  # as kill -9 or an out-of-memory kill: no chance to let go
    process.wait()
    assert (tmp_path / "run" / LOCK_FILE).exists()
    with pytest.warns(UserWarning, match=f"taking over the lock of a run that ended .*pid {process.pid}"):
        trainer = untrained(tmp_path, iterations=1, evaluate=False)
    trainer.train()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_two_new_runs_into_one_empty_directory(tmp_path):
    """Both would pass the emptiness check; the second to lock is refused before writing anything."""
    (tmp_path / "run").mkdir()
    process = holder(tmp_path / "run")
    try:
        with pytest.raises(RunDirectoryBusy, match=f"pid {process.pid}"):
            untrained(tmp_path, iterations=1)
        assert [p.name for p in (tmp_path / "run").iterdir()] == [LOCK_FILE]
    finally:
        process.communicate("")
    untrained(tmp_path, iterations=1, evaluate=False).train()  # its holder gone, the directory is free


def test_the_lock_is_the_process_s_and_the_last_holder_removes_it(tmp_path):
    first = RunLock.acquire(tmp_path / "run")
    second = RunLock.acquire(tmp_path / "run")  # a second trainer in one process shares it
    first.release()
    first.release()  # once, however often called
    assert (tmp_path / "run" / LOCK_FILE).exists()
    process = subprocess.run(
        [sys.executable, "-c", HOLD, str(tmp_path / "run")], input="", capture_output=True, text=True
    )
    assert process.returncode == 1 and f"pid {os.getpid()}" in process.stderr  # still held against others
    second.release()
    assert not (tmp_path / "run").exists()  # it created the directory, and nothing else was written


def test_a_run_directory_under_a_file_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    assert fastppo_main(["train", "--device", "cpu", "--out", str(tmp_path / "file" / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a file is in the way" in err


def test_a_lock_file_unlinked_between_the_open_and_the_lock_is_not_the_one_held(tmp_path, monkeypatch):
    """A holder releasing between our open and our flock unlinks the file we open: we must lock the
    file at the path, not the unlinked one (else two runs would each hold a lock)."""
    from fastppo.trainer.run import lock as run_lock

    run = tmp_path / "run"
    run.mkdir()
    try_lock, raced = run_lock._try_lock, []

    def releasing_meanwhile(fd):
        if not raced:
            raced.append(1)
            os.unlink(run / LOCK_FILE)  # the other holder's release, just before our lock
        return try_lock(fd)

    monkeypatch.setattr(run_lock, "_try_lock", releasing_meanwhile)
    lock = RunLock.acquire(run)
    try:
        fd = run_lock._HELD[run.resolve()][0]
        assert raced and os.stat(run / LOCK_FILE).st_ino == os.fstat(fd).st_ino
    finally:
        lock.release()


def test_a_directory_that_was_there_before_stays_after_the_release(tmp_path):
    (tmp_path / "run").mkdir()
    RunLock.acquire(tmp_path / "run").release()
    assert (tmp_path / "run").is_dir() and not (tmp_path / "run" / LOCK_FILE).exists()


def test_without_flock_a_lock_naming_this_process_that_it_does_not_hold_is_stale(tmp_path, monkeypatch):
    """Where there is no flock, the pid inside decides; this process's own pid in a file it does not
    hold (a run of an earlier process that had the same pid) is no live run."""
    from fastppo.trainer.run import lock as run_lock

    monkeypatch.setattr(run_lock, "fcntl", None)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_FILE).write_text(
        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": 0})
    )
    with pytest.warns(UserWarning, match="taking over the lock"):
        lock = RunLock.acquire(tmp_path / "run")
    lock.release()
