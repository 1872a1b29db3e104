"""Starting stepbus processes as children, and ending them: the one way the Procfile's
supervisors, `stepbus.vector.make`, the tests and the benchmarks all do it.

A role runs as `python -m stepbus ROLE FLAGS` with this interpreter (`role_command`), wired by
STEPBUS_* endpoint variables (`environment`). Each child leads a session, and so a process
group, of its own (`spawn`): a Ctrl-C in the starter's terminal reaches the starter only, and a
SIGKILL to the group reaches whatever the child started. On Linux a child gets SIGTERM when its
starter dies, even by SIGKILL (PR_SET_PDEATHSIG), so none outlives it.

`prctl` is looked up once, at import, never in the child between fork and exec: the starter may
run ZeroMQ's or torch's threads, and a forked copy of a threaded process may make only calls
that take no lock another thread could have held at the fork, which loading a library does.
PR_SET_PDEATHSIG fires when the thread that started the child ends, not the whole process:
start children from a thread that lives as long as they should.

A `Group` holds processes started together and ends them together (`stop`), leaving nothing
running: what its children started in sessions of their own (honcho's children), which no
process-group signal reaches, it finds by working directory or by an environment tag.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from stepbus.bus import wiring

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 5.0  # from SIGTERM to SIGKILL, for a whole group
KILLED_WAIT_S = 5.0  # for a SIGKILLed process to be reaped
NOT_INHERITED = frozenset({"HONCHO_PROCESS_NAME",
                           *(spec.env_var for spec in wiring.ENDPOINTS.values())})


def _lookup_prctl() -> Callable[..., int] | None:
    """libc's prctl, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL = _lookup_prctl()  # before any fork: see the module's docstring


def die_with_parent(parent: int) -> None:
    """In a child, after fork and before exec (or instead of exec): SIGTERM when `parent` dies.
    Calls only the prctl looked up before the fork. A parent that died before the prctl took
    effect is caught by the parent check, and the child leaves at once."""
    if _PRCTL is None:
        return
    if _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM) != 0 or os.getppid() != parent:
        os._exit(1)


def role_command(role: str, *args: str) -> list[str]:
    """The command line of a role: this interpreter, so the child runs the same stepbus."""
    return [sys.executable, "-m", "stepbus", role, *args]


def environment(endpoints: Mapping[str, str], runs_dir: str | os.PathLike[str] | None = None,
                extra: Mapping[str, str] | None = None,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: `base` (ours by default) with `endpoints` ({name: address}, names
    as in `wiring.ENDPOINTS`) as their STEPBUS_* variables, the runs directory, then `extra`.
    Inherited endpoint variables are dropped, so the children are wired only as told, never
    partly to a run the starter's shell points at; honcho's process name is not passed on."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in NOT_INHERITED}
    env.update({wiring.ENDPOINTS[name].env_var: address for name, address in endpoints.items()})
    if runs_dir is not None:
        env["STEPBUS_RUNS_DIR"] = os.fspath(runs_dir)
    env.update(extra or {})
    return env


def spawn(argv: Sequence[str], *, new_session: bool = True, with_parent: bool = True,
          **popen: Any) -> subprocess.Popen:
    """`argv` as a child process, leading a session of its own unless `new_session` is False
    (then it stays in our process group), sent SIGTERM when we die if `with_parent`; `popen`:
    any other `subprocess.Popen` arguments (env, cwd, stdout, pass_fds...)."""
    preexec = (functools.partial(die_with_parent, os.getpid())
               if with_parent and _PRCTL is not None else None)
    return subprocess.Popen(list(argv), start_new_session=new_session, preexec_fn=preexec,
                            **popen)


def find_processes(*, cwd: Path | None = None, tag: tuple[str, str] | None = None) -> list[int]:
    """Live processes but this one working in `cwd`, or whose environment holds `tag` (NAME,
    VALUE): how strays are found that no process-group signal reaches."""
    needle = f"{tag[0]}={tag[1]}".encode() if tag else None
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except (OSError, IndexError):  # gone meanwhile
            continue
        if _works_in(entry, cwd) or _carries(entry, needle):
            found.append(int(entry.name))
    return found


def _works_in(entry: Path, cwd: Path | None) -> bool:
    with contextlib.suppress(OSError):
        return cwd is not None and os.readlink(entry / "cwd") == str(cwd)
    return False


def _carries(entry: Path, needle: bytes | None) -> bool:
    with contextlib.suppress(OSError):
        return needle is not None and needle in (entry / "environ").read_bytes().split(b"\0")
    return False


class Running(Protocol):
    """What a group needs of a started process: a subprocess.Popen, or a fork server's
    stand-in for one."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


Process = TypeVar("Process", bound=Running)


class RoleStarter(Protocol):
    """Where a group may start its roles from instead of an interpreter each: a fork server
    (bus/forkserver.py's ForkServer, which imports this module)."""

    def start(self, argv: Sequence[str], *, env: Mapping[str, str],
              cwd: str | os.PathLike[str], log: Path | None) -> Running: ...


class Child(Generic[Process]):
    """One started process: its name, its Popen (or what a fork server answers for one), the
    file its output goes to (if any)."""

    def __init__(self, name: str, popen: Process, log_path: Path | None) -> None:
        self.name, self.log_path = name, log_path
        self.popen: Process = popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout=timeout)

    def signal(self, sig: int) -> None:
        """`sig` to the process, if it has not exited."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, sig)

    def output(self) -> str:
        """All it has written to its log so far ("" without one)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class Group:
    """Processes started together and ended together: a test's cluster, a vector env's
    processes, a benchmark's pipeline. `dir`: the working directory of its processes, by which
    `strays` finds what they started elsewhere; `tag_var`: an environment variable every
    process gets with this group's own value, found the same way."""

    def __init__(self, dir: Path | None = None, tag_var: str = "",
                 forkserver: RoleStarter | None = None) -> None:
        """`forkserver`: where `start_role` forks its roles from (bus/forkserver.py) instead
        of starting an interpreter for each."""
        if tag_var and forkserver is not None:
            raise ValueError("a forked process's /proc/PID/environ is its server's: a group "
                             "with a fork server finds strays by its directory, not a tag")
        self.dir = dir
        self.tag = (tag_var, uuid.uuid4().hex) if tag_var else None
        self.procs: list[Child[Any]] = []
        self.forkserver = forkserver

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        child_env = dict(os.environ if env is None else env)
        if self.tag is not None:
            child_env[self.tag[0]] = self.tag[1]
        return child_env

    def start(self, argv: Sequence[str], *, name: str = "", log: Path | None = None,
              env: Mapping[str, str] | None = None, **popen: Any
              ) -> Child[subprocess.Popen[Any]]:
        """`argv` started in the group (see `spawn`), in the group's directory unless `cwd` is
        given, its stdout and stderr written to `log` if given."""
        child_env = self._env(env)
        popen.setdefault("cwd", self.dir)
        if log is None:
            process = spawn(argv, env=child_env, **popen)
        else:
            with open(log, "wb") as out:  # the child has its own copy
                process = spawn(argv, env=child_env, stdout=out, stderr=subprocess.STDOUT,
                                **popen)
        return self._keep(Child(name or Path(argv[0]).name, process, log))

    def _keep(self, child: Child[Process]) -> Child[Process]:
        self.procs.append(child)
        return child

    def start_role(self, role: str, *args: str, name: str = "", log: Path | None = None,
                   env: Mapping[str, str] | None = None, prefix: Sequence[str] = (),
                   **popen: Any) -> Child[Any]:
        """A stepbus role; `prefix`: a command that runs it, e.g. ("ip", "netns", "exec", NS).
        Its stdin is /dev/null unless told: no role reads it, and it may be a terminal."""
        if self.forkserver is not None and not prefix and not popen:
            process = self.forkserver.start([role, *args], env=self._env(env),
                                            cwd=self.dir or Path.cwd(), log=log)
            return self._keep(Child(name or role, process, log))
        popen.setdefault("stdin", subprocess.DEVNULL)
        return self.start([*prefix, *role_command(role, *args)], name=name or role, log=log,
                          env=env, **popen)

    def strays(self) -> list[int]:
        """Live processes working in the group's directory or carrying its tag."""
        if self.dir is None and self.tag is None:
            return []
        return find_processes(cwd=self.dir, tag=self.tag)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """End every process and whatever it started: SIGCONT to its group (one may be frozen,
        by a test or a profiler), SIGTERM to it, which ends what it started (a supervisor its
        child); after `grace_s` for them all, SIGKILL to each group, then to the strays.
        Idempotent."""
        running = [child for child in self.procs if child.poll() is None]
        for child in running:
            _killpg(child.pid, signal.SIGCONT)
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(0.05, deadline - time.monotonic()))
        for child in running:  # a group whose leader we saw alive: its pgid is still ours
            _killpg(child.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(KILLED_WAIT_S)
        for pid in self.strays():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
