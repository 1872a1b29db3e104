"""The trainer slot's state machine in-process, supervising real short-lived child processes
(small Python programs in place of `stepbus learner`), time from an explicit clock, its swap
replies read back from an outbox. A real learner under a real pipeline is test_trainer_slot's."""

from __future__ import annotations

import functools
import logging
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ManualClock, wait_for

from stepbus import cli
from stepbus.bus import controller, node, supervisor
from stepbus.bus import protocol as p
from stepbus.trainer import slot

T0 = 1000.0
EXITS_3 = "import sys; sys.exit(3)"
EXITS_0 = "import sys; sys.exit(0)"
# Beats once, saying it started, then sleeps; with --bad among its flags it exits 5 at once (a
# refused setting); with --slow FILE it waits for FILE before it goes on (a start-up slower
# than the probation: imports from a cold disk), with --slow-bad FILE it then exits 2 without
# a beat, and with --late-bad FILE it beats first (its setup running), then exits 2 without
# saying it started (a checkpoint that does not fit the new model).
LEARNER = """
import os, sys, time
beats = int(os.environ["STEPBUS_BEAT_FD"])
if "--bad" in sys.argv:
    sys.exit(5)
if "--late-bad" in sys.argv:
    os.write(beats, b".")
for flag in ("--slow", "--slow-bad", "--late-bad"):
    if flag in sys.argv:
        while not os.path.exists(sys.argv[sys.argv.index(flag) + 1]):
            time.sleep(0.01)
if "--slow-bad" in sys.argv or "--late-bad" in sys.argv:
    sys.exit(2)
os.write(beats, b".!")
time.sleep(60)
"""
# Beats once it ignores SIGTERM, then sleeps: only SIGKILL ends it.
STUBBORN = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.write(int(os.environ["STEPBUS_BEAT_FD"]), b".")
time.sleep(60)
"""
SILENT = "import time; time.sleep(60)"
# Beats once, saying it started, then keeps a core busy without beating again.
SPINS = """
import os
os.write(int(os.environ["STEPBUS_BEAT_FD"]), b".!")
while True:
    pass
"""
# The same, but the CPU is a thread's while the main thread waits for it (asleep).
WAITS_ON_A_BUSY_THREAD = """
import os, threading
os.write(int(os.environ["STEPBUS_BEAT_FD"]), b".!")
def spin():
    while True:
        pass
busy = threading.Thread(target=spin)
busy.start()
busy.join()
"""
# Beats once, beats again once the file after --cue exists, then sleeps.
BEATS_ON_CUE = """
import os, sys, time
beats = int(os.environ["STEPBUS_BEAT_FD"])
os.write(beats, b".")
while not os.path.exists(sys.argv[sys.argv.index("--cue") + 1]):
    time.sleep(0.01)
os.write(beats, b".")
time.sleep(60)
"""


class Bench:
    """One slot object running `code` as its learner, on an outbox."""

    def __init__(self, code: str, *, args: tuple[str, ...] = (),
                 problem: str = "") -> None:
        self.clock = ManualClock(T0)
        self.out = node.Outbox()
        self.slot = slot.Slot(self.out, logging.getLogger("test.slot"), name="slot",
                              args=list(args), validate=lambda flags: problem,
                              merge=cli.merged_learner_flags,
                              command=[sys.executable, "-c", code], clock=self.clock)

    def at(self, t: float) -> None:
        """The due timers at T0 + t. The slot looks at its child (`tick`) only in `wait_exit`
        and `wait_beat`, so a child that exits quickly is seen where the test expects it."""
        self.clock.t = T0 + t
        self.slot.run_timers(self.clock.t)

    def learner(self) -> supervisor.Running:
        assert self.slot.learner is not None, "a learner is running"
        return self.slot.learner

    def wait_exit(self, t: float) -> int:
        """Wait (really) for the learner to exit, then let the slot see it at T0 + t."""
        lrn = self.learner()
        code = lrn.popen.wait(10)
        self.clock.t = T0 + t
        self.slot.tick(self.clock.t)
        assert self.slot.learner is None, "the slot noticed the exit"
        return code

    def wait_beat(self, t: float) -> None:
        """Wait (really) until the learner has written its beat, then let the slot read it."""
        beats = self.learner().beats
        assert beats is not None, "the learner beats through a pipe"
        assert select.select([beats], [], [], 10)[0], "the learner beat"
        self.clock.t = T0 + t
        self.slot.tick(self.clock.t)
        assert self.learner().last_beat == T0 + t

    def replies(self) -> list[p.Message]:
        return self.out.take(p.Reply, port="controller")


@pytest.fixture
def benches() -> Iterator[list[Bench]]:
    made: list[Bench] = []
    yield made
    for bench in made:
        bench.slot.kill_child()


def test_learners_dying_young_are_restarted_after_the_backoff_schedule_then_given_up_on(
        benches: list[Bench], caplog: pytest.LogCaptureFixture):
    bench = Bench(EXITS_3)
    benches.append(bench)
    bench.at(0.0)
    assert bench.slot.counts.starts == 1
    t, delays = 0.0, []
    for deaths in range(1, supervisor.QUICK_DEATHS_LIMIT):
        bench.wait_exit(t + 0.1)
        assert bench.slot.figures()["state"] == "restarting"
        delay = bench.slot.timers["restart"].due - bench.clock.t
        delays.append(round(delay, 6))
        bench.at(t + 0.1 + delay - 0.01)
        assert bench.slot.learner is None, "not before its delay"
        t = t + 0.1 + delay
        bench.at(t)
        assert bench.slot.counts.starts == deaths + 1
    assert delays == [0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
    assert "exit code 3 after 0.1s; starting a new one in 0.5s" in caplog.text
    bench.wait_exit(t + 0.1)  # the seventh quick death in a row: the slot gives up
    figures = bench.slot.figures()
    assert (figures["deaths"], figures["last_death"], figures["state"]) == (
        7, "exit code 3", "gave up")
    assert bench.slot.stop_reason == "gave up on the learner" and "restart" not in bench.slot.timers
    assert "learner died 7 times in a row, each within 30s of its start" in caplog.text


def test_a_learner_that_ran_steadily_is_restarted_at_once_and_one_that_exited_0_after_1s(
        benches: list[Bench]):
    bench = Bench(EXITS_3)
    benches.append(bench)
    bench.at(0.0)
    bench.wait_exit(0.1)
    bench.at(0.6)
    bench.wait_exit(1.0 + supervisor.STEADY_S)  # it ran STEADY_S: the quick deaths start over
    assert bench.slot.timers["restart"].due == bench.clock.t
    assert supervisor.restart_delay(0, 3) == 0.0
    assert supervisor.restart_delay(0, 0) == 1.0, "it left on its own: a shutdown may be coming"
    assert supervisor.restart_delay(4, 0) == 5.0

    leaves = Bench(EXITS_0)
    benches.append(leaves)
    leaves.at(0.0)
    leaves.wait_exit(supervisor.STEADY_S + 1)
    assert leaves.slot.timers["restart"].due == leaves.clock.t + 1.0
    assert leaves.slot.figures()["last_death"] == "exit code 0"


def test_a_learner_silent_past_its_allowance_is_killed_as_frozen_and_replaced(
        benches: list[Bench], caplog: pytest.LogCaptureFixture):
    bench = Bench(SILENT)
    benches.append(bench)
    bench.at(0.0)
    bench.at(supervisor.STARTUP_GRACE_S - 0.1)
    assert bench.learner().popen.poll() is None, "in its start-up grace"
    bench.at(supervisor.STARTUP_GRACE_S + 0.1)
    assert bench.wait_exit(supervisor.STARTUP_GRACE_S + 0.2) == -signal.SIGKILL
    figures = bench.slot.figures()
    assert (figures["frozen"], figures["last_death"]) == (1, "frozen, killed")
    assert "sent no heartbeat for 30.1s (frozen?); killing it" in caplog.text

    beats_once = Bench(SPINS)  # running: only the whole allowance makes it frozen
    benches.append(beats_once)
    beats_once.at(0.0)
    beats_once.wait_beat(1.0)  # out of its start-up grace: LEARNER_SILENT_S from now on
    beats_once.at(1.0 + supervisor.SILENT_S - 0.1)
    assert beats_once.learner().popen.poll() is None
    beats_once.at(1.0 + supervisor.SILENT_S + 0.1)
    assert beats_once.wait_exit(5.0) == -signal.SIGKILL
    assert beats_once.slot.figures()["last_death"] == "frozen, killed"


HALF = supervisor.stuck_after(supervisor.SILENT_S)  # the liveness bound, by default


def test_a_stopped_learner_is_continued_at_half_its_allowance_and_killed_if_stopped_unheard(
        benches: list[Bench], caplog: pytest.LogCaptureFixture):
    """Stopped by a signal, it goes on where it stopped (SIGCONT); stopped again before it
    beats (something keeps stopping it), it is killed rather than continued for ever."""
    bench = Bench(LEARNER)
    benches.append(bench)
    bench.at(0.0)
    bench.wait_beat(1.0)
    pid = bench.learner().popen.pid
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: supervisor.process_state(pid)[0] == "T", 10, "the learner stopped")
    bench.at(1.0 + HALF - 0.1)
    assert supervisor.process_state(pid)[0] == "T"
    bench.at(1.0 + HALF + 0.01)
    wait_for(lambda: supervisor.process_state(pid)[0] != "T", 10, "the learner continued")
    assert not bench.learner().killed_frozen and bench.learner().popen.poll() is None
    assert f"sent no heartbeat for {HALF + 0.01:.1f}s and is stopped; resuming it" in caplog.text
    figures = bench.slot.figures()
    assert (figures["resumed"], figures["frozen"], figures["deaths"]) == (1, 0, 0)
    assert bench.slot.timers["silence"].due == bench.clock.t + supervisor.STUCK_LOOK_S
    os.kill(pid, signal.SIGSTOP)  # it has not beaten since: it is not continued twice
    wait_for(lambda: supervisor.process_state(pid)[0] == "T", 10, "the learner stopped again")
    bench.at(1.0 + HALF + 0.01 + supervisor.STUCK_LOOK_S)
    assert bench.learner().killed_frozen
    assert bench.wait_exit(1.0 + HALF + 0.5) == -signal.SIGKILL
    assert "and is stopped again, unheard since it was continued; killing it" in caplog.text

    silent = Bench(SILENT)  # never beat at all: frozen past its start-up grace, stopped or not
    benches.append(silent)
    silent.at(0.0)
    spid = silent.learner().popen.pid
    os.kill(spid, signal.SIGSTOP)
    wait_for(lambda: supervisor.process_state(spid)[0] == "T", 10, "the learner stopped")
    silent.at(supervisor.STARTUP_GRACE_S + 0.1)  # out of its grace without a beat: frozen
    assert silent.wait_exit(supervisor.STARTUP_GRACE_S + 0.2) == -signal.SIGKILL
    assert silent.slot.figures()["last_death"] == "frozen, killed"


def test_a_learner_asleep_without_using_the_cpu_is_killed_a_look_after_half_its_allowance(
        benches: list[Bench], caplog: pytest.LogCaptureFixture):
    """Silent and asleep (a deadlock, a wait that never ends): the first look at half the
    allowance notes its CPU time, the next finds it unchanged."""
    bench = Bench(LEARNER)  # beats, then sleeps
    benches.append(bench)
    bench.at(0.0)
    bench.wait_beat(1.0)
    pid = bench.learner().popen.pid
    wait_for(lambda: supervisor.process_state(pid)[0] == "S", 10, "the learner asleep")
    bench.at(1.0 + HALF + 0.01)
    assert not bench.learner().killed_frozen, "one look is not enough"
    bench.at(1.0 + HALF + supervisor.STUCK_LOOK_S + 0.02)
    assert bench.learner().killed_frozen
    assert bench.wait_exit(1.0 + HALF + 0.5) == -signal.SIGKILL
    assert "and is asleep without using the CPU; killing it" in caplog.text


def test_a_learner_busy_on_the_cpu_has_its_whole_allowance(benches: list[Bench],
                                                           caplog: pytest.LogCaptureFixture):
    """One long call, a machine that starves it: running, so only SILENT_S makes it frozen."""
    bench = Bench(SPINS)
    benches.append(bench)
    bench.at(0.0)
    bench.wait_beat(1.0)
    for t in (HALF + 0.01, HALF + 0.3, HALF + 0.6, supervisor.SILENT_S - 0.1):
        bench.at(1.0 + t)
        assert not bench.learner().killed_frozen, t
    bench.at(1.0 + supervisor.SILENT_S + 0.1)
    assert bench.learner().killed_frozen
    assert bench.wait_exit(1.0 + supervisor.SILENT_S + 0.2) == -signal.SIGKILL
    assert "(frozen?); killing it" in caplog.text


def test_a_learner_asleep_while_its_threads_use_the_cpu_has_its_whole_allowance(
        benches: list[Bench]):
    """The main thread asleep, another computing (a torch op, say): the CPU ticks the looks
    read are the whole process's, so it is running, and only SILENT_S makes it frozen."""
    bench = Bench(WAITS_ON_A_BUSY_THREAD)
    benches.append(bench)
    bench.at(0.0)
    bench.wait_beat(1.0)
    pid = bench.learner().popen.pid
    wait_for(lambda: supervisor.process_state(pid)[0] == "S", 10, "its main thread asleep")
    for t in (HALF + 0.01, HALF + 0.3, supervisor.SILENT_S - 0.1):
        wait_for(functools.partial(cpu_used, pid, supervisor.process_state(pid)[1]), 10,
                 "its thread's CPU")
        bench.at(1.0 + t)
        assert supervisor.process_state(pid)[0] == "S" and not bench.learner().killed_frozen, t
    bench.at(1.0 + supervisor.SILENT_S + 0.1)
    assert bench.learner().killed_frozen
    assert bench.wait_exit(1.0 + supervisor.SILENT_S + 0.2) == -signal.SIGKILL


def cpu_used(pid: int, ticks: int | None) -> bool:
    """Whether the process has used CPU since it had used `ticks`."""
    return supervisor.process_state(pid)[1] != ticks


def test_the_stuck_bound_is_half_the_allowance_never_under_the_liveness_bound() -> None:
    assert supervisor.stuck_after(supervisor.SILENT_S) == node.LIVENESS_S == 1.5
    assert supervisor.stuck_after(10.0) == 5.0
    assert supervisor.stuck_after(1.0) == 1.0, "at most the allowance itself"


def test_silence_is_judged_after_reading_the_pipe_and_not_across_the_slots_own_stall(
        benches: list[Bench], tmp_path: Path):
    """A beat written while the silence timer was due is read before the verdict; a stall of
    the supervisor itself (stopped, starved of CPU) gives its child a new allowance."""
    cue = tmp_path / "cue"
    bench = Bench(BEATS_ON_CUE, args=("--cue", str(cue)))
    benches.append(bench)
    bench.at(0.0)
    bench.wait_beat(1.0)
    cue.touch()
    beats = bench.learner().beats
    assert beats is not None and select.select([beats], [], [], 10)[0], "the second beat"
    due = 1.0 + supervisor.SILENT_S + 0.1
    bench.at(due)  # the timer fires before any `tick` has read the second beat
    assert bench.learner().popen.poll() is None and not bench.learner().killed_frozen
    assert bench.learner().last_beat == T0 + due

    stalled_until = due + 10.0
    bench.clock.t = bench.slot.now = T0 + stalled_until
    bench.slot.on_stalled(10.0)
    bench.at(stalled_until)
    assert not bench.learner().killed_frozen, "its silence was the slot's own stall"
    bench.at(stalled_until + supervisor.SILENT_S + 0.1)
    assert bench.learner().killed_frozen, "silent for the allowance after the stall"
    assert bench.wait_exit(stalled_until + supervisor.SILENT_S + 0.2) == -signal.SIGKILL


def test_a_swap_stops_the_learner_starts_one_with_the_new_flags_and_replies_after_probation(
        benches: list[Bench]):
    bench = Bench(LEARNER, args=("--lr", "0.1"))
    benches.append(bench)
    bench.at(0.0)
    first = bench.learner().popen.pid
    bench.slot.deliver(b"", p.TrainerSwap(slot="", args=["--lr", "0.2"]), now=T0 + 1)
    assert bench.slot.figures()["state"] == "swapping"
    assert bench.slot.child is supervisor.Child.STOPPING
    bench.slot.deliver(b"", p.TrainerSwap(slot="", args=[]), now=T0 + 1.1)
    assert bench.replies() == [p.Reply(ok=False, detail="a swap is already under way")]
    assert bench.wait_exit(1.2) == -signal.SIGUSR1, "asked to checkpoint and leave"
    assert bench.slot.child is supervisor.Child.WAITING and bench.slot.counts.deaths == 0
    bench.at(1.2)
    assert bench.slot.child is supervisor.Child.RUNNING
    second = bench.learner().popen.pid
    assert second != first and bench.learner().popen.args[-2:] == ["--lr", "0.2"]
    assert "0.1" not in bench.learner().popen.args, "a swapped flag's earlier value goes"
    bench.wait_beat(1.3)
    bench.at(1.2 + slot.PROBATION_S - 0.1)
    assert bench.replies() == []
    bench.at(1.2 + slot.PROBATION_S)
    assert bench.replies() == [p.Reply(
        ok=True, detail=f"learner pid {second} running with --lr 0.2")]
    assert (bench.slot.swaps, bench.slot.counts.deaths) == (1, 0)
    assert bench.slot.figures()["state"] == "running"


def test_a_swap_under_way_when_the_run_ends_is_answered_as_the_slot_leaves(
        benches: list[Bench]):
    """The run ending during the probation (or before the new learner started) still answers
    `stepbus trainer swap`, which would otherwise wait out its timeout."""
    bench = Bench(LEARNER, args=("--lr", "0.1"))
    benches.append(bench)
    bench.at(0.0)
    bench.slot.deliver(b"", p.TrainerSwap(slot="", args=["--lr", "0.2"]), now=T0 + 1)
    bench.wait_exit(1.2)
    bench.at(1.2)
    second = bench.learner().popen.pid
    bench.slot.deliver(b"", p.Shutdown(reason="stepbus shutdown"), now=T0 + 2)
    assert bench.replies() == [p.Reply(ok=True, detail=(
        f"learner pid {second} ran with --lr 0.2 until the slot stopped (stepbus "
        f"shutdown), before it was proven"))]
    assert bench.slot.swaps == 1
    bench.at(2.0 + slot.PROBATION_S)
    assert bench.replies() == [], "one answer"

    early = Bench(LEARNER)
    benches.append(early)
    early.at(0.0)
    early.slot.deliver(b"", p.TrainerSwap(slot="", args=["--lr", "0.2"]), now=T0 + 1)
    early.slot.deliver(b"", p.Shutdown(reason="stepbus shutdown"), now=T0 + 1.1)
    assert early.replies() == [p.Reply(ok=False, detail=(
        "the slot stopped (stepbus shutdown) before the new learner started"))]
    assert early.slot.swaps == 0


def test_a_swapped_in_learner_that_exits_in_probation_is_reverted_and_a_refused_swap_stops_nothing(
        benches: list[Bench]):
    bench = Bench(LEARNER)
    benches.append(bench)
    bench.at(0.0)
    bench.slot.deliver(b"", p.TrainerSwap(slot="", args=["--bad"]), now=T0 + 1)
    bench.wait_exit(1.1)
    bench.at(1.1)
    assert bench.wait_exit(1.6) == 5
    (reply,) = bench.replies()
    assert isinstance(reply, p.Reply) and not reply.ok
    assert reply.detail == ("the new learner exit code 5 after 0.5s (its log is above); back "
                            "to the previous settings")
    bench.at(1.6)
    popen = bench.learner().popen
    assert isinstance(popen, subprocess.Popen) and isinstance(popen.args, list)
    assert "--bad" not in popen.args, "the previous settings are back"
    bench.at(10.0)
    assert bench.replies() == [], "no probation reply for a reverted swap"
    counts = bench.slot.counts
    assert (bench.slot.swaps, bench.slot.swaps_reverted, counts.deaths) == (0, 1, 0)

    refused = Bench(LEARNER, problem="unrecognized arguments: --no-such-flag 1")
    benches.append(refused)
    refused.at(0.0)
    pid = refused.learner().popen.pid
    refused.slot.deliver(b"", p.TrainerSwap(slot="", args=["--no-such-flag", "1"]), now=T0 + 1)
    assert refused.replies() == [p.Reply(
        ok=False, detail="learner flags refused: unrecognized arguments: --no-such-flag 1")]
    refused.at(2.0)
    assert refused.learner().popen.pid == pid and refused.learner().popen.poll() is None


def swapped_in_slowly(benches: list[Bench], flag: str, go: Path) -> Bench:
    """A slot whose swapped-in learner (`flag` FILE) is still starting 1 s after its
    probation ran out: not proven yet."""
    bench = Bench(LEARNER)
    benches.append(bench)
    bench.at(0.0)
    bench.slot.deliver(b"", p.TrainerSwap(slot="", args=[flag, str(go)]), now=T0 + 1)
    bench.wait_exit(1.1)
    bench.at(1.1)
    bench.at(1.1 + slot.PROBATION_S + 1)
    assert bench.replies() == [] and bench.slot.figures()["state"] == "swapping"
    return bench


def test_a_swapped_in_learner_still_starting_when_its_probation_ends_is_proven_once_started(
        benches: list[Bench], tmp_path: Path):
    """A start-up slower than the probation (imports from a cold disk, checks once the
    spaces arrive): the swap is proven only once the new learner says it started, so a
    setting it refuses late (exit 2) still reverts the swap instead of ending the slot, and
    with it the run."""
    for flag in ("--slow-bad", "--late-bad"):  # refused before its first beat, or after it
        refusing = swapped_in_slowly(benches, flag, tmp_path / flag)
        if flag == "--late-bad":
            refusing.wait_beat(1.1 + slot.PROBATION_S + 1.5)
            assert refusing.replies() == [], "beating, but not started: not proven"
        (tmp_path / flag).touch()
        assert refusing.wait_exit(1.1 + slot.PROBATION_S + 2) == 2
        (reply,) = refusing.replies()
        assert isinstance(reply, p.Reply) and not reply.ok and "exit code 2" in reply.detail
        assert refusing.slot.stop_reason == "" and refusing.slot.counts.deaths == 0, flag
        assert refusing.slot.swaps_reverted == 1

    slow = swapped_in_slowly(benches, "--slow", tmp_path / "ready")
    (tmp_path / "ready").touch()
    slow.wait_beat(1.1 + slot.PROBATION_S + 2)
    assert slow.replies() == [p.Reply(ok=True, detail=(
        f"learner pid {slow.learner().popen.pid} running with --slow {tmp_path / 'ready'}"))]
    assert slow.slot.swaps == 1

    # One that never beats is answered all the same, START_WAIT_S after its start: before the
    # controller gives up on the swap and answers it itself (its SWAP_TIMEOUT_S).
    stuck = swapped_in_slowly(benches, "--slow", tmp_path / "never")
    stuck.at(1.1 + slot.START_WAIT_S - 0.1)
    assert stuck.replies() == []
    stuck.at(1.1 + slot.START_WAIT_S)
    [reply] = stuck.replies()
    assert isinstance(reply, p.Reply) and reply.ok and stuck.slot.swaps == 1
    assert reply.detail.endswith(f"not started after {slot.START_WAIT_S:g}s (a setting it "
                                 "refuses now ends the run)"), reply.detail
    assert slot.START_WAIT_S + supervisor.STOP_GRACE_S < controller.SWAP_TIMEOUT_S


def test_on_shutdown_the_learner_gets_sigterm_then_sigkill_after_the_grace_and_the_loop_ends(
        benches: list[Bench], caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO)
    bench = Bench(STUBBORN)
    benches.append(bench)
    bench.at(0.0)
    bench.wait_beat(0.5)  # it ignores SIGTERM by now
    bench.slot.deliver(b"", p.Shutdown(reason="stepbus shutdown"), now=T0 + 1)
    bench.slot.deliver(b"", p.TrainerSwap(slot="", args=[]), now=T0 + 1)
    assert bench.replies() == [p.Reply(ok=False, detail="the slot is stopping")], \
        "no swap while stopping, and the asker is told at once"
    assert bench.slot.figures()["state"] == "stopping" and not bench.slot.stop_reason
    bench.at(1.0 + supervisor.STOP_GRACE_S - 0.1)
    assert bench.learner().popen.poll() is None
    bench.at(1.0 + supervisor.STOP_GRACE_S + 0.1)
    assert bench.wait_exit(6.0) == -signal.SIGKILL
    assert "learner did not stop within 4s; killing it" in caplog.text
    assert "learner stopped (killed by SIGKILL)" in caplog.text
    assert bench.slot.stop_reason == "stepbus shutdown"
    assert bench.slot.counts.deaths == 0 and "restart" not in bench.slot.timers

    polite = Bench(LEARNER)
    benches.append(polite)
    polite.at(0.0)
    polite.clock.t = T0 + 1
    polite.slot.on_signal("SIGINT")
    assert polite.wait_exit(1.1) == -signal.SIGTERM
    assert polite.slot.stop_reason == "SIGINT"

    waiting = Bench(EXITS_3)
    benches.append(waiting)
    waiting.at(0.0)
    waiting.wait_exit(0.1)
    waiting.slot.deliver(b"", p.RunState(run_id="r", epoch=0, options={}, shutting_down=True),
                         now=T0 + 0.2)
    assert waiting.slot.stop_reason == "controller shutdown", "no learner: it stops at once"
    waiting.at(5.0)
    assert waiting.slot.learner is None, "and starts none"


def test_a_swaps_flags_replace_the_ones_they_set_again_and_keep_the_rest() -> None:
    """However many swaps, one value per setting: aliases name one setting, values run to
    the next flag (several, or negative), `--flag=value` is the same flag."""
    merged = cli.merged_learner_flags(
        ["--lr", "0.1", "--hidden", "64", "64", "--seed", "3", "--log-std-init", "-1",
         "--norm-obs"],
        ["--learning-rate=0.2", "--hidden", "32", "--log-std-init", "-2"])
    assert merged == ["--seed", "3", "--norm-obs", "--learning-rate=0.2", "--hidden", "32",
                      "--log-std-init", "-2"]
    flags: list[str] = []
    for i in range(100):
        flags = cli.merged_learner_flags(flags, ["--lr", str(i)])
    assert flags == ["--lr", "99"]
