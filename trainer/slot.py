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
import os
import signal
import socket as pysocket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from stepbus.bus import node, wiring
from stepbus.bus import protocol as p
from stepbus.trainer import learner

PROBATION_S = 3.0  # a swapped-in learner that exits this early refused its settings: revert
STOP_GRACE_S = 4.0  # then SIGKILL; honcho's own SIGKILL comes 5 s after its SIGTERM
BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # restart delays after quick deaths
STEADY_S = 30.0  # a learner that ran this long before dying is restarted at once
STARTUP_GRACE_S = 30.0  # before its first beat (imports, a slow disk), a learner is not frozen
LEARNER_SILENT_S = 3.0  # after it: this long without a beat, and the learner is frozen


@dataclass
class Learner:
    """The running learner process, its beat pipe, and why we are waiting on it."""

    popen: subprocess.Popen
    started: float
    beats: int  # read end of the pipe the learner writes a byte to every heartbeat interval
    last_beat: float | None = None
    asked_to_stop: bool = False
    kill_at: float = 0.0
    killed_frozen: bool = False
    pidfd: int | None = None  # readable when the process exits (Linux), so no polling

    def close(self) -> None:
        for fd in (self.pidfd, self.beats):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

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


def run(cfg: learner.Config, learner_args: list[str],
        validate: Callable[[list[str]], str]) -> int:
    """`learner_args` are the slot's own flags, passed on to every learner; `validate(args)`
    returns why a swap's flags are unusable (empty if they are fine)."""
    log = node.setup_logging("slot")
    stop = node.StopFlag()
    ctx = wiring.context(cfg.security)
    name = (os.environ.get("HONCHO_PROCESS_NAME")
            or f"trainer-{pysocket.gethostname()}-{os.getpid()}")
    link = node.ControllerLink(ctx, role="slot", name=name, controller=cfg.controller,
                               broadcast=cfg.broadcast, log=log)
    args = list(learner_args)
    current: Learner | None = None
    swap: Swap | None = None
    restart_at, quick_deaths = 0.0, 0
    figures = Figures()

    def start(now: float) -> Learner:
        beats, beat_end = os.pipe()
        popen = subprocess.Popen([sys.executable, "-m", "stepbus", "learner", *args],
                                 env={**os.environ, learner.SLOT_BEAT_FD_ENV: str(beat_end)},
                                 pass_fds=(beat_end,))
        os.close(beat_end)
        os.set_blocking(beats, False)
        figures.learner_starts += 1
        log.info("learner started (pid %d)%s", popen.pid,
                 f" with {' '.join(args)}" if args else "")
        pidfd = None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(popen.pid)
        return Learner(popen, now, beats, pidfd=pidfd)

    def ask_to_stop(lrn: Learner, sig: signal.Signals, now: float) -> None:
        if not lrn.asked_to_stop:
            lrn.asked_to_stop, lrn.kill_at = True, now + STOP_GRACE_S
            lrn.popen.send_signal(sig)

    def reply(ok: bool, detail: str) -> None:
        (log.info if ok else log.error)("swap: %s", detail)
        link.send(p.Reply(ok=ok, detail=detail))

    def on_swap(msg: p.TrainerSwap, now: float) -> None:
        nonlocal swap, args, restart_at
        if swap is not None:
            link.send(p.Reply(ok=False, detail="a swap is already under way"))
            return
        problem = validate(msg.args)
        if problem:
            link.send(p.Reply(ok=False, detail=f"learner flags refused: {problem}"))
            return
        swap = Swap(previous_args=args)
        args = [*args, *msg.args]  # later flags win; they stay for later restarts too
        log.info("swap requested: %s", " ".join(msg.args) or "(same settings)")
        if current is not None:
            ask_to_stop(current, signal.SIGUSR1, now)  # checkpoint and leave at once
        else:
            restart_at = now  # in a restart backoff: the new settings deserve a fresh try

    def on_exit(ended: Learner, code: int, now: float) -> None:
        nonlocal args, swap, restart_at, quick_deaths
        ran = now - ended.started
        if ended.asked_to_stop:
            restart_at = now  # the swap's new learner starts right away
        elif swap is not None and swap.started:
            figures.swaps_reverted += 1
            args, swap = swap.previous_args, None
            reply(False, f"the new learner {describe_exit(code)} after {ran:.1f}s (its log is "
                         "above); back to the previous settings")
            restart_at = now
        else:
            figures.learner_deaths += 1
            figures.last_death = "frozen, killed" if ended.killed_frozen else describe_exit(code)
            quick_deaths = 0 if ran >= STEADY_S else quick_deaths + 1
            delay = BACKOFF_S[min(quick_deaths, len(BACKOFF_S) - 1)]
            if code == 0:
                delay = max(delay, 1.0)  # it left on its own: a shutdown may be coming
            restart_at = now + delay
            log.warning("learner (pid %d) %s after %.1fs; starting a new one from the "
                        "checkpoint%s", ended.popen.pid, figures.last_death, ran,
                        f" in {delay:g}s" if delay else "")

    def status() -> dict:
        return {"learner_pid": current.popen.pid if current else None,
                "learner_starts": figures.learner_starts,
                "learner_deaths": figures.learner_deaths,
                "learners_frozen": figures.learners_frozen, "swaps": figures.swaps,
                "swaps_reverted": figures.swaps_reverted, "last_death": figures.last_death,
                "state": ("stopping" if stop or link.shutdown_reason else
                          "swapping" if swap else "running" if current else "restarting")}

    log.info("trainer slot %s: one learner at a time, restarted if it dies", name)
    try:
        while True:
            now = time.monotonic()
            link.beat(now, status)
            events = dict(_poll(link, current))
            now = time.monotonic()
            for msg in link.poll(events):
                if isinstance(msg, p.TrainerSwap) and not (stop or link.shutdown_reason):
                    on_swap(msg, now)
            if current is not None and current.beats in events:
                with contextlib.suppress(BlockingIOError):
                    if os.read(current.beats, 4096):
                        current.last_beat = now
            # Looked at after the poll: a Ctrl-C that reached the learner too is no death.
            leaving = bool(stop or link.shutdown_reason)
            if current is not None and (code := current.popen.poll()) is not None:
                ended, current = current, None
                ended.close()
                if leaving:
                    log.info("learner stopped (%s)", describe_exit(code))
                else:
                    on_exit(ended, code, now)
            if leaving:
                if current is None:
                    break
                ask_to_stop(current, signal.SIGTERM, now)  # it drains and checkpoints
                if now >= current.kill_at:
                    log.warning("learner did not stop within %gs; killing it", STOP_GRACE_S)
                    current.popen.kill()
                    current.kill_at = now + 60
                continue
            if current is not None and not current.killed_frozen and current.silent_for(now) > 0:
                figures.learners_frozen += 1
                current.killed_frozen = True
                log.warning("learner (pid %d) sent no heartbeat for %.1fs (frozen?); killing it",
                            current.popen.pid, now - (current.last_beat or current.started))
                current.popen.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
            if current is not None and current.asked_to_stop and now >= current.kill_at:
                current.popen.kill()
                current.kill_at = now + 60
            if current is None and now >= restart_at:
                current = start(now)
                if swap is not None and not swap.started:
                    swap.started = now
            if swap is not None and swap.started and now - swap.started >= PROBATION_S:
                figures.swaps += 1
                reply(True, f"learner pid {current.popen.pid if current else '-'} running "
                            f"with {' '.join(args) or 'the default settings'}")
                swap = None
        log.info("trainer slot stopping (%s)", link.shutdown_reason or stop.reason)
        return 0
    finally:
        if current is not None:
            if current.popen.poll() is None:
                current.popen.kill()
                current.popen.wait(5)
            current.close()
        link.close()
        wiring.destroy(ctx, wiring.LINGER_MS)


def _poll(link: node.ControllerLink, current: Learner | None) -> list:
    """Wait for the controller, the learner's beats or exit (a pidfd is readable once it has
    exited), at most MAX_POLL_MS: restarts, probation and liveness are checked after it."""
    poller = zmq.Poller()
    for sock in link.sockets():
        poller.register(sock, zmq.POLLIN)
    timeout = node.MAX_POLL_MS
    if current is not None:
        poller.register(current.beats, zmq.POLLIN)
        if current.pidfd is not None:
            poller.register(current.pidfd, zmq.POLLIN)
        else:
            timeout = 50  # no pidfd on this platform: look at the child often
    return poller.poll(timeout)
