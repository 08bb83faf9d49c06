"""The built-in tools: ``python`` runs code in a limited process tree that dies whole (processes that
left its session or were orphaned by a double fork included), bounded in processes, with none of
the trainer's environment, and, isolated (as root), unable to see the trainer, reach the network or
leave its cgroup; ``calculator`` evaluates arithmetic without ``eval``."""

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


@posix
def test_a_file_past_the_size_limit_stops_the_code():
    text = run_python(f"open('big', 'wb').write(bytes({builtin.FILE_BYTES + (1 << 20)}))", 10)
    assert "OSError: [Errno 27] File too large" in text  # Python ignores SIGXFSZ: the write fails


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


@pytest.fixture(params=["isolated", "not isolated"])
def isolation(request, monkeypatch):
    """Each test of the supervisor both ways: isolated (namespaces and a uid of its own, where this
    machine allows it) and as the trainer's user."""
    if request.param == "isolated" and not sandbox.isolated():
        pytest.skip("this machine does not let the code be isolated (it takes root and namespaces)")
    monkeypatch.setattr(sandbox, "ISOLATE", request.param == "isolated")
    return request.param


@pytest.fixture
def isolated():
    if not sandbox.isolated():
        pytest.skip("this machine does not let the code be isolated (it takes root and namespaces)")


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
def test_every_process_the_code_started_dies_with_it_however_it_left(escape, cgroup, isolation, monkeypatch):
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
def test_one_call_runs_a_bounded_number_of_processes(isolation):
    if not _cgroups():
        pytest.skip("this machine lets no cgroup be made here")
    marker = f"fastppo-forks-{os.getpid()}"
    text = run_python(FORKS.format(marker=marker), 10)
    assert int(text.split()[0]) == sandbox.MAX_PROCESSES - 1  # the code itself is the first
    assert not _survivors(marker)


@linux
def test_without_a_cgroup_a_call_past_the_bound_is_stopped(monkeypatch):
    """As root without isolation nothing bounds a fork where it happens (root is exempt from
    RLIMIT_NPROC): the count of the tree stops the call."""
    monkeypatch.setattr(sandbox, "make_cgroup", lambda: None)
    monkeypatch.setattr(sandbox, "ISOLATE", False)
    marker = f"fastppo-forks-{os.getpid()}-watched"
    text = run_python(FORKS.format(marker=marker), 10)
    if os.geteuid() == 0:
        assert text.endswith(f"[stopped: it ran more than {sandbox.MAX_PROCESSES} processes at once]")
    else:  # RLIMIT_NPROC: the user's processes and MAX_PROCESSES more
        assert int(text.split()[0]) < sandbox.MAX_PROCESSES
    assert not _survivors(marker)


@linux
def test_isolated_without_a_cgroup_a_burst_of_forks_is_bounded_where_they_happen(isolated, monkeypatch):
    monkeypatch.setattr(sandbox, "make_cgroup", lambda: None)
    marker = f"fastppo-forks-{os.getpid()}-nproc"
    text = run_python(FORKS.format(marker=marker), 10)
    assert int(text.split()[0]) == sandbox.MAX_PROCESSES - 1, text  # RLIMIT_NPROC of its own uid
    assert not _survivors(marker)


READ_THE_TRAINER = """
import os
found = []
for pid in [{trainer}] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:
    for what in ('environ', 'mem', 'cmdline'):
        try:
            with open(f'/proc/{{pid}}/{{what}}', 'rb') as f:
                seen = f.read(1 << 20)
        except OSError:
            continue
        if pid == {trainer} or b'{secret}'[::-1] in seen:  # the secret, not this code's text
            found.append((pid, what))
print(found)
"""


@linux
def test_isolated_code_sees_nothing_of_the_trainer(isolated, monkeypatch):
    """The trainer's environment, memory and command line, through its pid or any pid /proc shows."""
    monkeypatch.setenv("FAKE_OPENAI_API_KEY", "sk-fastppo-test-secret")
    code = READ_THE_TRAINER.format(trainer=os.getpid(), secret="sk-fastppo-test-secret"[::-1])
    assert run_python(code, 10) == "[]\n"
    # and through the supervisor's parent, as the one line tried
    parent = "import os; print(os.getppid(), open(f'/proc/{os.getppid()}/stat').read().split(') ')[1].split()[1])"
    assert run_python(parent, 10) == "1 0\n"  # the namespace's init, whose parent is outside it


@linux
def test_isolated_code_has_no_network(isolated):
    text = run_python("import socket; socket.create_connection(('127.0.0.1', 9), timeout=5)", 10)
    assert "Network is unreachable" in text or "Connection refused" not in text and "OSError" in text


LEAVE_THE_CGROUP = """
import glob, os, signal, subprocess, sys, time  # {marker}
moved = 0
for procs in glob.glob('/sys/fs/cgroup/**/cgroup.procs', recursive=True):
    try:
        with open(procs, 'w') as f:
            f.write(str(os.getpid()))
        moved += 1
    except OSError:
        pass
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'], start_new_session=True)
killed = 0
for pid in [os.getppid(), 1] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
started = 0
for _ in range(40):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    started += 1
print(moved, killed, started, flush=True)
"""


@linux
def test_isolated_code_cannot_leave_its_cgroup_kill_its_supervisor_or_outlive_its_call(isolated):
    marker = f"fastppo-leave-{os.getpid()}"
    text = run_python(LEAVE_THE_CGROUP.format(marker=marker), 10)
    moved, killed, started = map(int, text.split())
    assert moved == 0 and started <= sandbox.MAX_PROCESSES - 2, text  # it and its sleeper count
    assert killed <= 1, text  # the sleeper it started itself, at most
    assert not _survivors(marker)


def test_the_trainers_environment_stays_out_of_the_code(monkeypatch):
    monkeypatch.setenv("SOME_API_KEY", "sk-secret")
    text = run_python("import os; print(sorted(os.environ)); print(os.environ.get('SOME_API_KEY'))", 10)
    names, key = text.splitlines()
    assert key == "None" and "SOME_API_KEY" not in names


@linux
def test_code_that_kills_its_supervisor_is_said_and_its_cgroup_emptied(monkeypatch):
    if not _cgroups():
        pytest.skip("this machine lets no cgroup be made here")
    monkeypatch.setattr(sandbox, "ISOLATE", False)  # isolated, it cannot (the test above)
    marker = f"fastppo-parricide-{os.getpid()}"
    code = (
        f"import os, signal, subprocess, sys  # {marker}\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}], start_new_session=True)\n"
        "os.kill(os.getppid(), signal.SIGKILL)"
    )
    assert run_python(code, 10).endswith("[stopped: it killed the process that watched it]")
    assert not _survivors(marker)


def test_a_run_with_the_python_tool_says_at_start_what_it_isolates():
    from types import SimpleNamespace

    from fastppo.trainer.configuration.config import TrainConfig
    from fastppo.trainer.run.summaries import episodes

    config = TrainConfig()
    config.tools.tools = ["python", "calculator"]
    agent = SimpleNamespace(schemas=[{"function": {"name": name}} for name in config.tools.tools])
    said = episodes(config, agent)[-1]
    assert said == sandbox.isolation()
    assert said.startswith("python tool: isolated" if sandbox.isolated() else "python tool: NOT isolated")
    config.tools.tools = ["calculator"]
    assert not any("python tool" in line for line in episodes(config, agent))
