"""The credit window: how far stepping may run ahead of what a policy's trainer has taken in.

The broker steps at most `window()` env steps beyond what the trainer reports as received (in
each WEIGHTS message). That bounds policy lag and memory, and makes stepping pause, not drop,
while no trainer is consuming. A trainer that says it starves while the window is full waits
for steps that will never reach it (a restarted assembler lost them, or partial trajectories
hold more than the window allowed for): a top-up lets stepping go on. Steps that a known fault
can have lost (an assembler gone, a worker lost or reset) are granted back as soon as the
window is full, and those a fixed window leaves no room for once the trainer starves; other
starving is not: a trainer also starves while its steps are merely late (a frozen or loaded
assembler, a new learner waiting for what the assembler sends it again), and credit granted
for those would let stepping run past the policy-lag bound, the steps arriving after all, too
old to learn from. Starving with no such cause is granted only after STARVING_PATIENCE_S, and
said. Credit granted for steps that came anyway the lag brake (`steer`) takes back.

A trainer counts the steps of the whole run: its checkpoint's count (every trajectory whose
learning the checkpoint holds) plus what it took in since. So a new trainer incarnation (a
killed or swapped learner's successor) continues its predecessor's count on our scale: the
steps the predecessor took in but never checkpointed are exactly what the assembler sends
again, and they count once, when the successor takes them in. Counting afresh at a new
incarnation instead would take everything still in flight as received, and the resent data on
top, so stepping would run that far past the window for the rest of the run.

A restarted broker has the converse problem: the first trainer it hears is mid-run, and the
steps the dead broker left in flight (in the assembler, on their way to the trainer) count as
received when they arrive, though we never stepped them, so our scale takes that many of our
own steps in flight for received and stepping runs as far past the window, for good. We cannot
tell those steps from ours, so the lag brake rescales instead: while the trainer's median lag
stays over half its bound in the first INHERIT_S after our first report, it moves the scale by
a batch, up to one window (what the dead broker could have had in flight), until the lag is
back within 3/8 of the bound or a new trainer incarnation connects. A rescale that went too
far (the trainer starves with the window full, or its lag stays within a quarter of the bound)
is given back a batch at a time.

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
# ... counted only while the trainer says so: a starving trainer says it again every 0.25 s (it
# publishes its weights again on a quiet link), so a claim older than this is one a trainer no
# longer makes, busy with an update of the steps it took in since (a slow update, or the serial
# runner, where the broker waits while the learner learns, is not lost data).
STARVING_CLAIM_FRESH_S = 1.0
# A trainer that starves this long with the window full and no known fault to explain it gets a
# top-up anyway (steps lost where the broker cannot see, such as a message the assembler
# refused). A shorter freeze of the assembler (stopped, it holds its steps: they are late, not
# lost) is waited out; credit granted for a longer one the lag brake (`steer`) takes back.
STARVING_PATIENCE_S = 5.0
# A restarted broker may take the dead one's steps in flight as its own this long after its
# first trainer's report: they reach the trainer within seconds, and a lag that comes later
# has other causes, which must never move the scale.
INHERIT_S = 15.0
# The lag brake acts on this many reports in a row with the median lag over half the bound: the
# old data a fault leaves in the pipeline ages a few versions for a moment (nothing to take
# back then: the steps a killed assembler lost were lost), credit in excess ages them for good.
STEER_REPORTS = 4

Weights = dict[str, np.ndarray]


@dataclass
class Credit:
    """Env steps stepped but not yet reported received by the current trainer incarnation.

    Scale: `start` is the step count (ours) at which the trainer's count would have been 0, so
    a trainer that reports `consumed` has received `start + consumed` of our steps; top-ups
    move `baseline` above `start` by what they `granted`."""

    max_steps_ahead: int = 0  # a fixed window (0: from the trainer's batch and the rows)
    rows: int = 0  # rows of live workers the policy acts for: each may hold a partial trajectory
    horizon: int = DEFAULT_HORIZON  # the longest partial trajectory the assembler holds
    produced: int = 0
    baseline: int = 0
    consumed: int = 0
    trainer: str = ""
    run: str = ""  # the run the current trainer incarnation learns for ("": it did not say)
    batch_steps: int = 256
    topups: int = 0
    extra: int = 0  # granted by top-ups; doubles, so a far too small window grows in few steps
    start: int = 0  # our count of steps where the trainer's count is 0: baseline without top-ups
    granted: int = 0  # baseline - start: steps top-ups took as lost
    first_consumed: int = 0  # the current incarnation's count when it connected
    checkpointed: int = 0  # the count the current incarnation's newest checkpoint holds
    starving: bool = False  # what the trainer's latest WEIGHTS message said
    reported_at: float = 0.0  # when that message came
    starving_since: float | None = None  # the window full and the trainer starving since then
    lost: int = 0  # steps that known faults may have lost and top-ups have not yet granted
    unexplained: int = 0  # top-ups granted after STARVING_PATIENCE_S with no known cause
    braked: int = 0  # granted steps taken back while the trainer's data came near stale
    # A restarted broker's allowance for the dead one's steps in flight (module docstring):
    # open until `inherit_until` (its first trainer was mid-run); `rescaled` steps taken as
    # ours in all, `rescale_held` of them not given back; never where the scale must stay put
    # (deterministic mode places due versions on it).
    rescales: bool = True
    inherit_until: float = 0.0
    rescaled: int = 0
    rescale_held: int = 0
    lagging: int = 0  # reports in a row with the median lag over half the bound
    leading: int = 0  # ... within 3/8 of it
    below: int = 0  # ... within a quarter of it (a rescale that went too far shows so)
    # A trainer reported more steps than we stepped beyond its scale and the top-ups: a
    # restarted broker's first trainer, a trainer of another run, or steps counted twice.
    rebases: int = 0

    def outstanding(self) -> int:
        return self.produced - self.baseline - self.consumed

    def window(self) -> int:
        allowance = self.horizon + STEPS_BEYOND_HORIZON
        return self.max_steps_ahead or 2 * self.batch_steps + allowance * self.rows

    def full(self) -> bool:
        """Stepping must wait for the trainer's next report."""
        return self.outstanding() >= self.window()

    def made_from(self, consumed_steps: int) -> int:
        """On our scale of steps, the steps the current trainer has taken in when it reports
        `consumed_steps` (call after `report`)."""
        return self.start + consumed_steps

    def report(self, incarnation: str, consumed_steps: int, batch_steps: int,
               starving: bool, checkpointed_steps: int = 0, run: str = "", *,
               now: float) -> str:
        """Take in what a trainer's WEIGHTS message says. Returns how a trainer incarnation
        not heard before was connected ("continues", "afresh"; "" for a known one)."""
        connected = ""
        if incarnation != self.trainer:
            first = not self.trainer
            connected = self.connect(incarnation, consumed_steps, run)
            # Our first trainer, mid-run: we are a restarted broker. Any later incarnation (a
            # swap, a kill) ages data for a moment itself: the allowance closes.
            restarted = first and consumed_steps > 0 and self.rescales
            self.inherit_until = now + INHERIT_S if restarted else 0.0
        self.consumed, self.batch_steps, self.starving = consumed_steps, batch_steps, starving
        self.reported_at = now
        self.checkpointed = checkpointed_steps
        if self.outstanding() < 0:
            self.settle_overshoot()
        self.lost = min(self.lost, max(0, self.outstanding()))
        full = self.full()
        if not (starving and full):
            self.starving_since = None
        elif self.starving_since is None:
            self.starving_since = now
        if full and self.lost:
            self.top_up(now)  # whether or not it starves yet: those steps will not come
        elif self.starving_since is not None:
            if self.braked:
                self.release(self.batch_steps)
            elif self.rescale_held:
                self.unrescale(self.batch_steps)
            else:
                self.top_up(now)
        return connected

    def steer(self, lag: int, bound: int) -> None:
        """Take credit that top-ups granted back, a batch every STEER_REPORTS reports, while
        the typical data the trainer takes in (`lag`, its median policy lag since the last
        report) is over half its staleness bound (`bound`): top-ups cannot tell lost steps
        from late ones, and the lag shows steps that came after all. Given again while the
        lag is within 3/8 of the bound (the old data a fault left in the pipeline has passed,
        and the steps it lost were lost after all), and first if the trainer starves. Never
        more than was granted (the window itself is what the partial trajectories and the
        trainer's batches need), but for a restarted broker's rescale (`rescale`)."""
        if not (0 <= lag < 2**31 and 0 < bound < 2**31):  # not known (or not believable)
            return
        old, young, low = lag > bound // 2, lag <= bound * 3 // 8, lag <= bound // 4
        self.lagging = self.lagging + 1 if old else 0
        self.leading = self.leading + 1 if young else 0
        self.below = self.below + 1 if low and self.rescale_held else 0
        if self.below >= 2 * STEER_REPORTS:  # it went too far: stepping waits on the window
            self.below = 0
            self.unrescale(self.batch_steps)
        if self.lagging >= STEER_REPORTS:
            self.lagging = 0
            cut = min(self.batch_steps, self.granted)
            self.baseline -= cut
            self.granted -= cut
            self.braked += cut
            if not cut and self.inheriting():
                self.rescale()
        elif self.leading >= STEER_REPORTS:
            self.leading = 0
            if self.rescaled:  # the lag is back: the rescale is done
                self.inherit_until = 0.0
            self.release(self.batch_steps)

    def inheriting(self) -> bool:
        """Whether a restarted broker may still take the dead one's steps as its own."""
        return self.reported_at < self.inherit_until

    def rescale(self) -> None:
        """Take a batch of the steps a dead broker left in flight as ours (module docstring):
        our scale moves, as a rebase's does, never by more than a window in all."""
        move = max(0, min(self.batch_steps, self.window() - self.rescale_held))
        self.shift(-move)
        self.rescaled += move
        self.rescale_held += move
        if self.rescale_held >= self.window():
            self.inherit_until = 0.0

    def unrescale(self, steps: int) -> None:
        """The rescale went too far (the lag it acted on was still falling, or was not the
        dead broker's): the trainer starves with the window full, or the median lag stays
        within a quarter of the bound for twice STEER_REPORTS reports (a window made too
        tight holds stepping back: measured, 60% of the rate, the lag at 2 instead of 3):
        give a batch of it back, and take no more."""
        back = min(self.rescale_held, steps)
        self.shift(back)
        self.rescale_held -= back
        self.inherit_until = 0.0

    def release(self, steps: int) -> None:
        back = min(self.braked, steps)
        self.baseline += back
        self.granted += back
        self.braked -= back

    def may_have_lost(self, steps: int) -> None:
        """A fault may have lost up to `steps` of the steps in flight: top-ups may grant that
        many back (never more than are in flight)."""
        self.lost = min(self.lost + steps, max(0, self.outstanding()))

    def room_short(self) -> int:
        """Steps a fixed window leaves no room for: partial trajectories in every row and a
        batch to learn from (0 for the window sized from them)."""
        need = (self.horizon + STEPS_BEYOND_HORIZON) * self.rows + self.batch_steps
        return max(0, need - self.window() - self.granted)

    def connect(self, incarnation: str, consumed_steps: int, run: str = "") -> str:
        """A new trainer incarnation continues the last one's scale if it learns for the same
        run (`run`, its run directory's id; a trainer that names none is judged by its count
        alone) and its count fits it: at least where the last one started and what the last
        one's newest checkpoint held (it resumed that checkpoint, which only grows), and at
        most what we stepped. Otherwise (the first trainer we hear, one of another run, or one
        that started a run of its own, at 0, while its predecessor had checkpointed) its count
        starts where we are now. The run tells apart what counts cannot: a learner of another
        run whose count happens to fit, as one at 0 after a predecessor that was killed
        between its first checkpoint and the WEIGHTS that would have said so."""
        same_run = not (run and self.run) or run == self.run
        continues = bool(self.trainer) and same_run and (
            max(self.first_consumed, self.checkpointed) <= consumed_steps
            <= self.produced - self.start)
        if not continues:
            if self.trainer:
                self.rebases += 1
            self.start = self.baseline = self.produced - consumed_steps
            self.granted = self.braked = self.lost = self.lagging = self.leading = 0
            self.starving_since = None
        self.trainer, self.first_consumed, self.extra = incarnation, consumed_steps, 0
        self.run = run
        return "continues" if continues else "afresh"

    def settle_overshoot(self) -> None:
        """The trainer received more than we think we stepped past it. Steps top-ups took as
        lost arrived after all: take those grants back first. Beyond them our scale was wrong:
        move it, so outstanding is never negative (stepping would run past the window)."""
        over = -self.outstanding()
        back = min(over, self.granted)
        self.baseline -= back
        self.granted -= back
        if over > back:
            self.shift(back - over)
            self.rebases += 1

    def shift(self, steps: int) -> None:
        """Move our whole scale (top-ups' grants kept): outstanding falls by `steps`."""
        self.start += steps
        self.baseline += steps

    def top_up(self, now: float) -> None:
        """The trainer waits for data we think is in flight: it was lost (a restarted
        assembler) or is held in partial trajectories longer than we allowed for. Doubling, but
        never more than one window at a time: while the assembler holds intake, queues (not
        stepping) would absorb the credit. Nothing yet for a cause not known before the
        patience is over."""
        grant = min(max(self.batch_steps, self.extra), self.window())
        explained = self.lost + self.room_short()
        if explained > 0:
            grant = min(grant, explained)
            self.lost -= min(self.lost, grant)
        elif self.starving_since is not None and now - self.starving_since >= STARVING_PATIENCE_S:
            self.starving_since = now  # the next one as much later
            self.unexplained += 1
        else:
            return
        self.baseline += grant
        self.granted += grant
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
            # The give-up clock runs only while the trainer says, and still says, it starves:
            # the seconds of an update (it says nothing then) never count towards it.
            if not (credit.starving and now - credit.reported_at <= STARVING_CLAIM_FRESH_S):
                self.waiting_since = None
                return Due(wait=True)
            self.waiting_since = now if self.waiting_since is None else self.waiting_since
            due.waited_s = now - self.waiting_since
            if due.waited_s < DETERMINISM_GIVE_UP_S:
                return Due(wait=True)
            # It will never have them (lost data, or a horizon longer than the window allows).
            credit.start += short
            due.abandoned = short
        self.waiting_since = None
        while self.pending and (self.pending[0][0] <= limit or not loaded):
            _, due.version, due.weights = self.pending.popleft()
            loaded = True
        return due
