"""The learner's ledger of trajectory numbers: what it took in and learned from, for the
RECEIPTs that let the assembler forget them, and what it must ignore when the assembler sends
one again."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from stepbus.bus import protocol as p

# Numbers receipted as learned that are still recognised if sent again: well above what a
# resend can put ahead of one (twice the assembler's default --max-buffered of 10,000, plus a
# batch). 512 KiB.
LEARNED_KEPT = 1 << 16
# Of those, the newest a checkpoint keeps (with the ones it holds not yet receipted): a
# receipt that got out reaches a live assembler within milliseconds, so seconds' worth is ample.
LEARNED_IN_CHECKPOINT = 1024


class Receipts:
    """Trajectory numbers taken in and learned from, for RECEIPTs, and what it takes to ignore
    a trajectory the assembler sends again (after a learner connects) that this learner, or
    the checkpoint it resumed, has already.

    "Learned" is only receipted once a checkpoint holds that learning: an update's trajectories
    are `settled` until then (`checkpointed` makes them receiptable), so a learner killed at
    any instant has lost no learning the assembler was told of, and what it had not
    checkpointed the assembler sends to the next one.

    What can come back is what the assembler still held as unlearned when it resent: numbers
    taken in whose "learned" receipt it had not yet read. So this keeps, exactly, the numbers
    taken in and not yet receipted as learned (`open`: at most a batch and a checkpoint
    interval), plus the last LEARNED_KEPT numbers receipted as learned (`recent`, a fixed
    ring). Bounded by counting, not time: the assembler sends each policy's trajectories in
    ascending numbers and puts resent ones ahead of the rest, so a copy resent before our
    receipt was read comes in ahead of what was then queued or unlearned, which its
    --max-buffered bounds; a copy cannot wait behind more than that. A number above every one
    taken in was never taken in (numbers rise), so only lower ones are looked up, and those
    come only with a resend. A copy of one receipted as learned is receipted again: the
    receipt may have died with a killed predecessor (`resume` seeds the ring from the
    checkpoint)."""

    def __init__(self) -> None:
        self.recent = np.full(LEARNED_KEPT, -1, np.int64)  # allocated once: RSS stays flat
        self._start("")

    def _start(self, assembler: str) -> None:
        self.assembler = assembler
        self.taken: list[int] = []
        self.settled: list[int] = []  # learned from (or dropped), not yet in a checkpoint
        self.learned: list[int] = []  # learned from, in a checkpoint: to be receipted
        self.open: set[int] = set()  # taken in, "learned" not yet receipted
        self.recent.fill(-1)
        self.recent_next = 0  # where the next receipted number goes in the ring
        self.highest = -1  # of the numbers taken in
        self.pending_since: float | None = None
        self.warned = False

    def resume(self, assembler: str, seqs: Iterable[int]) -> None:
        """Start from a checkpoint's record of what it learned from: numbers of `assembler`
        whose "learned" receipt may not have reached it."""
        self._start(assembler)
        for seq in seqs:
            self._remember(seq)
            self.highest = max(self.highest, seq)

    def _remember(self, seq: int) -> None:
        self.recent[self.recent_next] = seq  # over the oldest
        self.recent_next = (self.recent_next + 1) % LEARNED_KEPT

    def had(self, seq: int) -> bool:
        """Whether `seq` was taken in (as far as it can come back)."""
        return seq <= self.highest and (seq in self.open or bool((self.recent == seq).any()))

    def take(self, assembler: str, seq: int) -> bool:
        """Note a trajectory taken in; False if it was taken in already."""
        if not assembler:
            return True  # not numbered by an assembler: nothing to receipt
        if assembler != self.assembler:
            self._start(assembler)  # a new assembler numbers afresh
        if self.had(seq):
            if seq not in self.open:
                self.learned.append(seq)  # receipted as learned before: say so again
            return False
        self.highest = max(self.highest, seq)
        self.open.add(seq)
        self.taken.append(seq)
        return True

    def learn(self, ids: Iterable[tuple[str, int]]) -> None:
        """Learned from (or dropped): receipted once the next checkpoint holds it."""
        self.settled.extend(seq for assembler, seq in ids
                            if assembler and assembler == self.assembler)

    def checkpointed(self) -> None:
        """A checkpoint holds everything settled: it may be receipted as learned."""
        self.learned.extend(self.settled)
        self.settled.clear()

    def kept(self) -> list[int]:
        """What a checkpoint keeps of the numbers it learned from, newest last: those whose
        receipts may not have reached the assembler yet (a successor receipts their copies as
        learned instead of learning them again)."""
        newest = [*self.learned, *self.settled]
        k = max(LEARNED_IN_CHECKPOINT - len(newest), 0)
        ring = self.recent[(self.recent_next - k + np.arange(k)) % LEARNED_KEPT]
        return [*ring[ring >= 0].tolist(), *newest]

    def message(self, trainer: str, incarnation: str, policy: str, now: float,
                max_policy_lag: int = -1) -> p.Receipt | None:
        if not (self.taken or self.learned):
            return None
        if self.pending_since is None:
            self.pending_since = now
        return p.Receipt(trainer=trainer, incarnation=incarnation, assembler=self.assembler,
                         taken=np.asarray(self.taken, np.int64),
                         learned=np.asarray(self.learned, np.int64), policy=policy,
                         max_policy_lag=max_policy_lag)

    def delivered(self) -> None:
        for seq in self.learned:  # from `open` into the ring
            if seq in self.open:
                self.open.discard(seq)
                self._remember(seq)
        self.taken.clear()
        self.learned.clear()
        self.pending_since, self.warned = None, False
