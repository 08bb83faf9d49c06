"""The built-in tools: ``python`` runs code in a limited process tree that dies whole (processes that
left its session or were orphaned by a double fork included), bounded in processes, with none of
the trainer's environment; ``calculator`` evaluates arithmetic without ``eval``."""

import os
import sys

import pytest

from fastppo.agents import builtin, sandbox
from fastppo.agents.builtin import calculator, run_python

posix = pytest.mark.skipif(os.name != "posix", reason="the limits are POSIX rlimits")
linux = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="the supervisor reads the tree from /proc")


def test_python_returns_what_the_code_prints_and_its_errors():
    assert run_python("print(6 * 7)", 10) == "42\n"
    failed = run_python("1 / 0", 10)
    assert "ZeroDivisionError" in failed and failed.endswith("[exit status 1]")


@posix
def test_code_that_kills_its_process_kills_only_that_process():
    text = run_python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 10)
    assert text.endswith("[stopped by SIGKILL]")
    assert os.getpid() and sys.executable  # this process goes on


@posix
def test_code_past_the_wall_clock_is_stopped_with_what_it_started():
    marker = f"fastppo-test-{os.getpid()}"
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])\n"
        "time.sleep(60)"
    )
    assert run_python(code, 0.5) == "error: the code ran longer than 0.5 s and was stopped"
    survivors = [p for p in os.listdir("/proc") if p.isdigit() and marker in _cmdline(p)]
    assert not survivors, "the child's own child must die with its group"


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@posix
def test_cpu_memory_and_output_are_limited(monkeypatch):
    monkeypatch.setattr(builtin, "CPU_SECONDS", 1)
    assert "SIGXCPU" in run_python("while True: pass", 30)
    assert "MemoryError" in run_python("x = bytearray(4 << 30)", 30)
    flood = run_python("while True: print('x' * 1000)", 30)
    assert flood.count("x") <= builtin.OUTPUT_BYTES and f"[output cut at {builtin.OUTPUT_BYTES} bytes]" in flood


def test_the_code_runs_in_an_empty_directory_of_its_own():
    here = run_python("import os; print(os.getcwd()); print(os.listdir('.'))", 10).split("\n")
    assert here[0] != os.getcwd() and "fastppo-python-" in here[0]
    assert here[1] == "['.output']"


def test_calculator():
    assert calculator("(12 + 7) * 3") == "57"
    assert calculator("7 / 2") == "3.5" and calculator("8 / 2") == "4"
    assert calculator("-2 ** 10") == "-1024"
    for bad in ("__import__('os')", "2 ** 100000", "x + 1", "1 +"):
        with pytest.raises(ValueError):
            calculator(bad)


def _cgroups() -> bool:
    """Whether this process can make the cgroups that bound a call's processes."""
    cgroup = sandbox.make_cgroup()
    if cgroup is not None:
        sandbox.remove_cgroup(cgroup)
    return cgroup is not None


def _survivors(marker: str) -> list:
    return [p for p in os.listdir("/proc") if p.isdigit() and marker in _cmdline(p)]


ESCAPES = {
    "a new session": "subprocess.Popen([sys.executable, '-c', SLEEP, MARK], start_new_session=True)",
    "setsid in the grandchild": "subprocess.Popen([sys.executable, '-c', 'import os; os.setsid(); ' + SLEEP, MARK])",
    "a double fork": (
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execv(sys.executable, [sys.executable, '-c', SLEEP, MARK])\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)"
    ),
}


@linux
@pytest.mark.parametrize("escape", ESCAPES)
@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "no cgroup"])
def test_every_process_the_code_started_dies_with_it_however_it_left(escape, cgroup, monkeypatch):
    if not cgroup:
        monkeypatch.setattr(sandbox, "make_cgroup", lambda: None)
    marker = f"fastppo-escape-{os.getpid()}-{len(escape)}"
    code = f"import os, subprocess, sys, time\nSLEEP, MARK = 'import time; time.sleep(60)', {marker!r}\n"
    code += ESCAPES[escape] + "\ntime.sleep(0.3)\nprint('started')"
    for wall in (10, 0.2):  # the code ends first; the wall clock ends it
        text = run_python(code, wall)
        assert text == "started\n" if wall == 10 else "ran longer than 0.2 s" in text
        assert not _survivors(marker), f"{escape} escaped the kill"


FORKS = (
    "import os, time  # {marker}\n"
    "started = 0\n"
    "for _ in range(50):\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        time.sleep(60)\n"
    "        os._exit(0)\n"
    "    started += 1\n"
    "print(started, flush=True)\n"
    "time.sleep(0.5)"
)


@linux
def test_one_call_runs_a_bounded_number_of_processes():
    if not _cgroups():
        pytest.skip("this machine lets no cgroup be made here")
    marker = f"fastppo-forks-{os.getpid()}"
    text = run_python(FORKS.format(marker=marker), 10)
    assert int(text.split()[0]) == sandbox.MAX_PROCESSES - 1  # the code itself is the first
    assert not _survivors(marker)


@linux
def test_without_a_cgroup_a_call_past_the_bound_is_stopped(monkeypatch):
    monkeypatch.setattr(sandbox, "make_cgroup", lambda: None)
    marker = f"fastppo-forks-{os.getpid()}-watched"
    text = run_python(FORKS.format(marker=marker), 10)
    assert text.endswith(f"[stopped: it ran more than {sandbox.MAX_PROCESSES} processes at once]")
    assert not _survivors(marker)


def test_the_trainers_environment_stays_out_of_the_code(monkeypatch):
    monkeypatch.setenv("SOME_API_KEY", "sk-secret")
    text = run_python("import os; print(sorted(os.environ)); print(os.environ.get('SOME_API_KEY'))", 10)
    names, key = text.splitlines()
    assert key == "None" and "SOME_API_KEY" not in names


@linux
def test_code_that_kills_its_supervisor_is_said_and_its_cgroup_emptied():
    if not _cgroups():
        pytest.skip("this machine lets no cgroup be made here")
    marker = f"fastppo-parricide-{os.getpid()}"
    code = (
        f"import os, signal, subprocess, sys  # {marker}\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}], start_new_session=True)\n"
        "os.kill(os.getppid(), signal.SIGKILL)"
    )
    assert run_python(code, 10).endswith("[stopped: it killed the process that watched it]")
    assert not _survivors(marker)
