"""The trainer slot: what honcho's `trainer:` line runs. It is a supervisor (bus/supervisor.py)
of learner processes (`stepbus learner`): it restarts one that dies or freezes, replaces it on
`stepbus trainer swap`, and stops it on shutdown.

Each new learner resumes the run's checkpoint with the next generation and a higher policy
version; the assembler keeps every trajectory until a learner has learned from it, so nothing is
lost between. As every supervised child, the learner writes a byte to a pipe every heartbeat
interval (`node.SupervisorBeat`): a learner silent for `supervisor.SILENT_S` (half that when it
is not running at all) is frozen and is killed, but one stopped by a signal is continued; a
learner whose pipe breaks knows its slot died.
"""

from __future__ import annotations

import logging
import os
import signal
import socket as pysocket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stepbus.bus import launch, node, supervisor
from stepbus.bus import protocol as p
from stepbus.bus.exits import Exit, SettingError
from stepbus.bus.supervisor import Running
from stepbus.bus.topology import PortName
from stepbus.trainer import learner, resume

# A swapped-in learner that exits before it has run this long and said it started (its
# settings, model and checkpoint taken) refused its settings: revert. One still starting when
# this ran out is proven once it says so, or START_WAIT_S after its start, whichever is first:
# the controller answers `stepbus trainer swap` itself after its SWAP_TIMEOUT_S, and the old
# learner's stop may take STOP_GRACE_S of that (tests/test_slot_state.py keeps them apart).
PROBATION_S = 3.0
START_WAIT_S = 20.0


@dataclass
class Swap:
    """A swap in progress: the settings before it, kept until the new learner proves itself."""

    previous_args: list[str]
    started: float = 0.0  # when the new learner was started (0: the old one is still stopping)
    served: bool = False  # the new learner ran PROBATION_S: proven once it says it started


class Slot(supervisor.Supervisor):
    """A supervisor of learners that also swaps them. Sends its swap replies on "controller";
    the "probation" timer says a swapped-in learner ran long enough to prove itself."""

    role = "slot"
    noun = "learner"

    def __init__(self, ports: node.Ports, log: logging.Logger, *, name: str,
                 args: list[str], validate: Callable[[list[str]], str],
                 merge: Callable[[list[str], list[str]], list[str]],
                 command: list[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`args` are the slot's own learner flags; `validate(args)` says why a swap's flags
        are unusable ("" if they are fine); `merge(args, swap_args)` the flags after a swap;
        `command` runs a learner (before its flags)."""
        super().__init__(ports, log, name=name, args=args, clock=clock,
                         command=command or launch.role_command("learner"),
                         beat_env=node.BEAT_FD_ENV)
        self.validate, self.merge = validate, merge
        self.swap: Swap | None = None
        self.swaps = self.swaps_reverted = 0
        log.info("trainer slot %s: one learner at a time, restarted if it dies", name)

    @property
    def learner(self) -> Running | None:
        return self.running

    def child_started(self, now: float) -> None:
        if self.swap is not None and not self.swap.started:
            self.swap.started = now
            self.at("probation", now + PROBATION_S, self.probation_over)

    def exited_unasked(self, ended: Running, code: int, now: float, asked: bool) -> None:
        """A learner stopped for a swap makes way for the new one; a swapped-in one that
        exits before it is proven refused its settings; any other exit (0 too: a learner that left
        by itself may be followed by a shutdown) is a death, restarted from the checkpoint."""
        if asked:
            self.at("restart", now, self.start_child)  # the swap's new learner
        elif self.swap is not None and self.swap.started:
            self.revert_swap(now - ended.started, code, now)
        else:
            self.died(ended, code, now)

    # -- swaps
    def on_trainer_swap(self, peer: bytes, msg: p.TrainerSwap) -> None:
        if self.leaving or self.gave_up:
            self.send(PortName.CONTROLLER, p.Reply(ok=False, detail="the slot is stopping"))
            return
        if self.swap is not None:
            self.send(PortName.CONTROLLER, p.Reply(ok=False, detail="a swap is already under way"))
            return
        if problem := self.validate(msg.args):
            self.send(PortName.CONTROLLER,
                      p.Reply(ok=False, detail=f"learner flags refused: {problem}"))
            return
        self.swap = Swap(previous_args=self.args)
        self.args = self.merge(self.args, msg.args)  # they stay for later restarts too
        self.log.info("swap requested: %s", " ".join(msg.args) or "(same settings)")
        if self.running is not None:
            self.ask_to_stop(self.running, signal.SIGUSR1, self.now)  # checkpoint, leave at once
        else:
            self.at("restart", self.now, self.start_child)  # new settings deserve a fresh try

    def probation_over(self, now: float) -> None:
        if self.swap is None or not self.swap.started:
            return
        self.swap.served = True
        if self.running is not None and not self.running.said_started:  # a slow start
            self.at("probation", self.swap.started + START_WAIT_S, self.swap_proven)
        else:
            self.swap_proven(now)

    def child_said_started(self, now: float) -> None:
        if self.swap is not None and self.swap.served:
            self.swap_proven(now)  # its probation ran out while it was still starting

    def swap_proven(self, now: float) -> None:
        if self.swap is None or not self.swap.started:
            return
        self.cancel("probation")
        self.swaps += 1
        late = "" if self.running is None or self.running.said_started else (
            f", not started after {START_WAIT_S:g}s (a setting it refuses now ends the run)")
        self.reply(True, f"learner pid {self.learner_pid()} running with {self.settings()}{late}")
        self.swap = None

    def revert_swap(self, ran: float, code: int, now: float) -> None:
        assert self.swap is not None
        self.swaps_reverted += 1
        self.args, self.swap = self.swap.previous_args, None
        self.cancel("probation")
        self.reply(False, f"the new learner {supervisor.describe_exit(code)} after {ran:.1f}s "
                          "(its log is above); back to the previous settings")
        self.at("restart", now, self.start_child)

    def learner_pid(self) -> int | str:
        return self.running.popen.pid if self.running else "-"

    def settings(self) -> str:
        return " ".join(self.args) or "the default settings"

    def reply(self, ok: bool, detail: str) -> None:
        (self.log.info if ok else self.log.error)("swap: %s", detail)
        self.send(PortName.CONTROLLER, p.Reply(ok=ok, detail=detail))

    # -- stopping
    def leave_after_shutdown(self, reason: str) -> None:
        """The learner is told at once: it drains, checkpoints and leaves."""
        self.leave(reason)

    def leave(self, reason: str) -> None:
        self.cancel("probation")
        self.answer_swap_on_leaving(reason)
        super().leave(reason)

    def answer_swap_on_leaving(self, reason: str) -> None:
        """A swap still under way when the slot leaves is answered now, or `stepbus trainer
        swap` would wait out its timeout for a reply nobody is left to send: done if its
        learner had started (the run ended during the probation), else not."""
        if self.swap is None:
            return
        started, self.swap = self.swap.started, None
        if started:
            self.swaps += 1
            self.reply(True, f"learner pid {self.learner_pid()} ran with {self.settings()} until "
                             f"the slot stopped ({reason}), before it was proven")
        else:
            self.reply(False, f"the slot stopped ({reason}) before the new learner started")

    def state(self) -> str:
        return "swapping" if self.swap and not self.leaving else super().state()

    def figures(self) -> dict[str, Any]:
        return {**super().figures(), "learner_pid": self.running.popen.pid if self.running
                else None, "swaps": self.swaps, "swaps_reverted": self.swaps_reverted}

    def finish(self) -> None:
        self.log.info("trainer slot stopping (%s)", self.leaving or self.stop_reason)


def run(cfg: learner.Config, learner_args: list[str],
        validate: Callable[[list[str]], str],
        merge: Callable[[list[str], list[str]], list[str]],
        entry: Callable[[], int] | None = None) -> int:
    """`learner_args` are the slot's own flags, passed on to every learner; `validate(args)`
    returns why a swap's flags are unusable (empty if they are fine); `merge(args, swap_args)`
    the flags after a swap (a swap's flags replace those they set again); `entry` runs a
    learner with them in this interpreter (the first learner is a fork that calls it)."""
    log = node.setup_logging("slot")
    try:
        if done := resume.finished(cfg):  # said before a learner, or anything, starts
            log.info("%s", done)
            return Exit.OK
    except SettingError as exc:
        log.error("%s", exc)
        return Exit.SETTING
    name = (os.environ.get("HONCHO_PROCESS_NAME")
            or f"trainer-{pysocket.gethostname()}-{os.getpid()}")
    return supervisor.serve(
        cfg.security, log,
        lambda ports: Slot(ports, log, name=name, args=learner_args, validate=validate,
                           merge=merge),
        role="slot", name=name, controller=cfg.controller, broadcast=cfg.broadcast,
        entry=entry, beat_env=node.BEAT_FD_ENV)
