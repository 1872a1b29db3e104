"""Supervision: one child process kept alive, the unit every `Procfile` line runs.

honcho stops every process as soon as any one exits, so a process that crashes (a segfaulting
env, the OOM killer, kill -9) must not be a Procfile process itself: its supervisor is, and it
outlives the child. `stepbus supervise ROLE [FLAGS]` runs any role this way; the trainer slot
(trainer/slot.py) is a supervisor of learners that also swaps them.

The rule is the same for every child: one that dies is restarted, at once if it had run
STEADY_S, otherwise after the next BACKOFF_S delay, and one that hangs counts as dead (it beats
through a pipe, `node.SupervisorBeat`: silent for SILENT_S, or for half that while it is not
running at all, it is SIGKILLed, except that one stopped by a signal is continued); after
QUICK_DEATHS_LIMIT quick deaths in a row the supervisor gives up, with the child's last error in
its figures (`stepbus status`) and its log. Giving up ends the supervisor with exit code 1 (so
honcho stops the run, which cannot go on without that role) unless the child is one of many (a
worker) or beside the training path (the evaluator): then it stays, reporting, and the run goes
on without it. A child that exits 2 (`exits.Exit.SETTING`) refused a setting that every
restart would refuse again: the supervisor gives up at once and exits 2 itself, a worker's too;
but with flags an earlier child ran STEADY_S with (and did not leave with a 2), it is a passing
failure (an env whose simulator does not answer yet), restarted with the back-off like any
death. A child that exits 0 left on purpose (a shutdown, a signal), and so does its
supervisor. A child's stderr passes through the supervisor, which keeps its last line as the
child's last error; the child gets SIGTERM if the supervisor dies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import os
import signal
import socket as pysocket
import subprocess
import sys
import time
import traceback
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from stepbus.bus import launch, node, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.exits import Exit, SettingError
from stepbus.early_signals import EARLY_SIGNALS

BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # restart delays after quick deaths
STEADY_S = 30.0  # a child that ran this long before dying is restarted at once
QUICK_DEATHS_LIMIT = 7  # quick deaths in a row, then give up (about 49 s of back-off)
STOP_GRACE_S = 4.0  # then SIGKILL; honcho's own SIGKILL comes 5 s after its SIGTERM
SHUTDOWN_WAIT_S = 20.0  # a child told of a shutdown gets this long to leave before SIGTERM
STARTUP_GRACE_S = 30.0  # before its first beat (imports, a slow disk), a child is not frozen
SILENT_S = 3.0  # after it: this long without a beat, and a beating child is frozen (default)
# Half the allowance (the liveness bound by default, and never less) is enough for a child
# that is not running: stopped (by a signal: continued instead; by a tracer), or asleep with
# no CPU used across two looks STUCK_LOOK_S apart (a deadlock, a wait that never ends). A
# healthy loop writes a beat every 0.5-0.7 s (it looks every poll, 200 ms at most) and long
# calls beat from a thread, so only a child busy on the CPU (one long call, starved on a
# loaded machine, collecting garbage) needs the rest of the allowance. Where /proc cannot
# tell (not Linux), the whole allowance applies.
STUCK_SHARE = 0.5
STUCK_LOOK_S = 0.25  # between the two: how often a silent child is looked at again
NO_PIDFD_LOOK_S = 0.05  # without a pidfd to wake on its exit, look at the child this often
LAST_ERROR_CHARS = 300  # of the child's last stderr line, kept as its last error
PASSING = (f" (a setting refused with the flags a child ran {STEADY_S:g}s with before: taken "
           "for a passing failure, a simulator or licence server not answering, say)")


class Child(enum.Enum):
    """Where the supervised child is in its life."""

    WAITING = "waiting"  # none running: the "restart" timer starts the next
    RUNNING = "running"  # running (beating, or in its start-up grace, if it beats)
    STOPPING = "stopping"  # asked to stop by a signal; SIGKILL after the grace
    GAVE_UP = "gave up"  # died young too often: not started again


class GiveUp(enum.Enum):
    """What a supervisor does once it gives up on its child."""

    EXIT = "exit"  # exit 1 (2 for a setting): the run cannot go on without this role
    STAY = "stay"  # keep reporting the last error: the run goes on with the child's peers


class ChildProcess(typing.Protocol):
    """What a supervisor uses of its child's process: a `subprocess.Popen`, or `Forked`."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class Forked:
    """A child forked without exec (`fork_first`), seen through the part of Popen's interface
    a supervisor uses; its exit code is Popen's (negative: the signal that killed it)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None  # type: int, int | None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is lost, count a death
                self.returncode = 1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class Running:
    """The running child: its process, the pipe its stderr comes through, and (for a child
    that beats) the pipe it writes a byte to every heartbeat interval."""

    popen: ChildProcess
    started: float
    stderr: int  # read end of the child's stderr
    args: tuple[str, ...] = ()  # its flags
    beats: int | None = None
    last_beat: float | None = None
    cpu_seen: tuple[float, int] | None = None  # (when, its CPU ticks) at a look in a silence
    said_started: bool = False  # it wrote STARTED
    killed_frozen: bool = False  # SIGKILLed for falling silent: how its death is told
    resumed: bool = False  # continued after a stop and not heard since (`Supervisor.resume`)
    pidfd: int | None = None  # readable when the process exits (Linux), so no polling
    partial: bytes = b""  # the stderr line still being written

    def close(self) -> None:
        for fd in (self.pidfd, self.beats, self.stderr):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def fds(self) -> set[int]:
        """What wakes the supervisor: a beat, stderr output, the exit (when a pidfd tells)."""
        return {fd for fd in (self.beats, self.pidfd, self.stderr) if fd is not None}

    def silent_for(self, now: float, silent_s: float) -> float:
        """Seconds past the allowance since the last sign of life (> 0: frozen)."""
        if self.last_beat is None:
            return now - self.started - STARTUP_GRACE_S
        return now - self.last_beat - silent_s

    def not_running(self, now: float) -> str:
        """How the child is not running ("" if it is, or cannot be told yet): stopped (by a
        signal: STOPPED; by a tracer), or asleep without any CPU used since a look at least
        STUCK_LOOK_S ago in this silence."""
        state, ticks = process_state(self.popen.pid)
        if state == "T":
            return STOPPED
        if state == "t":
            return "stopped by a tracer"
        if ticks is None or self.cpu_seen is None or self.cpu_seen[1] != ticks:
            self.cpu_seen = None if ticks is None else (now, ticks)  # the first look, or CPU used
            return ""
        if state == "S" and now >= self.cpu_seen[0] + STUCK_LOOK_S:
            return "asleep without using the CPU"
        return ""


STOPPED = "stopped"  # by a signal (SIGSTOP, SIGTSTP): resumed, not killed


def stuck_after(silent_s: float) -> float:
    """The silence after which a child that is not running is stuck: half the allowance
    `silent_s`, never under the liveness bound nor over the allowance."""
    return min(silent_s, max(silent_s * STUCK_SHARE, node.LIVENESS_S))


def process_state(pid: int) -> tuple[str, int | None]:
    """A process's scheduler state letter (its main thread's) and its CPU clock ticks (user +
    system, every thread's; 10 ms each, so "none used" means under 10 ms), from
    /proc/PID/stat; ("", None) where there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the name, which may hold spaces
        return fields[0].decode(), int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return "", None


@dataclass
class Figures:
    starts: int = 0
    deaths: int = 0  # deaths not asked for (a swap's stop or a shutdown is not one)
    frozen: int = 0
    resumed: int = 0  # found stopped by a signal, and continued (SIGCONT)
    quick_deaths: int = 0  # in a row, of children that did not run STEADY_S
    last_death: str = ""
    last_error: str = ""  # the child's last stderr line


def describe_exit(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def restart_delay(quick_deaths: int, code: int) -> float:
    """How long to wait before the next child, after `quick_deaths` deaths in a row of
    children that did not run STEADY_S; one that left on its own (exit 0) waits at least 1 s,
    as a shutdown may be coming."""
    delay = BACKOFF_S[min(quick_deaths, len(BACKOFF_S) - 1)]
    return max(delay, 1.0) if code == 0 else delay


@dataclass
class ChildPipes:
    """The pipes a child is started with: its stderr, and its beats when `beat_env` names the
    environment variable that tells it the pipe's write end."""

    err_read: int
    err_write: int
    beat_env: str = ""
    beats: int | None = None
    beat_end: int | None = None

    @classmethod
    def open(cls, beat_env: str) -> ChildPipes:
        pipes = cls(*os.pipe(), beat_env=beat_env)
        if beat_env:
            pipes.beats, pipes.beat_end = os.pipe()
        return pipes

    def child_ends(self) -> tuple[int, ...]:
        return tuple(fd for fd in (self.err_write, self.beat_end) if fd is not None)

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.beat_env:
            env[self.beat_env] = str(self.beat_end)
        return env

    def close(self, fds: tuple[int | None, ...]) -> None:
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def close_all(self) -> None:
        """Both ends of every pipe: the child was never started."""
        self.close((*self.child_ends(), self.err_read, self.beats))

    def running(self, process: ChildProcess, now: float) -> Running:
        """The parent's side once the child has its ends (closed here)."""
        self.close(self.child_ends())
        os.set_blocking(self.err_read, False)
        if self.beats is not None:
            os.set_blocking(self.beats, False)
        pidfd = None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(process.pid)
        return Running(process, now, self.err_read, beats=self.beats, pidfd=pidfd)


def single_threaded() -> bool:
    """Whether this process has one thread, native ones counted (ZeroMQ's I/O threads): only
    then is a fork without exec safe."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # no procfs: do not guess
        return False


def fork_first(entry: Callable[[], int], beat_env: str, now: float) -> Running | None:
    """Start the first child as a fork of this process, before the supervisor opens a socket:
    the role's modules are imported already (checking its flags imported them), so the child
    starts without a second interpreter's imports (0.3 s of CPU each, ten of them contending
    for two cores at a honcho start). Restarts exec a fresh interpreter (`start_child`), which
    picks up changed code. None when forking is not safe here (threads) or fails."""
    if EARLY_SIGNALS:
        return None  # signalled while importing: the supervisor is stopping, so is a child
    if not single_threaded():
        logging.getLogger("stepbus.supervisor").info(
            "starting the child in a new interpreter: this process has threads already (a "
            "BLAS or OpenMP thread count above 1?), and forking them is not safe")
        return None
    pipes = ChildPipes.open(beat_env)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child would write our buffered output again
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        pipes.close_all()
        return None
    if pid == 0:
        _run_forked(entry, pipes, parent)
    return pipes.running(Forked(pid), now)


def _run_forked(entry: Callable[[], int], pipes: ChildPipes, parent: int) -> typing.NoReturn:
    """The forked child: the pipes in place of the exec'd child's, the role run, never a
    return into the supervisor's code."""
    code = 1
    try:
        launch.die_with_parent(parent)
        pipes.close((pipes.err_read, pipes.beats))
        os.dup2(pipes.err_write, 2)
        os.close(pipes.err_write)
        if pipes.beat_env:
            os.environ[pipes.beat_env] = str(pipes.beat_end)
            node.supervisor_beat.cache_clear()  # the supervisor's own (none) was forked too
        code = entry()
    except SettingError as exc:  # told as the command would tell it
        print(exc, file=sys.stderr)
        code = Exit.SETTING
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # the crash, told on stderr as an exec'd child's would be
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF if isinstance(code, int) else 1)  # never back into our code


class Supervisor(node.Process):
    """Sends nothing but heartbeats. The child is watched in `tick` (its stderr, its beats, its
    exit) and by timers: "restart" (start the next child), "silence" (kill a frozen one),
    "kill" (the end of a stop's grace), "shutdown" (a child that outstays a shutdown)."""

    role = "supervisor"
    noun = "child"  # how logs and figures name the child

    def __init__(self, ports: node.Ports, log: logging.Logger, *, name: str,
                 command: list[str], args: list[str], give_up: GiveUp = GiveUp.EXIT,
                 beat_env: str = "", quick_deaths_limit: int = QUICK_DEATHS_LIMIT,
                 silent_s: float = SILENT_S, noun: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`command` runs the child before its flags `args`; `beat_env` names the environment
        variable that tells a beating child its pipe ("": the child does not beat); a beating
        child silent for `silent_s` is frozen (0: never), and one silent for half that that is
        not running at all is stuck (`stuck_after_s`)."""
        super().__init__(ports, log, name=name, clock=clock)
        self.noun = noun or self.noun
        self.command, self.args = list(command), list(args)
        self.give_up_rule, self.beat_env = give_up, beat_env
        self.quick_deaths_limit, self.silent_s = quick_deaths_limit, silent_s
        self.proven: set[tuple[str, ...]] = set()  # flags children ran STEADY_S with, and left
        self.running: Running | None = None
        self.child = Child.WAITING
        self.leaving = ""  # why the supervisor is stopping ("": it is not)
        self.shutting_down = ""  # the run's shutdown, heard: the child leaves, none is restarted
        self.counts = Figures()
        self.gave_up_exit: Exit | None = None  # gave up and stops: the supervisor's exit code
        self.at("restart", self.now, self.start_child)

    # -- the child's life
    def start_child(self, now: float) -> None:
        pipes = ChildPipes.open(self.beat_env)
        self.counts.last_error = ""  # this child's, not an earlier one's
        try:
            # in our process group, not a session of its own: honcho's signal reaches both
            popen = launch.spawn([*self.command, *self.args], new_session=False,
                                 env=pipes.child_env(), stderr=pipes.err_write,
                                 pass_fds=pipes.child_ends())
        except (OSError, subprocess.SubprocessError) as exc:  # no memory or pids left, say
            pipes.close_all()
            self.could_not_start(exc, now)
            return
        self.begin(pipes.running(popen, now), now)

    def adopt(self, run: Running) -> None:
        """Take on the first child, forked before the supervisor's sockets existed
        (`fork_first`), as if `start_child` had started it."""
        self.cancel("restart")
        self.begin(run, self.now, how=", forked")

    def begin(self, run: Running, now: float, how: str = "") -> None:
        self.counts.starts += 1
        self.log.info("%s started (pid %d%s)%s", self.noun, run.popen.pid, how,
                      f" with {' '.join(self.args)}" if self.args else "")
        self.running = run
        run.args = tuple(self.args)
        self.child = Child.RUNNING
        self.wake_on_readable_fds = run.fds()
        if run.beats is not None and self.silent_s > 0:
            self.at("silence", now + STARTUP_GRACE_S, self.check_silence)
        self.child_started(now)

    def child_started(self, now: float) -> None:
        """A hook for subclasses: a child was just started."""

    def child_said_started(self, now: float) -> None:
        """A hook for subclasses: the child wrote STARTED (a learner does once its settings,
        model and checkpoint are taken)."""

    def could_not_start(self, exc: Exception, now: float) -> None:
        """Starting a child failed (fork or exec): a quick death, with the same back-off."""
        self.counts.last_error = f"cannot start: {type(exc).__name__}: {exc}"[:LAST_ERROR_CHARS]
        self.log.error("%s could not be started: %s", self.noun, self.counts.last_error)
        self.counts.deaths += 1
        self.counts.last_death = "not started"
        self.counts.quick_deaths += 1
        if self.counts.quick_deaths >= self.quick_deaths_limit:
            self.give_up(0.0)
        else:
            self.at("restart", now + restart_delay(self.counts.quick_deaths, 1), self.start_child)

    def tick(self, now: float) -> float:
        """Pass the child's stderr on, take its beats, notice its exit; without a pidfd, look
        again soon."""
        run = self.running
        if run is None:
            return math.inf
        self.pass_stderr(run)
        self.take_beats(run, now)
        if (code := run.popen.poll()) is not None:
            self.pass_stderr(run, final=True)
            self.child_exited(run, code, now)
            return math.inf
        return math.inf if run.pidfd is not None else now + NO_PIDFD_LOOK_S

    def take_beats(self, run: Running, now: float) -> None:
        """Read what the child wrote on its beat pipe since the last look."""
        if run.beats is None:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            if beats := os.read(run.beats, 4096):
                if run.last_beat is None and not self.leaving and self.silent_s > 0:
                    self.at("silence", now + self.stuck_after_s,
                            self.check_silence)  # grace over
                run.last_beat, run.cpu_seen, run.resumed = now, None, False
                if node.STARTED in beats and not run.said_started:
                    run.said_started = True
                    self.child_said_started(now)

    def pass_stderr(self, run: Running, *, final: bool = False) -> None:
        """Write the child's stderr through to ours and keep its last line."""
        data, eof = b"", False
        with contextlib.suppress(BlockingIOError, OSError):
            while chunk := os.read(run.stderr, 65536):
                data += chunk
                if len(data) > 1 << 20:
                    break
            else:
                eof = True  # the child closed its stderr: stop polling it
        if eof and run.stderr in self.wake_on_readable_fds:
            self.wake_on_readable_fds = self.wake_on_readable_fds - {run.stderr}
        if data:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.buffer.write(data)
                sys.stderr.flush()
        lines = (run.partial + data).split(b"\n")
        run.partial = lines.pop()[-4096:]
        if final:
            lines.append(run.partial)
        for line in reversed(lines):
            if text := line.decode(errors="replace").strip():
                self.counts.last_error = text[-LAST_ERROR_CHARS:]
                break

    def on_stalled(self, seconds: float) -> None:
        """We did not run ourselves (stopped, starved of CPU): the child's silence meanwhile is
        not its own, so it gets a new allowance."""
        run = self.running
        if run is not None and run.last_beat is not None:
            run.last_beat, run.cpu_seen = max(run.last_beat, self.now), None
        elif run is not None:
            run.started += seconds  # its start-up grace, too

    def check_silence(self, now: float) -> None:
        run = self.running
        if run is None or run.killed_frozen or self.leaving or self.shutting_down:
            return  # a child leaving on a shutdown has the shutdown's own bound
        self.take_beats(run, now)  # written while this timer was due: not silence
        over = run.silent_for(now, self.silent_s)
        # Stopped is looked for first: with an allowance no longer than the liveness bound, a
        # stopped child is past both at once, and it is to be continued, not killed.
        stuck = self.stuck(run, now)
        if not stuck and over <= 0:
            stuck_at = math.inf if run.last_beat is None else run.last_beat + self.stuck_after_s
            self.at("silence", min(now - over, stuck_at if stuck_at > now else
                                   now + STUCK_LOOK_S), self.check_silence)
            return
        silent = now - (run.last_beat or run.started)
        if stuck == STOPPED and not run.resumed:
            self.resume(run, silent, now)
            return
        how = ("(frozen?)" if not stuck else
               "and is stopped again, unheard since it was continued" if stuck == STOPPED else
               f"and is {stuck}")
        self.counts.frozen += 1
        run.killed_frozen = True
        self.log.warning("%s (pid %d) sent no heartbeat for %.1fs %s; killing it",
                         self.noun, run.popen.pid, silent, how)
        run.popen.kill()  # SIGKILL also ends a stopped (SIGSTOP) process

    def resume(self, run: Running, silent: float, now: float) -> None:
        """A child stopped by a signal (SIGSTOP, SIGTSTP) goes on where it stopped, with what
        it holds (an assembler's open trajectories, a broker's requests in flight): killing it
        lost them all, and its successor took longer to start than a continued child takes to
        catch up. Its allowance runs on from its last beat; stopped again before it beats, it
        is killed (something keeps stopping it), as it is once silent past the allowance."""
        self.counts.resumed += 1
        self.log.warning("%s (pid %d) sent no heartbeat for %.1fs and is stopped; resuming it "
                         "(SIGCONT)", self.noun, run.popen.pid, silent)
        with contextlib.suppress(ProcessLookupError):
            run.popen.send_signal(signal.SIGCONT)
        run.resumed, run.cpu_seen = True, None
        self.at("silence", now + STUCK_LOOK_S, self.check_silence)

    @property
    def stuck_after_s(self) -> float:
        return stuck_after(self.silent_s)

    def stuck(self, run: Running, now: float) -> str:
        """How a child silent for `stuck_after_s` is not running at all ("": it is, or it is
        not that silent yet; `Running.not_running`)."""
        if run.last_beat is None or now < run.last_beat + self.stuck_after_s:
            return ""
        return run.not_running(now)

    def ask_to_stop(self, run: Running, sig: signal.Signals, now: float) -> None:
        if self.child is not Child.STOPPING:
            self.child = Child.STOPPING
            with contextlib.suppress(ProcessLookupError):
                run.popen.send_signal(sig)
            self.at("kill", now + STOP_GRACE_S, self.kill_after_grace)

    def kill_after_grace(self, now: float) -> None:
        if self.running is None:
            return
        if self.leaving:
            self.log.warning("%s did not stop within %gs; killing it", self.noun, STOP_GRACE_S)
        self.running.popen.kill()
        self.at("kill", now + 60, self.kill_after_grace)

    def child_exited(self, ended: Running, code: int, now: float) -> None:
        asked = self.child is Child.STOPPING
        if now - ended.started >= STEADY_S and code != Exit.SETTING:
            self.proven.add(ended.args)  # these flags work (a swap's stop is proof too)
        self.running, self.child = None, Child.WAITING
        ended.close()
        self.wake_on_readable_fds = set()
        for name in ("silence", "kill", "shutdown"):
            self.cancel(name)
        if self.leaving or self.shutting_down:
            self.log.info("%s stopped (%s)", self.noun, describe_exit(code))
            self.stop(self.leaving or self.shutting_down)
        else:
            self.exited_unasked(ended, code, now, asked)

    def exited_unasked(self, ended: Running, code: int, now: float, asked: bool) -> None:
        """The child exited while the supervisor is not leaving: one that exits 0 left on
        purpose, and so do we; any other exit is a death."""
        if code == 0:
            self.log.info("%s exited 0; stopping", self.noun)
            self.stop(f"{self.noun} exited 0")
        else:
            self.died(ended, code, now)

    def died(self, ended: Running, code: int, now: float) -> None:
        ran = now - ended.started
        self.counts.deaths += 1
        self.counts.last_death = "frozen, killed" if ended.killed_frozen else describe_exit(code)
        self.counts.quick_deaths = 0 if ran >= STEADY_S else self.counts.quick_deaths + 1
        passing = code == Exit.SETTING and ended.args in self.proven
        if code == Exit.SETTING and not passing:  # every restart would refuse it again
            self.give_up(ran, exit_anyway=True)
            return
        if self.counts.quick_deaths >= self.quick_deaths_limit:
            self.give_up(ran)
            return
        delay = restart_delay(self.counts.quick_deaths, code)
        self.at("restart", now + delay, self.start_child)
        self.log.warning("%s (pid %d) %s after %.1fs%s; starting a new one%s%s", self.noun,
                         ended.popen.pid, self.counts.last_death, ran, self.last_error_text(),
                         f" in {delay:g}s" if delay else "", PASSING if passing else "")

    def last_error_text(self) -> str:
        return f" (last error: {self.counts.last_error})" if self.counts.last_error else ""

    def give_up(self, ran: float, *, exit_anyway: bool = False) -> None:
        """No more restarts. `exit_anyway`: a setting is wrong (exit code 2), which the same
        flags give every peer of a worker too, so even a worker's supervisor exits, with 2."""
        self.child = Child.GAVE_UP
        staying = self.give_up_rule is GiveUp.STAY and not exit_anyway
        reason = ("exited 2: a setting is wrong (see its log above); restarting cannot help"
                  if exit_anyway else
                  f"died {self.counts.quick_deaths} times in a row, each within {STEADY_S:g}s "
                  f"of its start")
        self.log.error("%s %s (last: %s after %.1fs%s); giving up%s", self.noun, reason,
                       self.counts.last_death, ran, self.last_error_text(),
                       "" if staying else ": the run cannot go on without it")
        if not staying:
            self.gave_up_exit = Exit.SETTING if exit_anyway else Exit.FAILED
            self.stop(f"gave up on the {self.noun}")

    @property
    def gave_up(self) -> bool:
        return self.child is Child.GAVE_UP

    # -- stopping
    def on_signal(self, reason: str) -> None:
        self.now = self.clock()
        self.leave(reason)

    def on_shutdown(self, peer: bytes, msg: p.Shutdown) -> None:
        self.leave_after_shutdown(msg.reason)

    def on_run_state(self, peer: bytes, msg: p.RunState) -> None:
        self.run_state = msg
        if msg.shutting_down:
            self.leave_after_shutdown("controller shutdown")

    def leave_after_shutdown(self, reason: str) -> None:
        """The child heard the same shutdown and leaves by itself; it gets SIGTERM only if it
        outstays SHUTDOWN_WAIT_S. Nothing is restarted from now on."""
        if self.leaving or self.shutting_down:
            return
        self.shutting_down = reason
        self.cancel("restart")
        if self.running is None:
            self.leave(reason)
        else:
            self.at("shutdown", self.now + SHUTDOWN_WAIT_S, lambda now: self.leave(reason))

    def leave(self, reason: str) -> None:
        """Stop the child (it finishes its duties); the loop ends once it has exited."""
        if self.leaving:
            return
        self.leaving = reason
        for name in ("restart", "silence", "shutdown"):
            self.cancel(name)
        if self.running is None:
            self.stop(reason)
        else:
            self.ask_to_stop(self.running, signal.SIGTERM, self.now)

    def kill_child(self) -> None:
        """The last resort, when the loop ended without the child's exit."""
        if self.running is not None:
            if self.running.popen.poll() is None:
                self.running.popen.kill()
                self.running.popen.wait(5)
            self.pass_stderr(self.running, final=True)
            self.running.close()

    def state(self) -> str:
        if self.leaving:
            return "stopping"
        if self.gave_up:
            return "gave up"
        return "running" if self.running else "restarting"

    def figures(self) -> dict[str, Any]:
        figures: dict[str, Any] = {
            "child_pid": self.running.popen.pid if self.running else None,
            "child": " ".join(self.command[-1:]), **dataclasses.asdict(self.counts),
            "state": self.state()}
        if self.rejects.total:
            figures.update(self.rejects.figures())
        return figures

    def finish(self) -> None:
        self.log.info("%s stopping (%s)", self.role, self.leaving or self.stop_reason)


SUPERVISED_ROLES = ("controller", "broker", "worker", "assembler", "learner", "evaluator")


def default_give_up(role: str) -> GiveUp:
    """A worker is one of many, and an evaluator is beside the training path: the run goes on
    without either. Without any other role it cannot."""
    return GiveUp.STAY if role in ("worker", "evaluator") else GiveUp.EXIT


def default_silence(role: str) -> float:
    """The evaluator runs at idle priority (`--cpu-priority idle`) so as not to slow training:
    starved of CPU while the others work is its design, not a freeze, so it is not judged by
    its silence. Every other role is, after SILENT_S."""
    return 0.0 if role == "evaluator" else SILENT_S


def run(role: str, flags: list[str], *, controller: str, security: wiring.Security,
        give_up: GiveUp, quick_deaths_limit: int = QUICK_DEATHS_LIMIT,
        silent_s: float = SILENT_S, entry: Callable[[], int] | None = None) -> int:
    """Supervise `stepbus ROLE FLAGS` until it exits 0, we are signalled, or we give up (exit 1
    with GiveUp.EXIT; exit 2 at once when the child exited 2 with flags no child ran STEADY_S
    with). The supervisor reports to the controller at `controller` as role "supervisor", named
    like its child; a child silent for `silent_s` (0: never judged), or for half that while it
    is not running at all, is frozen and killed (one stopped by a signal is continued).
    `entry` runs the role in this interpreter: given, the first child is a fork that calls it
    (`fork_first`)."""
    log = node.setup_logging("supervisor")
    name = os.environ.get("HONCHO_PROCESS_NAME") or f"{role}-{pysocket.gethostname()}-{os.getpid()}"
    log.info("supervising %s %s: restarted if it dies%s, up to %d quick deaths in a row",
             role, name, f" or is silent for {silent_s:g}s ({stuck_after(silent_s):g}s if not "
             "running)" if silent_s > 0 else "",
             quick_deaths_limit)
    return serve(security, log, lambda ports: Supervisor(
        ports, log, name=name, command=launch.role_command(role), args=flags,
        give_up=give_up, beat_env=node.BEAT_FD_ENV, quick_deaths_limit=quick_deaths_limit,
        silent_s=silent_s, noun=role), role="supervisor", name=name, controller=controller,
        broadcast="", linger_ms=0 if role == "controller" else topology.LINGER_MS, entry=entry,
        beat_env=node.BEAT_FD_ENV)


def serve(security: wiring.Security, log: logging.Logger,
          build: Callable[[node.Ports], Supervisor], *, role: str, name: str, controller: str,
          broadcast: str, linger_ms: int = topology.LINGER_MS,
          entry: Callable[[], int] | None = None, beat_env: str = "") -> int:
    """Run a supervisor, built by `build` on its link to the controller (as `role` `name`), to
    the end: 1 if it gave up and stopped (2 if it gave up on a child's exit 2), else the loop's
    code; its child never outlives it.
    `linger_ms`: how long its last messages may wait for the controller. The controller's own
    supervisor passes 0: its controller has exited, so its leaving heartbeat would wait the
    whole linger for nobody, and it is the last process of every honcho run (0.5 s more).
    `entry` and `beat_env`: the first child forked, before any socket or thread exists."""
    forked = fork_first(entry, beat_env, time.monotonic()) if entry is not None else None
    ctx: zmq.Context | None = None
    sup: Supervisor | None = None
    try:
        stop = node.StopFlag()
        ctx = wiring.context(security)
        link = node.ControllerLink(ctx, role=role, name=name, controller=controller,
                                   broadcast=broadcast, log=log)
        sup = build(node.SocketPorts({"controller": link.dealer}))
        if forked is not None:
            sup.adopt(forked)
            forked = None
        code = node.Loop(sup, {}, link, stop).run()
        return sup.gave_up_exit if sup.gave_up_exit is not None else code
    finally:
        if sup is not None:
            sup.kill_child()
        if forked is not None:  # setting the supervisor up failed
            forked.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                forked.popen.wait(5)
            forked.close()
        if ctx is not None:
            wiring.destroy(ctx, linger_ms)
