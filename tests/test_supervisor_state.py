"""The supervisor's state machine in-process, supervising real short-lived child processes
(small Python programs in place of a role), time from an explicit clock. The restart schedule
it shares with the trainer slot is test_slot_state's; every role under honcho with kill -9 is
test_supervision's."""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import ManualClock, wait_for

from stepbus.bus import node, supervisor
from stepbus.bus import protocol as p

T0 = 1000.0
CRASHES = "import sys; print('starting', file=sys.stderr); raise ValueError('env exploded')"
EXITS_0 = "import sys; sys.exit(0)"
SLEEPS = "import time; time.sleep(60)"
BEATS_ONCE = "import os, time; os.write(int(os.environ['STEPBUS_BEAT_FD']), b'.'); time.sleep(60)"


class Bench:
    """One supervisor object running `code` as its child, on an outbox."""

    def __init__(self, code: str, **kwargs: object) -> None:
        self.clock = ManualClock(T0)
        self.sup = supervisor.Supervisor(
            node.Outbox(), logging.getLogger("test.supervisor"), name="worker.1",
            command=[sys.executable, "-c", code], args=[], noun="worker", clock=self.clock,
            **kwargs)  # type: ignore[arg-type]

    def at(self, t: float) -> None:
        self.clock.t = T0 + t
        self.sup.run_timers(self.clock.t)

    def child(self) -> supervisor.Running:
        assert self.sup.running is not None, "a child is running"
        return self.sup.running

    def wait_exit(self, t: float) -> int:
        """Wait (really) for the child to exit, then let the supervisor see it at T0 + t."""
        code = self.child().popen.wait(10)
        self.clock.t = T0 + t
        self.sup.tick(self.clock.t)
        assert self.sup.running is None, "the supervisor noticed the exit"
        return code


@pytest.fixture
def benches() -> Iterator[list[Bench]]:
    made: list[Bench] = []
    yield made
    for bench in made:
        bench.sup.kill_child()


def test_a_worker_that_keeps_crashing_is_given_up_on_with_its_last_error_and_not_restarted(
        benches: list[Bench], caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture[str]):
    bench = Bench(CRASHES, give_up=supervisor.GiveUp.STAY, quick_deaths_limit=2)
    benches.append(bench)
    bench.at(0.0)
    assert bench.wait_exit(0.2) == 1
    assert bench.sup.figures()["last_error"] == "ValueError: env exploded"
    assert "worker (pid" in caplog.text and "exit code 1 after 0.2s (last error: ValueError: " \
        "env exploded); starting a new one in 0.5s" in caplog.text
    bench.at(0.7)
    bench.wait_exit(0.9)
    figures = bench.sup.figures()
    assert (figures["state"], figures["deaths"], figures["starts"]) == ("gave up", 2, 2)
    assert not bench.sup.stop_reason, "a worker's supervisor stays, reporting"
    bench.at(100.0)
    assert bench.sup.running is None and "restart" not in bench.sup.timers
    assert "worker died 2 times in a row" in caplog.text
    assert capfd.readouterr().err.count("ValueError: env exploded") == 2, "stderr passed on"


def test_giving_up_on_a_role_the_run_needs_stops_the_supervisor(benches: list[Bench]):
    bench = Bench(CRASHES, quick_deaths_limit=1)
    benches.append(bench)
    bench.at(0.0)
    bench.wait_exit(0.1)
    assert bench.sup.gave_up and bench.sup.stop_reason == "gave up on the worker"


def test_a_child_that_exits_0_ends_its_supervisor_and_a_signal_is_passed_on(
        benches: list[Bench]):
    bench = Bench(EXITS_0)
    benches.append(bench)
    bench.at(0.0)
    assert bench.wait_exit(0.1) == 0
    assert bench.sup.stop_reason == "worker exited 0" and bench.sup.counts.deaths == 0

    signalled = Bench(SLEEPS)
    benches.append(signalled)
    signalled.at(0.0)
    signalled.sup.on_signal("SIGTERM")
    assert signalled.wait_exit(0.1) == -signal.SIGTERM
    assert signalled.sup.stop_reason == "SIGTERM" and signalled.sup.counts.deaths == 0


def test_after_a_shutdown_the_child_may_leave_by_itself_and_is_not_restarted(
        benches: list[Bench]):
    bench = Bench(SLEEPS)
    benches.append(bench)
    bench.at(0.0)
    bench.sup.deliver(b"", p.Shutdown(reason="stepbus shutdown"), now=T0 + 1)
    bench.at(1.0 + supervisor.SHUTDOWN_WAIT_S - 0.1)
    assert bench.child().popen.poll() is None, "it has its time to leave"
    bench.at(1.0 + supervisor.SHUTDOWN_WAIT_S + 0.1)
    assert bench.wait_exit(1.0 + supervisor.SHUTDOWN_WAIT_S + 0.2) == -signal.SIGTERM
    assert bench.sup.stop_reason == "stepbus shutdown"

    idle = Bench(CRASHES)
    benches.append(idle)
    idle.at(0.0)
    idle.wait_exit(0.1)  # waiting 0.5 s to restart it when the shutdown comes
    idle.sup.deliver(b"", p.Shutdown(reason="stepbus shutdown"), now=T0 + 0.2)
    assert idle.sup.stop_reason == "stepbus shutdown" and "restart" not in idle.sup.timers


def test_a_child_that_exits_2_has_a_bad_setting_and_is_given_up_on_at_once_even_a_worker(
        benches: list[Bench], caplog: pytest.LogCaptureFixture):
    bench = Bench("import sys; sys.exit(2)", give_up=supervisor.GiveUp.STAY)
    benches.append(bench)
    bench.at(0.0)
    assert bench.wait_exit(0.1) == 2
    assert bench.sup.gave_up and bench.sup.gave_up_exit == 2, "restarting cannot fix a setting"
    assert "a setting is wrong" in caplog.text


def test_an_exit_2_with_flags_that_ran_for_a_while_is_a_passing_failure_and_restarted(
        benches: list[Bench], caplog: pytest.LogCaptureFixture, tmp_path):
    """Its flags worked (an earlier child ran STEADY_S with them, and did not leave with a 2): a
    2 now is not a bad setting but a passing failure (a simulator's licence server down at a
    restart hours into a run), restarted with the back-off and given up on only after the
    quick deaths."""
    ran = tmp_path / "ran"  # the first child fails (1), every later one exits 2
    bench = Bench(f"import os, sys; p = {str(ran)!r}; "
                  "sys.exit(2 if os.path.exists(p) else open(p, 'w').close() or 1)",
                  give_up=supervisor.GiveUp.STAY, quick_deaths_limit=2)
    benches.append(bench)
    bench.at(0.0)
    assert bench.wait_exit(supervisor.STEADY_S + 1) == 1  # ran long enough: its flags work
    bench.at(supervisor.STEADY_S + 1)
    assert bench.wait_exit(supervisor.STEADY_S + 1.1) == 2
    assert not bench.sup.gave_up, "the flags a child ran 30 s with: a passing failure"
    assert "taken for a passing failure" in caplog.text
    bench.at(supervisor.STEADY_S + 1.6)  # the back-off's 0.5 s
    assert bench.wait_exit(supervisor.STEADY_S + 1.7) == 2
    assert bench.sup.gave_up and bench.sup.gave_up_exit is None, "two quick deaths: a worker stays"


def test_a_child_that_exits_2_late_proves_nothing_and_is_given_up_on_at_once(
        benches: list[Bench]):
    """A setting refused only after a long start (a checkpoint of another model, found after a
    slow resume) is still a bad setting: its own run is no proof of its flags."""
    bench = Bench("import sys; sys.exit(2)", give_up=supervisor.GiveUp.STAY)
    benches.append(bench)
    bench.at(0.0)
    assert bench.wait_exit(supervisor.STEADY_S + 10) == 2
    assert bench.sup.gave_up and bench.sup.gave_up_exit == 2


def test_a_child_that_cannot_be_started_is_a_quick_death_with_the_back_off(
        benches: list[Bench]):
    bench = Bench(SLEEPS)
    benches.append(bench)
    bench.sup.command = ["/nonexistent/python"]
    bench.at(0.0)
    figures = bench.sup.figures()
    assert (figures["state"], figures["deaths"], figures["last_death"]) == (
        "restarting", 1, "not started")
    assert "FileNotFoundError" in figures["last_error"]
    assert bench.sup.timers["restart"].due == T0 + 0.5


def test_a_child_that_dies_while_the_run_shuts_down_is_not_restarted(benches: list[Bench]):
    bench = Bench("import sys, time; time.sleep(0.3); sys.exit(3)")
    benches.append(bench)
    bench.at(0.0)
    bench.sup.deliver(b"", p.Shutdown(reason="stepbus shutdown"), now=T0 + 0.1)
    bench.wait_exit(0.5)
    assert bench.sup.stop_reason == "stepbus shutdown" and "restart" not in bench.sup.timers


def test_a_childs_beat_pipe_is_taken_out_of_its_environment_and_must_be_a_pipe(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """What `STEPBUS_BEAT_FD` names is read once and removed, so a process the child starts
    does not write into whatever that number is there; a number that is not a pipe is no
    supervisor."""
    read_end, write_end = os.pipe()
    try:
        monkeypatch.setenv(node.BEAT_FD_ENV, str(write_end))
        beat = node.SupervisorBeat.from_env()
        assert node.BEAT_FD_ENV not in os.environ
        beat.beat(0.0)
        beat.beat(0.1)  # within the heartbeat interval: nothing more
        assert os.read(read_end, 64) == b"."
    finally:
        os.close(read_end)
        os.close(write_end)
    with open(tmp_path / "log", "w") as file:
        monkeypatch.setenv(node.BEAT_FD_ENV, str(file.fileno()))
        assert node.SupervisorBeat.from_env().fd is None
        monkeypatch.setenv(node.BEAT_FD_ENV, "not a number")
        assert node.SupervisorBeat.from_env().fd is None


def test_with_silence_0_a_child_is_never_taken_for_frozen(benches: list[Bench]) -> None:
    """`--silence-s 0` (and the evaluator's default): a child that never beats is left alone."""
    bench = Bench(SLEEPS, beat_env=node.BEAT_FD_ENV, silent_s=0.0)
    benches.append(bench)
    bench.at(0.0)
    assert "silence" not in bench.sup.timers
    bench.at(supervisor.STARTUP_GRACE_S + supervisor.SILENT_S + 1)
    assert bench.child().popen.poll() is None and bench.sup.figures()["frozen"] == 0
    assert supervisor.default_silence("evaluator") == 0
    assert supervisor.default_silence("broker") == supervisor.SILENT_S


def test_with_an_allowance_no_longer_than_the_liveness_bound_a_stopped_child_is_continued(
        benches: list[Bench]) -> None:
    """`--silence-s 1.5`: stopped and past its whole allowance at the same look, it is still
    continued (SIGCONT), not killed."""
    bench = Bench(BEATS_ONCE, beat_env=node.BEAT_FD_ENV, silent_s=node.LIVENESS_S)
    benches.append(bench)
    bench.at(0.0)
    beats = bench.child().beats
    assert beats is not None and select.select([beats], [], [], 10)[0], "its beat"
    bench.clock.t = T0 + 1.0
    bench.sup.tick(bench.clock.t)
    pid = bench.child().popen.pid
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: supervisor.process_state(pid)[0] == "T", 10, "the child stopped")
    bench.at(1.0 + node.LIVENESS_S + 0.01)
    wait_for(lambda: supervisor.process_state(pid)[0] != "T", 10, "the child continued")
    figures = bench.sup.figures()
    assert (figures["resumed"], figures["frozen"]) == (1, 0)
    assert bench.child().popen.poll() is None and not bench.child().killed_frozen


def test_a_long_call_made_on_purpose_is_beaten_through_from_a_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`node.beating_through`: the supervisor hears the process while one call runs."""
    read_end, write_end = os.pipe()
    monkeypatch.setenv(node.BEAT_FD_ENV, str(write_end))
    node.supervisor_beat.cache_clear()
    try:
        with node.beating_through():
            time.sleep(3 * node.HEARTBEAT_INTERVAL_S)  # the loop's beats cannot come meanwhile
        assert len(os.read(read_end, 64)) >= 2, "a beat every heartbeat interval"
    finally:
        node.supervisor_beat.cache_clear()  # the test process is not supervised
        os.close(read_end)
        os.close(write_end)
