"""The python tool's process tree: model-written code run so that every process it starts is bounded
in number and killed with it, whatever it does to leave (a new session, a double fork).

The trainer starts a *supervisor*, this file run as a script (``python -I``: the standard library
only, nothing of the trainer's environment), which

1. makes itself a child subreaper (Linux): a process of the tree whose parent dies, at any depth,
   becomes the supervisor's child, not init's, so ``setsid`` or a daemon's double fork never leaves
   the tree;
2. starts the code with its limits (CPU seconds, address space, file size, no core files) and,
   where the trainer made one, in a cgroup whose ``pids.max`` is ``MAX_PROCESSES``: past it a
   fork fails (``EAGAIN``). Where no cgroup can be made (it takes cgroup v2 with the pids
   controller delegated, or cgroup v1's pids hierarchy writable, as for root) the supervisor counts
   the tree every ``WATCH_SECONDS`` and stops the call when it passes ``MAX_PROCESSES``;
3. when the code exits or its wall clock runs out, kills every process of the tree, pass after
   pass until none is left (one forking during a pass leaves orphans, its own, for the next), reaps
   them, and writes what happened as one JSON line on its stdout.

The trainer then kills whatever is left in the cgroup (code that killed its supervisor) and removes
it. So the processes, and with them the memory and CPU time of one call, are bounded by
``MAX_PROCESSES`` times the per-process limits. What is not isolated is listed in docs/agents.md.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

MAX_PROCESSES = 16  # processes of one call at once, the code's own included
WATCH_SECONDS = 0.02  # how often a supervisor without a cgroup counts the tree
POLL_SECONDS = 0.005  # how often the supervisor looks for the code's exit
GRACE_SECONDS = 5.0  # past the wall clock, how long the trainer waits for the supervisor's report
PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


# ---- the trainer's side ------------------------------------------------------------------------


def run(argv: list, cwd: str, output, wall_seconds: float, limits: dict) -> dict:
    """Run ``argv`` in ``cwd`` under a supervisor, its stdout and stderr into the file ``output``,
    for at most ``wall_seconds``, with ``limits`` (``{"cpu", "memory", "file"}``: rlimits). Returns
    ``{"status": the wait status or None, "stopped": None, "time" or "processes"}``."""
    cgroup = make_cgroup()
    request = dict(argv=argv, wall=wall_seconds, limits=limits, cgroup=cgroup and str(cgroup))
    supervisor = subprocess.Popen(
        [sys.executable, "-I", __file__, json.dumps(request)],
        cwd=cwd,
        env=minimal_environment(cwd),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=output,
        start_new_session=True,
    )
    try:
        report, _ = supervisor.communicate(timeout=wall_seconds + GRACE_SECONDS)
    except subprocess.TimeoutExpired:  # the code stopped its supervisor (SIGSTOP)
        supervisor.kill()
        report, _ = supervisor.communicate()
    finally:
        if cgroup is not None:
            kill_all(lambda: cgroup_pids(cgroup))
            remove_cgroup(cgroup)
    try:
        return json.loads(report.decode().splitlines()[-1])
    except (ValueError, IndexError):  # the code killed its supervisor: what the tree did is unknown
        return {"status": None, "stopped": "supervisor"}


def minimal_environment(home: str) -> dict:
    """The environment of the supervisor and the code: none of the trainer's (its keys and tokens)."""
    return {"PATH": os.defpath, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}


def make_cgroup():
    """A new cgroup with ``pids.max`` set, or None where this process cannot make one."""
    for parent in _pids_cgroup_parents():
        path = parent / f"fastppo-python-{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / "pids.max").write_text(str(MAX_PROCESSES))
            return path
        except OSError:
            remove_cgroup(path)
    return None


def _pids_cgroup_parents() -> list:
    """Where this process's cgroups could hold a child with the pids controller: its cgroup v2
    directory when ``pids`` is enabled below it, then its cgroup v1 pids directory."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    own = {}  # "v2" or "pids" -> this process's cgroup path in that hierarchy
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            own["v2"] = path
        elif "pids" in controllers.split(","):
            own["pids"] = path
    parents = []
    for mount in mounts:
        fields = mount.split()
        point, kind = fields[4], fields[fields.index("-") + 1]
        options = fields[-1].split(",")
        if kind == "cgroup2" and "v2" in own:
            parent = Path(point + own["v2"])
            try:
                if "pids" in (parent / "cgroup.subtree_control").read_text().split():
                    parents.insert(0, parent)
            except OSError:
                pass
        elif kind == "cgroup" and "pids" in options and "pids" in own:
            parents.append(Path(point + own["pids"]))
    return parents


def cgroup_pids(cgroup: Path) -> set:
    try:
        return {int(p) for p in (cgroup / "cgroup.procs").read_text().split()}
    except OSError:
        return set()


def remove_cgroup(cgroup: Path) -> None:
    for _ in range(100):  # a process just killed may take a moment to leave it
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def kill_all(pids) -> None:
    """SIGKILL every process ``pids()`` names, pass after pass, until it names none."""
    for _ in range(10000):
        alive = pids()
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _reap()
        time.sleep(0.001)


# ---- the supervisor's side ---------------------------------------------------------------------


def _reap() -> dict:
    """Collect the wait statuses of this process's ended children: ``{pid: status}``."""
    ended = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended[pid] = status


def descendants(root: int) -> set:
    """The live (not zombie) processes below ``root``, read from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry))
    found, frontier = set(), [root]
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _subreaper() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _start(argv: list, limits: dict, cgroup) -> subprocess.Popen:
    def prepare():  # in the child, before the code starts
        import resource

        if cgroup is not None:
            Path(cgroup, "cgroup.procs").write_text("0")  # this process, and so all it starts
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu"], limits["cpu"] + 1))  # SIGXCPU, then SIGKILL
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file"], limits["file"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=subprocess.STDOUT, preexec_fn=prepare
    )


def supervise(request: dict) -> dict:
    """Run the request's code as this module's docstring says; what happened."""
    _subreaper()
    me, cgroup = os.getpid(), request["cgroup"]
    code = _start(request["argv"], request["limits"], cgroup)
    deadline, watched, status, stopped = time.monotonic() + request["wall"], 0.0, None, None
    while status is None:
        status = _reap().get(code.pid)  # orphans of the tree are reaped too
        now = time.monotonic()
        if status is not None:
            break
        if now >= deadline:
            stopped = "time"
            break
        if cgroup is None and now - watched >= WATCH_SECONDS:
            watched = now
            if len(descendants(me)) > MAX_PROCESSES:
                stopped = "processes"
                break
        time.sleep(POLL_SECONDS)
    tree = (lambda: descendants(me)) if cgroup is None else (lambda: descendants(me) | cgroup_pids(Path(cgroup)))
    kill_all(tree)
    code.returncode = 0  # reaped here, not by Popen
    return {"status": status, "stopped": stopped}


if __name__ == "__main__":
    print(json.dumps(supervise(json.loads(sys.argv[1]))), flush=True)
