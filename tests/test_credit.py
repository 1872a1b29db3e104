"""The broker's credit window across trainer incarnations: a killed or swapped learner's
successor continues its count of steps, so stepping never runs past the window, however many
learners come and go."""

from __future__ import annotations

from stepbus.bus.credit import INHERIT_S, STARVING_PATIENCE_S, STEER_REPORTS, Credit


def reported(credit: Credit, incarnation: str, consumed: int, starving: bool = False) -> int:
    credit.report(incarnation, consumed, batch_steps=100, starving=starving, now=0.0)
    return credit.outstanding()


def test_a_successor_continues_the_count_and_what_it_takes_in_again_counts_once() -> None:
    credit = Credit(max_steps_ahead=300)
    assert credit.report("l1", 0, 100, False, now=0.0) == "afresh", "the first trainer we hear"
    assert credit.outstanding() == 0
    credit.produced = 1300
    assert reported(credit, "l1", 1000) == 300  # took in all but the last 300
    # l1 dies; its checkpoint held 800 steps: the other 200 it took in come again to l2.
    assert credit.report("l2", 800, 100, False, now=0.0) == "continues"
    assert credit.outstanding() == 500, "200 to take in again and the 300 in flight"
    assert credit.full(), "no stepping past the window while the resent data waits"
    assert reported(credit, "l2", 1000) == 300, "the resent steps counted once"
    assert reported(credit, "l2", 1300) == 0
    assert credit.rebases == 0


def test_swaps_and_kills_in_a_row_never_take_stepping_past_the_window() -> None:
    credit = Credit(max_steps_ahead=300)
    credit.report("l0", 0, 100, False, now=0.0)
    checkpointed, taken = 0, 0
    for k in range(1, 6):
        credit.produced += 300  # a window stepped; the learner takes in 250 of it
        taken += 250
        assert reported(credit, f"l{k - 1}", taken) == credit.produced - taken
        checkpointed = taken - 100  # its last 100 steps were not in a checkpoint
        assert credit.report(f"l{k}", checkpointed, 100, False, now=0.0) == "continues"
        assert credit.outstanding() == credit.produced - checkpointed
        taken = checkpointed + 150  # what comes again, and 50 more
        assert 0 <= reported(credit, f"l{k}", taken) <= credit.window()
    assert credit.rebases == 0


def test_a_trainer_whose_count_does_not_fit_counts_afresh() -> None:
    credit = Credit(max_steps_ahead=300)
    credit.produced = 5000
    credit.report("l1", 4000, 100, False, now=0.0)
    credit.produced = 5200
    assert credit.report("other-run", 10, 100, False, now=0.0) == "afresh", "below where l1 started"
    assert credit.outstanding() == 0 and credit.rebases == 1
    assert credit.report("ahead", 999_999, 100, False, now=0.0) == "afresh", "more than we stepped"
    assert credit.outstanding() == 0 and credit.rebases == 2


def test_a_trainer_at_0_after_its_predecessor_checkpointed_started_a_run_of_its_own() -> None:
    """A learner started on a fresh run directory counts from 0, as a successor of a learner
    that never checkpointed does; only the predecessor's checkpoint tells them apart. Taken for
    a successor, its 0 would leave everything the predecessor learned outstanding forever:
    stepping would wait for top-ups."""
    credit = Credit(max_steps_ahead=300)
    assert credit.report("l1", 0, 100, False, checkpointed_steps=0, now=0.0) == "afresh"
    credit.produced = 1000
    credit.report("l1", 900, 100, False, checkpointed_steps=800, now=0.0)
    assert credit.report("fresh", 0, 100, False, now=0.0) == "afresh"
    assert credit.outstanding() == 0 and credit.rebases == 1
    credit.produced = 1200
    credit.report("fresh", 150, 100, False, checkpointed_steps=0, now=0.0)
    assert credit.report("its-successor", 0, 100, False, now=0.0) == "continues", \
        "it never checkpointed"
    assert credit.outstanding() == 200 and credit.rebases == 1


def test_a_trainer_of_another_run_counts_afresh_even_where_its_count_fits() -> None:
    """Counts alone take a learner of another run for a successor when its count fits: one at
    0 after a predecessor that was killed between its first checkpoint and the WEIGHTS that
    would have said so, or one that resumed another run's checkpoint of a similar count. The
    run its WEIGHTS name tells them apart; a trainer that names none is judged by its count."""
    credit = Credit(max_steps_ahead=300)
    assert credit.report("l1", 0, 100, False, run="run-a", now=0.0) == "afresh"
    credit.produced = 1000
    credit.report("l1", 900, 100, False, checkpointed_steps=0, run="run-a", now=0.0)
    assert credit.report("other", 0, 100, False, run="run-b", now=0.0) == "afresh"
    assert credit.outstanding() == 0 and credit.rebases == 1
    credit.produced = 1200
    credit.report("other", 150, 100, False, run="run-b", now=0.0)
    assert credit.report("its-successor", 150, 100, False, run="run-b", now=0.0) == "continues"
    assert credit.report("back-to-a", 150, 100, False, run="run-a", now=0.0) == "afresh"
    assert credit.rebases == 2
    assert credit.report("unnamed", 150, 100, False, now=0.0) == "continues", "judged by its count"
    assert credit.rebases == 2


def test_steps_taken_as_lost_by_a_top_up_that_arrive_after_all_are_taken_back_first() -> None:
    credit = Credit(max_steps_ahead=300)
    credit.report("l1", 0, 100, False, now=0.0)
    credit.produced = 300
    credit.may_have_lost(300)  # an assembler gone with every step in flight
    assert reported(credit, "l1", 0, starving=True) == 200, "one batch granted"
    assert reported(credit, "l1", 250) == 0, "they came after all: the grant is taken back"
    assert credit.granted == 50 and credit.rebases == 0
    assert reported(credit, "l1", 320) == 0, "beyond what we stepped: the scale moves"
    assert credit.rebases == 1
    credit.produced = 400
    assert reported(credit, "l1", 320) == 100


def starving_at(credit: Credit, now: float, batch_steps: int = 100) -> int:
    """A trainer's starving report at `now`: what it was granted."""
    before = credit.outstanding()
    credit.report("l1", 0, batch_steps, True, now=now)
    return before - credit.outstanding()


def test_steps_that_are_only_late_are_waited_for_not_granted() -> None:
    """A frozen or loaded assembler, or a new learner waiting for what the assembler sends it
    again: the trainer starves with the window full while its steps are on their way. Credit
    granted for them would let stepping run that much further past the trainer, and the steps,
    arriving after all, too old to learn from."""
    credit = Credit(max_steps_ahead=300)
    credit.report("l1", 0, 100, False, now=0.0)
    credit.produced = 300
    grants = [starving_at(credit, t) for t in (0.0, 0.25, 1.0, STARVING_PATIENCE_S - 0.1)]
    assert grants == [0, 0, 0, 0] and credit.topups == 0
    # Starving that long with no known fault: steps lost where the broker cannot see. Granted,
    # counted, and the next grant only as long again after.
    assert starving_at(credit, STARVING_PATIENCE_S) == 100 and credit.unexplained == 1
    credit.produced += 100
    assert starving_at(credit, STARVING_PATIENCE_S + 1) == 0
    assert starving_at(credit, 2 * STARVING_PATIENCE_S) == 100 and credit.unexplained == 2
    # A report that is not starving (its steps came) starts the patience again.
    credit.produced += 100
    credit.report("l1", 0, 100, False, now=2 * STARVING_PATIENCE_S + 1)
    assert starving_at(credit, 3 * STARVING_PATIENCE_S) == 0


def test_steps_a_fault_may_have_lost_are_granted_at_once_and_no_more() -> None:
    credit = Credit(max_steps_ahead=300)
    credit.report("l1", 0, 100, False, now=0.0)
    credit.produced = 300
    credit.may_have_lost(1000)
    assert credit.lost == 300, "never more than are in flight"
    grants = []
    for _ in range(4):
        grants.append(starving_at(credit, 0.0))
        credit.produced += grants[-1]  # stepping goes on into the grant
    assert grants == [100, 100, 100, 0], "what may have been lost, in steps of a batch or more"
    assert credit.topups == 3 and credit.unexplained == 0
    credit.may_have_lost(50)  # a worker lost: its steps in flight
    before = credit.outstanding()
    credit.report("l1", 0, 100, False, now=0.5)
    assert before - credit.outstanding() == 50, "granted with the window full, starving or not"


def test_a_fixed_window_too_small_for_the_partial_trajectories_is_grown_at_once() -> None:
    """--max-steps-ahead below what partial trajectories hold: the trainer starves by design,
    and waiting would only stall the run."""
    credit = Credit(max_steps_ahead=256, rows=8, horizon=500)
    credit.report("l1", 0, 256, False, now=0.0)
    credit.produced = 256
    room = 8 * 502 + 256 - 256
    granted = 0
    for _ in range(40):
        granted += starving_at(credit, 0.0, batch_steps=256)
        credit.produced = 256 + granted
    assert granted == room and credit.unexplained == 0
    assert starving_at(credit, 1.0, batch_steps=256) == 0, "beyond that, waited for"


def test_granted_credit_is_taken_back_while_the_data_comes_near_stale() -> None:
    """Top-ups cannot tell lost steps from late ones; the trainer's lag shows steps that came
    after all. With its median over half the bound for STEER_REPORTS reports in a row a batch
    of what was granted comes back, never more than was granted; given again as long within
    3/8 of the bound, and first if the trainer starves."""
    credit = Credit(max_steps_ahead=1000)
    credit.report("l1", 0, 100, False, now=0.0)
    credit.produced = 1000
    credit.steer(9, 8)
    assert credit.braked == 0 and credit.outstanding() == 1000, "nothing granted: nothing back"
    credit.may_have_lost(300)
    grants = []
    for t in (1.0, 1.25, 1.5):
        grants.append(starving_at(credit, t))
        credit.produced += grants[-1]
    assert grants == [100, 100, 100] and credit.granted == 300
    for lag, bound in ((4, 8), (-1, 8), (9, -1), (2**31, 8), (9, 2**31)):
        credit.steer(lag, bound)
        assert credit.braked == 0, "within half the bound, or unknown: kept"
    for _ in range(3):
        credit.steer(5, 8)
    assert credit.braked == 0, "a few versions of old data (what a fault leaves): kept"
    credit.steer(5, 8)
    assert credit.braked == 100, "older for STEER_REPORTS reports in a row: a batch back"
    for _ in range(STEER_REPORTS):
        credit.steer(9, 8)  # most of it dropped as stale: all the more reason
    assert credit.braked == 200
    for _ in range(4 * STEER_REPORTS):
        credit.steer(5, 8)
    assert credit.braked == 300 and credit.granted == 0 and credit.outstanding() == 1300
    for _ in range(STEER_REPORTS):
        credit.steer(3, 8)  # the old data has passed: what was lost was lost after all
    assert credit.braked == 200 and credit.granted == 100
    credit.report("l1", 200, 100, True, now=2.0)  # starving: given again before any top-up
    assert credit.braked == 100 and credit.granted == 200 and credit.topups == 3


def restarted() -> Credit:
    """A broker whose first trainer is mid-run; a window of 2 x 100 + (32 + 2) x 8 = 472."""
    credit = Credit(rows=8)
    assert credit.report("l1", 50_000, 100, False, now=0.0) == "afresh"
    return credit


def steer(credit: Credit, lag: int, reports: int) -> None:
    for _ in range(reports):
        credit.steer(lag, 8)


def test_a_restarted_broker_takes_the_dead_ones_steps_in_flight_as_its_own_while_lag_says_so(
        ) -> None:
    """A restarted broker's first trainer is mid-run; the steps the dead broker left in flight
    then arrive and count as received though we never stepped them: our scale takes as many of
    our own in flight for received. The lag shows it; the brake moves the scale a batch at a
    time, at most a window in all."""
    credit = restarted()
    credit.produced = 472
    assert credit.full()
    credit.report("l1", 50_000 + 472, 100, False, now=0.1)  # some of them the dead broker's
    assert credit.outstanding() == 0, "what the trainer took in, ours or not"
    steer(credit, 6, STEER_REPORTS)
    assert credit.rescaled == 100 and credit.outstanding() == 100 and credit.braked == 0
    steer(credit, 9, 20 * STEER_REPORTS)
    assert credit.rescaled == 472 and credit.outstanding() == 472, "never more than a window"
    assert not credit.inheriting()


def test_a_rescale_ends_once_the_lag_is_back_and_never_starts_late() -> None:
    back = restarted()
    steer(back, 3, STEER_REPORTS)  # young before any rescale: not over yet
    steer(back, 9, STEER_REPORTS)
    assert back.rescaled == 100
    steer(back, 3, STEER_REPORTS)  # back after a rescale: done
    steer(back, 9, STEER_REPORTS)
    assert back.rescaled == 100 and not back.inheriting()

    late = restarted()
    late.report("l1", 50_000, 100, False, now=INHERIT_S)  # a lag this late has other causes
    steer(late, 9, STEER_REPORTS)
    assert late.rescaled == 0


def test_only_a_restarted_broker_rescales_and_not_across_a_new_learner_nor_deterministic(
        ) -> None:
    fresh = Credit(rows=8)
    fresh.report("l1", 0, 100, False, now=0.0)  # a run's start: nothing was in flight
    steer(fresh, 9, STEER_REPORTS)
    assert fresh.rescaled == 0

    again = Credit(rows=8)
    again.report("l1", 0, 100, False, now=0.0)
    again.report("l2", 9_000, 100, False, now=0.1)  # not our first trainer: no dead broker's
    steer(again, 9, STEER_REPORTS)
    assert again.rescaled == 0

    swapped = restarted()
    assert swapped.report("l2", 50_000, 100, False, now=1.0) == "continues"
    steer(swapped, 9, STEER_REPORTS)  # a swap ages data for a moment itself
    assert swapped.rescaled == 0

    deterministic = Credit(rows=8, rescales=False)
    deterministic.report("l1", 50_000, 100, False, now=0.0)
    steer(deterministic, 9, STEER_REPORTS)
    assert deterministic.rescaled == 0, "its due versions sit on the scale"


def test_a_rescale_that_went_too_far_is_given_back_a_batch_at_a_time() -> None:
    starved = restarted()
    steer(starved, 9, 3 * STEER_REPORTS)
    assert starved.rescale_held == 300
    starved.produced = starved.window() - 300  # the window is full
    starved.report("l1", 50_000, 100, True, now=1.0)  # and the trainer starves: too far
    assert starved.rescale_held == 200 and starved.topups == 0, "given back before a top-up"
    steer(starved, 9, STEER_REPORTS)
    assert starved.rescale_held == 200 and starved.rescaled == 300, "and taken no more"

    tight = restarted()
    steer(tight, 9, 3 * STEER_REPORTS)
    steer(tight, 2, 2 * STEER_REPORTS - 1)
    assert tight.rescale_held == 300, "a median lag of 2 now and then is a healthy run's"
    tight.steer(3, 8)
    steer(tight, 2, 2 * STEER_REPORTS)  # the window too tight: stepping waits on it
    assert tight.rescale_held == 200 and not tight.inheriting()
    steer(tight, 1, 6 * STEER_REPORTS)
    assert tight.rescale_held == 0 and tight.outstanding() == 0, "never more than it took"
    assert tight.rescaled == 300
