"""The learner's heartbeat to the trainer slot that started it (trainer/slot.py): both sides
of the pipe know it by SLOT_BEAT_FD_ENV."""

from __future__ import annotations

import os

from stepbus.bus import node
from stepbus.bus.supervisor import STARTED

SLOT_BEAT_FD_ENV = "STEPBUS_SLOT_BEAT_FD"  # the pipe a trainer slot watches (see SlotBeat)


class SlotBeat:
    """The learner's side of its trainer slot: a byte on a pipe every heartbeat interval, so
    the slot can kill a learner that froze, and a broken pipe when the slot is gone, so a
    killed slot's learner leaves instead of lingering next to its replacement."""

    def __init__(self, fd: int | None = None) -> None:
        """`fd` None: no slot (a bare `stepbus learner`)."""
        self.fd = fd
        self.gone = False
        self._next = 0.0
        self._byte = b"."  # STARTED once `started` is called, until it is written
        if self.fd is not None:
            try:
                os.set_blocking(self.fd, False)
            except OSError:
                self.fd = None  # not started by a slot after all

    @classmethod
    def from_env(cls) -> SlotBeat:
        fd = os.environ.get(SLOT_BEAT_FD_ENV)
        return cls(int(fd) if fd and fd.isdigit() else None)

    def started(self, now: float) -> None:
        """Past the start-up: settings, model and checkpoint taken (the slot proves a swap by
        it); said with the next beat, which is now."""
        self._byte, self._next = STARTED, 0.0
        self.beat(now)

    def beat(self, now: float) -> None:
        if self.fd is None or now < self._next:
            return
        self._next = now + node.HEARTBEAT_INTERVAL_S
        try:
            os.write(self.fd, self._byte)
            self._byte = b"."
        except BlockingIOError:
            pass  # the slot has not read the last ones yet: it is alive
        except OSError:
            self.gone = True
