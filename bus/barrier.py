"""The reset barrier as the broker runs it: the run's epoch and reset options, and the pause
that moves every live worker into a new epoch.

The controller broadcasts a barrier (or its run state shows one we missed). Stepping pauses;
each worker is reset with the new options as soon as its in-flight reply is in; once every live
worker has answered from the new epoch, the broker tells the controller how many were reset,
how many were lost meanwhile and which environments raised, and stepping resumes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from stepbus.bus import protocol as p

MAX_ERRORS = 20  # env errors a BarrierDone carries
MAX_ERROR_CHARS = 300


class Phase(enum.Enum):
    RUNNING = "running"
    BARRIER = "barrier"  # stepping paused until every live worker has reset into the new epoch


@dataclass
class ResetBarrier:
    """The epoch workers must be in, its reset options, and the barrier that leads into it."""

    phase: Phase = Phase.RUNNING
    epoch: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)  # workers that died during the barrier
    errors: list[str] = field(default_factory=list)  # env errors workers reported during it

    @property
    def running(self) -> bool:
        return self.phase is Phase.RUNNING

    def begin(self, epoch: int, options: dict[str, Any]) -> bool:
        """Pause for a barrier into `epoch`; False (nothing changes) unless it is newer."""
        if epoch <= self.epoch:
            return False
        self.phase, self.epoch, self.options = Phase.BARRIER, epoch, options
        self.lost.clear()
        self.errors.clear()
        return True

    def worker_lost(self, name: str) -> None:
        if self.phase is Phase.BARRIER:
            self.lost.add(name)

    def env_error(self, text: str) -> None:
        if self.phase is Phase.BARRIER and len(self.errors) < MAX_ERRORS:
            self.errors.append(text[:MAX_ERROR_CHARS])

    def complete(self, worker_epochs: Iterable[int], workers: int) -> p.BarrierDone | None:
        """End the barrier once every live worker (their epochs given) is in the new epoch;
        the controller's report, or None while it goes on (or none runs)."""
        if self.phase is not Phase.BARRIER or any(e != self.epoch for e in worker_epochs):
            return None
        self.phase = Phase.RUNNING
        return p.BarrierDone(epoch=self.epoch, workers_reset=workers,
                             workers_lost=len(self.lost), errors=self.errors[:MAX_ERRORS])
