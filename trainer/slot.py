"""The trainer slot: what honcho's `trainer:` line runs. It keeps one learner process
(`stepbus learner`) alive, restarts it when it dies or freezes, replaces it on
`stepbus trainer swap`, and stops it on shutdown.

honcho tears every process down as soon as any one exits, so a learner that is killed or swapped
must not be a Procfile process itself: the slot is, and it outlives its learners. Each new
learner resumes the run's checkpoint with the next generation and a higher policy version; the
assembler keeps every trajectory until a learner has learned from it, so nothing is lost between.
The learner writes a byte to a pipe every heartbeat interval: a learner silent for
`LEARNER_SILENT_S` is frozen and is killed, and a learner whose pipe breaks knows its slot died.
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stepbus.bus import node, wiring
from stepbus.bus import protocol as p
from stepbus.trainer import learner

PROBATION_S = 3.0  # a swapped-in learner that exits this early refused its settings: revert
STOP_GRACE_S = 4.0  # then SIGKILL; honcho's own SIGKILL comes 5 s after its SIGTERM
BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # restart delays after quick deaths
STEADY_S = 30.0  # a learner that ran this long before dying is restarted at once
STARTUP_GRACE_S = 30.0  # before its first beat (imports, a slow disk), a learner is not frozen
LEARNER_SILENT_S = 3.0  # after it: this long without a beat, and the learner is frozen
NO_PIDFD_LOOK_S = 0.05  # without a pidfd to wake on its exit, look at the learner this often


class Child(enum.Enum):
    """Where the slot's learner is in its life."""

    WAITING = "waiting"  # none running: the "restart" timer starts the next
    RUNNING = "running"  # beating, or in its start-up grace; killed if it falls silent
    STOPPING = "stopping"  # asked to stop (SIGUSR1: swap, SIGTERM: shutdown); SIGKILL after grace


@dataclass
class Learner:
    """The running learner process and its beat pipe."""

    popen: subprocess.Popen
    started: float
    beats: int  # read end of the pipe the learner writes a byte to every heartbeat interval
    last_beat: float | None = None
    killed_frozen: bool = False  # SIGKILLed for falling silent: how its death is told
    pidfd: int | None = None  # readable when the process exits (Linux), so no polling

    def close(self) -> None:
        for fd in (self.pidfd, self.beats):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def fds(self) -> set[int]:
        """What wakes the slot: a beat, or the learner's exit (when a pidfd tells it)."""
        return {self.beats} if self.pidfd is None else {self.beats, self.pidfd}

    def silent_for(self, now: float) -> float:
        """Seconds past the allowance since the last sign of life (> 0: frozen)."""
        if self.last_beat is None:
            return now - self.started - STARTUP_GRACE_S
        return now - self.last_beat - LEARNER_SILENT_S


@dataclass
class Swap:
    """A swap in progress: the settings before it, kept until the new learner proves itself."""

    previous_args: list[str]
    started: float = 0.0  # when the new learner was started (0: the old one is still stopping)


@dataclass
class Figures:
    learner_starts: int = 0
    learner_deaths: int = 0
    learners_frozen: int = 0
    swaps: int = 0
    swaps_reverted: int = 0
    last_death: str = ""


def describe_exit(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def restart_delay(quick_deaths: int, code: int) -> float:
    """How long to wait before the next learner, after `quick_deaths` deaths in a row of
    learners that did not run STEADY_S; one that left on its own (exit 0) waits at least 1 s,
    as a shutdown may be coming."""
    delay = BACKOFF_S[min(quick_deaths, len(BACKOFF_S) - 1)]
    return max(delay, 1.0) if code == 0 else delay


class Slot(node.Process):
    """Sends its swap replies on "controller". The child is watched in `tick` (its beats, its
    exit) and by timers: "restart" (start the next learner), "silence" (kill a frozen one),
    "kill" (the end of a stop's grace), "probation" (a swapped-in learner proved itself)."""

    role = "slot"

    def __init__(self, ports: node.Ports, log: logging.Logger, *, name: str,
                 args: list[str], validate: Callable[[list[str]], str],
                 command: list[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`args` are the slot's own learner flags; `validate(args)` says why a swap's flags
        are unusable ("" if they are fine); `command` runs a learner (before its flags)."""
        super().__init__(ports, log, name=name, clock=clock)
        self.command = command or [sys.executable, "-m", "stepbus", "learner"]
        self.args, self.validate = list(args), validate
        self.learner: Learner | None = None
        self.child = Child.WAITING
        self.swap: Swap | None = None
        self.quick_deaths = 0
        self.leaving = ""  # why the slot is stopping ("": it is not)
        self.counts = Figures()
        self.at("restart", self.now, self.start_learner)
        log.info("trainer slot %s: one learner at a time, restarted if it dies", name)

    # -- the learner's life
    def start_learner(self, now: float) -> None:
        beats, beat_end = os.pipe()
        popen = subprocess.Popen([*self.command, *self.args],
                                 env={**os.environ, learner.SLOT_BEAT_FD_ENV: str(beat_end)},
                                 pass_fds=(beat_end,))
        os.close(beat_end)
        os.set_blocking(beats, False)
        self.counts.learner_starts += 1
        self.log.info("learner started (pid %d)%s", popen.pid,
                      f" with {' '.join(self.args)}" if self.args else "")
        pidfd = None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(popen.pid)
        self.learner, self.child = Learner(popen, now, beats, pidfd=pidfd), Child.RUNNING
        self.wake_on_readable_fds = self.learner.fds()
        self.at("silence", now + STARTUP_GRACE_S, self.check_silence)
        if self.swap is not None and not self.swap.started:
            self.swap.started = now
            self.at("probation", now + PROBATION_S, self.swap_proven)

    def tick(self, now: float) -> float:
        """Take the learner's beats and notice its exit; without a pidfd, look again soon."""
        lrn = self.learner
        if lrn is None:
            return math.inf
        with contextlib.suppress(BlockingIOError):
            if os.read(lrn.beats, 4096):
                if lrn.last_beat is None and not self.leaving:  # out of its start-up grace
                    self.at("silence", now + LEARNER_SILENT_S, self.check_silence)
                lrn.last_beat = now
        if (code := lrn.popen.poll()) is not None:
            self.learner_exited(lrn, code, now)
            return math.inf
        return math.inf if lrn.pidfd is not None else now + NO_PIDFD_LOOK_S

    def check_silence(self, now: float) -> None:
        lrn = self.learner
        if lrn is None or lrn.killed_frozen or self.leaving:
            return
        if (over := lrn.silent_for(now)) <= 0:
            self.at("silence", now - over, self.check_silence)
            return
        self.counts.learners_frozen += 1
        lrn.killed_frozen = True
        self.log.warning("learner (pid %d) sent no heartbeat for %.1fs (frozen?); killing it",
                         lrn.popen.pid, now - (lrn.last_beat or lrn.started))
        lrn.popen.kill()  # SIGKILL also ends a stopped (SIGSTOP) process

    def ask_to_stop(self, lrn: Learner, sig: signal.Signals, now: float) -> None:
        if self.child is not Child.STOPPING:
            self.child = Child.STOPPING
            lrn.popen.send_signal(sig)
            self.at("kill", now + STOP_GRACE_S, self.kill_after_grace)

    def kill_after_grace(self, now: float) -> None:
        if self.learner is None:
            return
        if self.leaving:
            self.log.warning("learner did not stop within %gs; killing it", STOP_GRACE_S)
        self.learner.popen.kill()
        self.at("kill", now + 60, self.kill_after_grace)

    def learner_exited(self, ended: Learner, code: int, now: float) -> None:
        asked = self.child is Child.STOPPING
        self.learner, self.child = None, Child.WAITING
        ended.close()
        self.wake_on_readable_fds = set()
        for name in ("silence", "kill"):
            self.cancel(name)
        if self.leaving:
            self.log.info("learner stopped (%s)", describe_exit(code))
            self.stop(self.leaving)
        elif asked:
            self.at("restart", now, self.start_learner)  # the swap's new learner
        elif self.swap is not None and self.swap.started:
            self.revert_swap(now - ended.started, code, now)
        else:
            self.died(ended, code, now)

    def died(self, ended: Learner, code: int, now: float) -> None:
        ran = now - ended.started
        self.counts.learner_deaths += 1
        self.counts.last_death = "frozen, killed" if ended.killed_frozen else describe_exit(code)
        self.quick_deaths = 0 if ran >= STEADY_S else self.quick_deaths + 1
        delay = restart_delay(self.quick_deaths, code)
        self.at("restart", now + delay, self.start_learner)
        self.log.warning("learner (pid %d) %s after %.1fs; starting a new one from the "
                         "checkpoint%s", ended.popen.pid, self.counts.last_death, ran,
                         f" in {delay:g}s" if delay else "")

    # -- swaps
    def on_trainer_swap(self, peer: bytes, msg: p.TrainerSwap) -> None:
        if self.leaving:
            return
        if self.swap is not None:
            self.send("controller", p.Reply(ok=False, detail="a swap is already under way"))
            return
        if problem := self.validate(msg.args):
            self.send("controller", p.Reply(ok=False, detail=f"learner flags refused: {problem}"))
            return
        self.swap = Swap(previous_args=self.args)
        self.args = [*self.args, *msg.args]  # later flags win; they stay for later restarts too
        self.log.info("swap requested: %s", " ".join(msg.args) or "(same settings)")
        if self.learner is not None:
            self.ask_to_stop(self.learner, signal.SIGUSR1, self.now)  # checkpoint, leave at once
        else:
            self.at("restart", self.now, self.start_learner)  # new settings deserve a fresh try

    def swap_proven(self, now: float) -> None:
        if self.swap is None or not self.swap.started:
            return
        self.counts.swaps += 1
        self.reply(True, f"learner pid {self.learner.popen.pid if self.learner else '-'} "
                         f"running with {' '.join(self.args) or 'the default settings'}")
        self.swap = None

    def revert_swap(self, ran: float, code: int, now: float) -> None:
        assert self.swap is not None
        self.counts.swaps_reverted += 1
        self.args, self.swap = self.swap.previous_args, None
        self.cancel("probation")
        self.reply(False, f"the new learner {describe_exit(code)} after {ran:.1f}s (its log is "
                          "above); back to the previous settings")
        self.at("restart", now, self.start_learner)

    def reply(self, ok: bool, detail: str) -> None:
        (self.log.info if ok else self.log.error)("swap: %s", detail)
        self.send("controller", p.Reply(ok=ok, detail=detail))

    # -- stopping
    def on_signal(self, reason: str) -> None:
        self.now = self.clock()
        self.leave(reason)

    def on_shutdown(self, peer: bytes, msg: p.Shutdown) -> None:
        self.leave(msg.reason)

    def on_run_state(self, peer: bytes, msg: p.RunState) -> None:
        self.run_state = msg
        if msg.shutting_down:
            self.leave("controller shutdown")

    def leave(self, reason: str) -> None:
        """Stop the learner (it drains and checkpoints); the loop ends once it has exited."""
        if self.leaving:
            return
        self.leaving = reason
        for name in ("restart", "probation", "silence"):
            self.cancel(name)
        if self.learner is None:
            self.stop(reason)
        else:
            self.ask_to_stop(self.learner, signal.SIGTERM, self.now)

    def kill_learner(self) -> None:
        """The last resort, when the loop ended without the learner's exit."""
        if self.learner is not None:
            if self.learner.popen.poll() is None:
                self.learner.popen.kill()
                self.learner.popen.wait(5)
            self.learner.close()

    def figures(self) -> dict[str, Any]:
        figures: dict[str, Any] = {
            "learner_pid": self.learner.popen.pid if self.learner else None,
            **dataclasses.asdict(self.counts),
            "state": ("stopping" if self.leaving else "swapping" if self.swap else
                      "running" if self.learner else "restarting")}
        if self.rejects.total:
            figures.update(self.rejects.figures())
        return figures

    def finish(self) -> None:
        self.log.info("trainer slot stopping (%s)", self.leaving or self.stop_reason)


def run(cfg: learner.Config, learner_args: list[str],
        validate: Callable[[list[str]], str]) -> int:
    """`learner_args` are the slot's own flags, passed on to every learner; `validate(args)`
    returns why a swap's flags are unusable (empty if they are fine)."""
    log = node.setup_logging("slot")
    stop = node.StopFlag()
    ctx = wiring.context(cfg.security)
    name = (os.environ.get("HONCHO_PROCESS_NAME")
            or f"trainer-{pysocket.gethostname()}-{os.getpid()}")
    slot: Slot | None = None
    try:
        link = node.ControllerLink(ctx, role="slot", name=name, controller=cfg.controller,
                                   broadcast=cfg.broadcast, log=log)
        slot = Slot(node.SocketPorts({"controller": link.dealer}), log, name=name,
                    args=learner_args, validate=validate)
        return node.Loop(slot, {}, link, stop).run()
    finally:
        if slot is not None:
            slot.kill_learner()
        wiring.destroy(ctx, wiring.LINGER_MS)
