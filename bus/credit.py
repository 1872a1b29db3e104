"""The credit window: how far stepping may run ahead of what a policy's trainer has taken in.

The broker steps at most `window()` env steps beyond what the trainer reports as received (in
each WEIGHTS message). That bounds policy lag and memory, and makes stepping pause, not drop,
while no trainer is consuming. A trainer that says it starves while the window is full waits
for steps that will never reach it (a restarted assembler lost them, or partial trajectories
hold more than the window allowed for): a top-up lets stepping go on.

Deterministic mode acts at each step count S with the newest policy version the trainer made
from at most S - window steps; `DueVersions` keeps the versions received and not yet due.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

# Per env row the window also leaves room for what is neither trained on nor trainable yet: a
# partial trajectory in the assembler (up to its horizon), the step awaiting its reward, and the
# step in flight. Too small a window deadlocks until the trainer reports itself starving. The
# horizon is the run's, as the assembler tells the controller; until it has, its default.
DEFAULT_HORIZON = 32  # the assembler's --horizon default
STEPS_BEYOND_HORIZON = 2  # the step awaiting its reward and the step in flight
MAX_PENDING_VERSIONS = 64  # deterministic mode: versions received, not yet due (a few normally)
# Deterministic mode: how long the trainer may say it starves while we wait for it to take in
# steps it never gets (lost data, or a horizon longer than the window allows) before we give up
# reproducibility rather than stall the run for good. A healthy run never waits this long.
DETERMINISM_GIVE_UP_S = 5.0

Weights = dict[str, np.ndarray]


@dataclass
class Credit:
    """Env steps stepped but not yet reported received by the current trainer incarnation."""

    max_steps_ahead: int = 0  # a fixed window (0: from the trainer's batch and the rows)
    rows: int = 0  # rows of live workers the policy acts for: each may hold a partial trajectory
    horizon: int = DEFAULT_HORIZON  # the longest partial trajectory the assembler holds
    produced: int = 0
    baseline: int = 0
    consumed: int = 0
    trainer: str = ""
    batch_steps: int = 256
    topups: int = 0
    extra: int = 0  # granted by top-ups; doubles, so a far too small window grows in few steps
    start: int = 0  # produced - consumed when the trainer connected: baseline without top-ups
    starving: bool = False  # what the trainer's latest WEIGHTS message said

    def outstanding(self) -> int:
        return self.produced - self.baseline - self.consumed

    def window(self) -> int:
        allowance = self.horizon + STEPS_BEYOND_HORIZON
        return self.max_steps_ahead or 2 * self.batch_steps + allowance * self.rows

    def full(self) -> bool:
        """Stepping must wait for the trainer's next report."""
        return self.outstanding() >= self.window()

    def made_from(self, incarnation: str, consumed_steps: int) -> int:
        """On our scale of steps, the steps a trainer that reports `consumed_steps` has taken
        in: a trainer incarnation not heard before starts counting where we are now."""
        start = self.start if incarnation == self.trainer else self.produced - consumed_steps
        return start + consumed_steps

    def report(self, incarnation: str, consumed_steps: int, batch_steps: int,
               starving: bool) -> bool:
        """Take in what a trainer's WEIGHTS message says; True if it comes from a trainer
        incarnation not heard before (whose count of steps starts from what it says now)."""
        new = incarnation != self.trainer
        if new:
            self.trainer, self.baseline = incarnation, self.produced - consumed_steps
            self.start, self.extra = self.baseline, 0
        self.consumed, self.batch_steps, self.starving = consumed_steps, batch_steps, starving
        if starving and self.full():
            self.top_up()
        return new

    def top_up(self) -> None:
        """The trainer waits for data we think is in flight: it was lost (a restarted
        assembler) or is held in partial trajectories longer than we allowed for. Doubling, but
        never more than one window at a time: while the assembler holds intake, queues (not
        stepping) would absorb the credit."""
        grant = min(max(self.batch_steps, self.extra), self.window())
        self.baseline += grant
        self.extra = min(self.extra + grant, self.window())
        self.topups += 1


@dataclass
class Due:
    """What the deterministic schedule says at the current step count."""

    wait: bool  # the trainer may still make a version that is due now: ask again later
    version: int = -1  # the newest version due, to act with from now on (-1: keep acting)
    weights: Weights | None = None
    abandoned: int = 0  # steps we gave up waiting for: the run is no longer reproducible
    waited_s: float = 0.0


@dataclass
class DueVersions:
    """Deterministic mode: the versions received and not yet acted with, oldest first, each
    with the steps it was made from (on the broker's step scale)."""

    pending: collections.deque[tuple[int, int, Weights]] = field(
        default_factory=collections.deque)
    waiting_since: float | None = None  # waiting for the trainer's intake since then

    def add(self, made_from: int, version: int, weights: Weights) -> None:
        if len(self.pending) >= MAX_PENDING_VERSIONS:
            self.pending.popleft()
        self.pending.append((made_from, version, weights))

    def take(self, credit: Credit, now: float, *, loaded: bool) -> Due:
        """The newest version made from at most `produced - window()` steps, once the
        trainer's reports show that no other such version can still come: it makes a version
        as soon as a batch is full, so a trainer that has taken in N steps has made (and sent)
        every version made from N or fewer. With an untouched window this always holds
        already. Without weights (`loaded` False) the oldest version received is taken."""
        limit = credit.produced - credit.window()
        short = limit - (credit.start + credit.consumed)
        due = Due(wait=False)
        if short > 0:
            self.waiting_since = now if self.waiting_since is None else self.waiting_since
            due.waited_s = now - self.waiting_since
            if not credit.starving or due.waited_s < DETERMINISM_GIVE_UP_S:
                return Due(wait=True)
            # It will never have them (lost data, or a horizon longer than the window allows).
            credit.start += short
            due.abandoned = short
        self.waiting_since = None
        while self.pending and (self.pending[0][0] <= limit or not loaded):
            _, due.version, due.weights = self.pending.popleft()
            loaded = True
        return due
