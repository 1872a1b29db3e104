"""A fork server for stepbus roles: one process that has imported what the roles import
(numpy, pyzmq, msgpack, gymnasium and stepbus's process modules) and forks a child for each
role asked of it, so a role starts in milliseconds instead of spending 0.3-0.5 s of CPU on
imports. For whoever starts many short-lived pipelines on few cores (the test suite starts
hundreds) or many vector envs (`stepbus.vector.make(..., context="forkserver")`);
`launch.Group(forkserver=...)` uses it for `start_role`.

Each child is a real process of its own, as `python -m stepbus ROLE` would be: its own session
and process group, the environment, working directory, stdin (/dev/null) and log it was given,
SIGTERM when the server dies (which gets SIGTERM when its starter dies), `stepbus.entry.main`
as its `__main__`, and its exit code or signal reported back. What differs: modules are
imported before the child's environment is set, so nothing here may read the environment at
import time (stepbus reads it when a command runs); /proc/PID/environ shows the server's
environment, not the child's (no exec), so a group finds forked strays by working directory,
not by an environment tag; and the server makes no thread and no ZeroMQ context before it
forks (a forked copy of a threaded process may deadlock).

Protocol: JSON lines. The starter writes `{"argv": [...], "env": {...}, "cwd": ..., "log":
..., "err": ...}` to the server's stdin and reads `{"pid": N}` for it; whenever a child ends,
the server writes `{"exit": N, "code": C}` (C as `Popen.returncode`: negative for a signal).
The server ends when its stdin closes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

from stepbus.bus import launch

PRELOAD = ("stepbus.single_thread_blas", "numpy", "zmq", "msgpack", "gymnasium",
           "stepbus.entry", "stepbus.cli", "stepbus.bus.controller", "stepbus.bus.broker",
           "stepbus.workers.worker", "stepbus.processor.assembler", "stepbus.trainer.learner",
           "stepbus.trainer.slot", "stepbus.bus.supervisor")
START_TIMEOUT_S = 30.0  # for the server to answer a start (it imports first: seconds)
SERVER_GONE = -signal.SIGTERM  # the code of a child whose server died before reporting it


# ------------------------------------------------------------------------------ the server


def serve() -> None:
    """Preload, then fork a child per request on stdin until stdin closes."""
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    pending, server = b"", os.getpid()
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap()
        if 0 not in ready:
            continue
        data = os.read(0, 65536)
        if not data:
            return
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            pid = os.fork()
            if pid == 0:
                _become(json.loads(line), (wake_r, wake_w), server)
            _reply({"pid": pid})


def _reply(message: dict[str, Any]) -> None:
    os.write(1, json.dumps(message).encode() + b"\n")


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(request: dict[str, Any], server_fds: tuple[int, int], server: int) -> NoReturn:
    """In the forked child: the role's process, as `python -m stepbus ARGV` would start."""
    from stepbus import entry

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in server_fds:
        os.close(fd)
    os.setsid()
    launch.die_with_parent(server)  # a server already gone is caught: the child leaves
    _redirect(request.get("log"), request.get("err"))
    # The server's own PYTHONPATH entries are judged from its directory, before the chdir.
    _set_path(os.environ.get("PYTHONPATH", ""), request["env"].get("PYTHONPATH", ""),
              request["cwd"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [str(Path(entry.__file__).with_name("__main__.py")), *request["argv"]]
    raise SystemExit(entry.main())


def _set_path(server_pythonpath: str, pythonpath: str, cwd: str) -> None:
    """sys.path as `python -m` makes it in `cwd` with the child's PYTHONPATH: the working
    directory, then PYTHONPATH's entries (relative ones from `cwd`), then the
    installation's (the server's own first entries replaced). Called in the server's
    directory, where its own relative entries were made absolute."""
    ours = {os.path.abspath(entry) for entry in server_pythonpath.split(os.pathsep) if entry}
    rest = [entry for entry in sys.path[1:] if os.path.abspath(entry) not in ours]
    theirs = [os.path.join(cwd, entry) for entry in pythonpath.split(os.pathsep) if entry]
    sys.path[:] = [os.path.abspath(cwd), *map(os.path.normpath, theirs), *rest]


def _redirect(log: str | None, err: str | None) -> None:
    """stdin from /dev/null, stdout to `log` (or /dev/null) and stderr there too, or to `err`
    if given, written through."""
    null = os.open(os.devnull, os.O_RDWR)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if log else null
    errors = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if err else out
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(errors, 2)
    for fd in {null, out, errors}:
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(write_through=True)  # type: ignore[union-attr]


# ------------------------------------------------------------------------------ the starter


class ForkServer:
    """A running fork server, started from the thread that should outlive its children (see
    `launch`'s docstring on PR_SET_PDEATHSIG). `start` returns a `Forked`, which answers as
    much of `subprocess.Popen` as `launch.Child` and its users need."""

    def __init__(self, env: Mapping[str, str] | None = None,
                 process: subprocess.Popen[bytes] | None = None) -> None:
        """`process`: a server already started (a test's stand-in for one)."""
        self.process = process or launch.spawn(
            [sys.executable, "-m", "stepbus.bus.forkserver"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env)
        self._request_lock = threading.Lock()
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._gone = False
        threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True,
                         name="forkserver-reader").start()

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            message = json.loads(line)
            with self._changed:
                if "pid" in message:
                    # A pid the kernel handed out again: its last holder's exit came before
                    # this reply (the server reaps before it forks), so it is not this child's.
                    # Dropped here, in the stream's order: a child that exits at once has its
                    # own exit read right after, maybe before `start` takes its pid.
                    self._exits.pop(message["pid"], None)
                    self._started.append(message["pid"])
                else:
                    self._exits[message["exit"]] = message["code"]
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()

    def start(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike[str],
              log: Path | None, err: Path | None = None) -> Forked:
        """`python -m stepbus ARGV` as a child of the server, its output to `log` (its stderr
        to `err` if given). Raises OSError if the server is gone or does not answer."""
        request = {"argv": list(argv), "env": dict(env), "cwd": os.fspath(cwd),
                   "log": None if log is None else os.fspath(log),
                   "err": None if err is None else os.fspath(err)}
        with self._request_lock:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            with self._changed:
                if not self._changed.wait_for(lambda: self._started or self._gone,
                                              START_TIMEOUT_S) or not self._started:
                    self._gone = True  # a late reply would be taken for the next start's
                    self.process.kill()
                    raise OSError("the fork server did not start the process")
                pid = self._started.pop(0)
        return Forked(self, pid, [sys.executable, "-m", "stepbus", *argv])

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code, waiting up to `timeout` s (None: for ever, 0: not at all)."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._gone, timeout)
            return self._exits.get(pid, SERVER_GONE if self._gone else None)

    def alive(self) -> bool:
        """Whether it still starts processes (not killed, not given up on)."""
        return not self._gone and self.process.poll() is None

    def close(self) -> None:
        """End the server (its children get SIGTERM) and wait for it."""
        with contextlib.suppress(OSError, ValueError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_SHARED: list[ForkServer] = []
_SHARED_LOCK = threading.Lock()


def shared() -> ForkServer:
    """This process's own fork server, started on first use and again if it died, ended at
    exit: what `stepbus.vector.make(..., context="forkserver")` and the test suite's clusters
    start their roles from."""
    with _SHARED_LOCK:
        if not _SHARED or not _SHARED[0].alive():
            if _SHARED:
                atexit.unregister(_SHARED.pop().close)
            _SHARED.append(started_from_keeper())
            atexit.register(_SHARED[0].close)
        return _SHARED[0]


def started_from_keeper() -> ForkServer:
    """A server started from a daemon thread that lives as long as this process: the kernel
    ends a child when the thread that started it exits (PR_SET_PDEATHSIG), and whoever asks
    first may be a short-lived thread."""
    started: queue.Queue[ForkServer | BaseException] = queue.Queue()

    def keep() -> None:
        try:
            started.put(ForkServer())
        except BaseException as exc:  # said in the asking thread
            started.put(exc)
            return
        threading.Event().wait()  # for ever: the server's parent thread

    threading.Thread(target=keep, daemon=True, name="forkserver-keeper").start()
    server = started.get()
    if isinstance(server, BaseException):
        raise server
    return server


class Forked:
    """A child of the fork server, as `subprocess.Popen` answers for one."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve()
