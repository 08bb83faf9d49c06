"""The python tool's process tree: model-written code run so that every process it starts is bounded
in number and killed with it, whatever it does to leave (a new session, a double fork, its own
cgroup), and, where the machine allows it, so that it sees nothing of the trainer.

The trainer starts a *supervisor*, this file run as a script (``python -I``: the standard library
only, nothing of the trainer's environment). Where the trainer runs as root, the supervisor
*isolates* the code (``isolation()`` says which, in the run's start-up lines):

- new PID, mount, network and IPC namespaces (``unshare``): the supervisor's first child is the
  namespaces' init, with a /proc of its own, so the code sees no process outside its call (not the
  trainer's environment, memory or command line), has no network (no interface is up) and, when
  that init ends, the kernel kills every process left in the namespace;
- a uid of its own (one per call, drawn at random from ``SANDBOX_UIDS``): it can signal no other
  process, cannot write the cgroup hierarchy (so it cannot leave its cgroup), reads only what any
  user may, and ``RLIMIT_NPROC`` bounds its forks where they happen. A directory only root may
  enter on the interpreter's path (``/root`` holding pyenv) is covered by an empty tmpfs with the
  interpreter bound back in, so the code runs there without seeing the rest of it.

Elsewhere (not root, or no namespaces) the code runs as the trainer's user: the supervisor makes
itself a child subreaper (Linux), so a process whose parent dies, at any depth, becomes its child,
not init's, and ``RLIMIT_NPROC`` allows the processes the user has plus ``MAX_PROCESSES`` (root is
exempt from it). Either way the supervisor

1. starts the code with its limits (CPU seconds, address space, file size, no core files) and,
   where the trainer made one, in a cgroup whose ``pids.max`` is ``MAX_PROCESSES``: past it a
   fork fails (``EAGAIN``). It takes cgroup v2 with the pids controller delegated, or cgroup v1's
   pids hierarchy writable, as for root;
2. counts the tree every ``WATCH_SECONDS`` as well, and stops the call when it passes
   ``MAX_PROCESSES``;
3. when the code exits or its wall clock runs out, kills every process of the tree and the cgroup,
   pass after pass until none is left (one forking during a pass leaves orphans, its own, for the
   next), reaps them, and writes what happened as one JSON line on its stdout.

The trainer then kills whatever is left in the cgroup (code that killed its supervisor) and removes
it. So the processes, and with them the memory and CPU time of one call, are bounded by
``MAX_PROCESSES`` times the per-process limits. What is not isolated is listed in docs/agents.md.
"""

import ctypes
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

MAX_PROCESSES = 16  # processes of one call at once, the code's own included
WATCH_SECONDS = 0.02  # how often a supervisor without a cgroup counts the tree
POLL_SECONDS = 0.005  # how often the supervisor looks for the code's exit
GRACE_SECONDS = 5.0  # past the wall clock, how long the trainer waits for the supervisor's report
SANDBOX_UIDS = (1 << 30, (1 << 31) - 2)  # where a call's own uid is drawn: above any a system gives its users
ISOLATE = True  # isolate the code where the machine allows it (the tests turn it off to test the rest)
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # prctl(2)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x8000000, 0x20000000, 0x40000000  # unshare(2)
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18  # mount(2)


# ---- the trainer's side ------------------------------------------------------------------------


def run(argv: list, cwd: str, output, wall_seconds: float, limits: dict) -> dict:
    """Run ``argv`` in ``cwd`` under a supervisor, its stdout and stderr into the file ``output``,
    for at most ``wall_seconds``, with ``limits`` (``{"cpu", "memory", "file"}``: rlimits). Returns
    ``{"status": the wait status or None, "stopped": None, "time" or "processes", "isolated": bool}``."""
    cgroup = make_cgroup()
    request = dict(argv=argv, wall=wall_seconds, limits=limits, cgroup=cgroup and str(cgroup), isolate=ISOLATE)
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
        return {"status": None, "stopped": "supervisor", "isolated": False}


@functools.lru_cache(maxsize=None)
def isolated() -> bool:
    """Whether this machine lets the supervisor isolate the code (namespaces and a uid of its own):
    asked of one empty call, once."""
    with tempfile.TemporaryDirectory(prefix="fastppo-python-") as here, open(os.devnull, "wb") as sink:
        return run([sys.executable, "-I", "-c", ""], here, sink, 30, {"cpu": 5, "memory": 1 << 30, "file": 0})[
            "isolated"
        ]


def isolation() -> str:
    """What the python tool isolates on this machine, in one line for the run's start-up."""
    if isolated():
        return (
            "python tool: isolated (a uid of its own; PID, mount and network namespaces): its code sees no "
            "process of the trainer and has no network"
        )
    return (
        "python tool: NOT isolated here (it needs root and namespaces): its code runs as this user, can read "
        "the trainer's environment through /proc, reach the network and signal this user's processes; run "
        "untrusted policies in a container or a VM"
    )


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


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, call: str) -> None:
    """An ``OSError`` naming ``call`` when a libc call returned non-zero."""
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{call}: {os.strerror(errno)}")


def _subreaper() -> None:
    _check(_libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


def _mount(source, target: str, kind, flags: int, data=None) -> None:
    encode = lambda text: None if text is None else os.fsencode(text)  # noqa: E731
    _check(_libc().mount(encode(source), encode(target), encode(kind), flags, encode(data)), f"mount {target}")


def _unshare() -> bool:
    """New mount, IPC and network namespaces for this process, and a PID namespace for its next
    child; False where the machine refuses them (not root, a seccomp filter, a kernel without)."""
    if os.geteuid() != 0:
        return False
    try:
        _check(_libc().unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWPID), "unshare")
    except OSError:
        return False
    return True


def _blocked_ancestors(path: str) -> list:
    """The directories above ``path`` that only their owner may enter, outermost first."""
    blocked, parts = [], Path(path).resolve().parts
    for depth in range(2, len(parts)):
        directory = Path(*parts[:depth])
        if not directory.stat().st_mode & 0o001:
            blocked.append(str(directory))
    return blocked


def _prepare_namespace() -> None:
    """In the namespaces' init, as root: a /proc of this PID namespace, and the interpreter
    reachable by any uid (a directory on its way only root may enter covered by an empty tmpfs,
    the interpreter's prefixes bound back in)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the trainer's mounts
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    paths = {str(Path(p).resolve()) for p in (sys.base_prefix, sys.prefix, sys.executable)}
    prefixes = {p for p in paths if not any(p.startswith(q + "/") for q in paths)}  # the outermost
    covered = set()
    for prefix in sorted(prefixes):
        for blocked in _blocked_ancestors(prefix):
            if any(blocked == c or blocked.startswith(c + "/") for c in covered):
                continue
            inside = [p for p in prefixes if p.startswith(blocked + "/")]
            held = {p: os.open(p, os.O_PATH) for p in inside}  # reachable once the tmpfs covers them
            _mount("tmpfs", blocked, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
            for path, fd in held.items():
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.makedirs(path, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    Path(path).touch()
                _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
                os.close(fd)
            covered.add(blocked)


def _processes_of(uid: int) -> int:
    """The tasks (threads included, as RLIMIT_NPROC counts them) whose real uid is ``uid``."""
    count = 0
    for entry in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{entry}/status").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) == uid:
                count += len(os.listdir(f"/proc/{entry}/task"))
    return count


def _start(argv: list, limits: dict, cgroup, uid) -> subprocess.Popen:
    """The code, as ``uid`` (None: as this process's user) with its limits, in ``cgroup``."""
    processes = MAX_PROCESSES if uid is not None else _processes_of(os.getuid()) + MAX_PROCESSES

    def prepare():  # in the child, before the code starts
        import resource

        if cgroup is not None:
            Path(cgroup, "cgroup.procs").write_text("0")  # this process, and so all it starts
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu"], limits["cpu"] + 1))  # SIGXCPU, then SIGKILL
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file"], limits["file"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))  # counted per real uid
        if uid is not None:  # last: after it, nothing above may be undone
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=subprocess.STDOUT, preexec_fn=prepare
    )


def watch(request: dict, uid) -> dict:
    """Run the request's code as ``uid`` (None: this process's user) and watch its tree until it
    ends, its wall clock runs out or it runs too many processes; then kill the tree."""
    me, cgroup = os.getpid(), request["cgroup"]
    code = _start(request["argv"], request["limits"], cgroup, uid)
    deadline, watched, status, stopped = time.monotonic() + request["wall"], 0.0, None, None
    while status is None:
        status = _reap().get(code.pid)  # orphans of the tree are reaped too
        now = time.monotonic()
        if status is not None:
            break
        if now >= deadline:
            stopped = "time"
            break
        if now - watched >= WATCH_SECONDS:
            watched = now
            if len(descendants(me)) > MAX_PROCESSES:
                stopped = "processes"
                break
        time.sleep(POLL_SECONDS)
    tree = (lambda: descendants(me)) if cgroup is None else (lambda: descendants(me) | cgroup_pids(Path(cgroup)))
    kill_all(tree)
    code.returncode = 0  # reaped here, not by Popen
    return {"status": status, "stopped": stopped}


def supervise(request: dict) -> dict:
    """Run the request's code as this module's docstring says; what happened."""
    if not (request["isolate"] and _unshare()):
        _subreaper()
        return {**watch(request, uid=None), "isolated": False}
    uid = random.SystemRandom().randint(*SANDBOX_UIDS)
    os.chown(".", uid, uid)  # the code's directory becomes its own
    report_read, report_write = os.pipe()
    init = os.fork()  # the PID namespace's first process
    if init == 0:
        try:
            os.close(report_read)
            _check(_libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
            _prepare_namespace()
            os.write(report_write, json.dumps({**watch(request, uid), "isolated": True}).encode())
        finally:
            os._exit(0)  # and with it, every process left in the namespace
    os.close(report_write)
    with os.fdopen(report_read, "rb") as pipe:
        report = pipe.read()
    os.waitpid(init, 0)
    try:
        return json.loads(report)
    except ValueError:  # the init failed before it reported (its error is on stderr)
        return {"status": None, "stopped": "supervisor", "isolated": True}


if __name__ == "__main__":
    print(json.dumps(supervise(json.loads(sys.argv[1]))), flush=True)
