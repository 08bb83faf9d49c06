"""The built-in tools: ``python`` runs code in a limited subprocess that dies alone, and
``calculator`` evaluates arithmetic without ``eval``."""

import os
import sys

import pytest

from fastppo.agents import builtin
from fastppo.agents.builtin import calculator, run_python

posix = pytest.mark.skipif(os.name != "posix", reason="the limits are POSIX rlimits")


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
