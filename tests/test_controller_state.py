"""The controller's state machine in-process: decoded messages in, sends read back from an
outbox, time from an explicit clock. The wiring (real processes registering, `stepbus status`,
`reset`, `shutdown`, `trainer swap`) is in test_status, test_barrier, test_faults,
test_pipeline and test_trainer_slot."""

from __future__ import annotations

import logging

import pytest
from conftest import ManualClock

from stepbus.bus import controller, node
from stepbus.bus import protocol as p

T0 = 1000.0
LIVENESS_S = controller.LIVENESS_S


class Bench:
    """One controller object on an outbox, the test playing every process and the CLI."""

    def __init__(self, **cfg: float) -> None:
        self.clock = ManualClock(T0)
        self.out = node.Outbox()
        config = controller.Config(controller="ipc:///sb/controller",
                                   broadcast="ipc:///sb/broadcast", **cfg)  # type: ignore[arg-type]
        self.ctl = controller.Controller(config, self.out, logging.getLogger("test.controller"),
                                         clock=self.clock)

    def beat(self, ident: bytes, role: str, at: float, *, leaving: bool = False,
             **figures: p.Json) -> p.RunState:
        """A heartbeat from `ident`; the run state it was answered with."""
        self.ctl.deliver(ident, p.Heartbeat(role=role, name=ident.decode(), host="h", pid=1,
                                            leaving=leaving, figures=figures), now=at)
        if leaving:
            return self.ctl.state()
        (answer,) = self.to(ident)
        assert isinstance(answer, p.RunState)
        return answer

    def to(self, ident: bytes) -> list[p.Message]:
        """What was sent to `ident` on the ROUTER since the last look."""
        mine = [s.msg for s in self.out.sent if s.to == ident]
        self.out.sent = [s for s in self.out.sent if s.to != ident]
        return mine

    def broadcasts(self) -> list[p.Message]:
        return self.out.take(port="pub")

    def names(self) -> list[str]:
        return [q.name for q in self.ctl.peers.by_id.values()]


def test_a_peer_silent_beyond_the_liveness_interval_expires_and_any_message_keeps_it_alive(
        caplog: pytest.LogCaptureFixture):
    bench = Bench()
    bench.beat(b"w0", "worker", T0)
    bench.beat(b"assembler", "assembler", T0)
    assert bench.ctl.run_timers(T0) == T0 + LIVENESS_S, "the poll waits for the first expiry"
    # Not a heartbeat: a status request from the worker counts as its sign of life.
    bench.ctl.deliver(b"w0", p.StatusRequest(), now=T0 + 1.0)
    bench.out.take()
    next_due = bench.ctl.run_timers(T0 + LIVENESS_S + 0.1)
    assert bench.names() == ["w0"]
    assert "assembler assembler expired (silent 1.6s)" in caplog.text
    assert next_due == T0 + 1.0 + LIVENESS_S
    bench.ctl.run_timers(T0 + 1.0 + LIVENESS_S + 0.1)
    assert bench.names() == []
    assert "worker w0 expired" in caplog.text
    # A message from a process that never registered registers nothing.
    bench.ctl.deliver(b"stranger", p.StatusRequest(), now=T0 + 5)
    assert bench.names() == []


def test_a_heartbeat_registers_is_answered_with_the_run_state_and_leaving_deregisters():
    bench = Bench()
    state = bench.beat(b"broker", "broker", T0, epoch=7)
    assert state.run_id == bench.ctl.run_id and not state.shutting_down
    assert state.epoch == 7, "a restarted controller continues the broker's epochs"
    bench.ctl.deliver(b"assembler", p.Heartbeat(
        role="assembler", name="assembler", host="h", pid=2, leaving=False, figures={},
        binds={"experience": "tcp://*:5557", "bogus": "tcp://*:1", "trajectories": "x"}),
        now=T0)
    (assembler_state,) = bench.to(b"assembler")
    assert isinstance(assembler_state, p.RunState)
    assert assembler_state.endpoints == {"controller": "ipc:///sb/controller",
                               "broadcast": "ipc:///sb/broadcast",
                               "experience": "tcp://*:5557"}
    bench.beat(b"broker", "broker", T0 + 0.5, leaving=True)
    assert bench.names() == ["assembler"]


def test_status_rows_carry_figures_rates_and_the_policy_lag_against_the_newest_version():
    bench = Bench()
    bench.beat(b"learner", "trainer", T0, policy_version=5)
    for i, t in enumerate((T0 + 0.2, T0 + 0.7, T0 + 1.2)):
        bench.beat(b"broker", "broker", t, policy_version=1, env_steps=100 * i)
    bench.ctl.deliver(b"cli", p.StatusRequest(), now=T0 + 1.3)
    (reply,) = bench.to(b"cli")
    assert isinstance(reply, p.StatusReply)
    ctl, learner, broker = reply.processes
    assert (ctl["role"], ctl["processes"], ctl["rejected"]) == ("controller", 2, 0)
    assert learner["policy_lag"] == 0 and broker["policy_lag"] == 4
    assert broker["steps_per_s"] == 200.0
    assert broker["last_heartbeat_s"] == 0.1


def test_a_reset_request_broadcasts_a_barrier_and_the_brokers_done_is_the_requesters_reply():
    bench = Bench()
    bench.beat(b"broker", "broker", T0)
    bench.ctl.deliver(b"cli", p.ResetRequest(options={"level": 2}), now=T0 + 0.1)
    assert bench.broadcasts() == [p.Barrier(epoch=1, options={"level": 2})]
    assert bench.to(b"cli") == [], "no reply before the broker is done"
    state = bench.beat(b"broker", "broker", T0 + 0.2)
    assert (state.epoch, state.options) == (1, {"level": 2}), "late joiners reset with them"

    bench.ctl.deliver(b"cli2", p.ResetRequest(options={}), now=T0 + 0.3)
    assert bench.to(b"cli2") == [p.Reply(ok=False, detail="a reset barrier is already running")]
    bench.ctl.deliver(b"broker", p.BarrierDone(epoch=0, workers_reset=2, workers_lost=0,
                                               errors=[]), now=T0 + 0.4)
    assert bench.to(b"cli") == [], "a done for another epoch is not this barrier's"
    bench.ctl.deliver(b"broker", p.BarrierDone(epoch=1, workers_reset=1, workers_lost=1,
                                               errors=[]), now=T0 + 0.5)
    assert bench.to(b"cli") == [p.Reply(
        ok=True, detail="epoch 1: 1 workers reset, 1 lost during the barrier")]
    bench.ctl.run_timers(T0 + 20)
    assert bench.to(b"cli") == [], "a completed barrier does not time out"


def test_a_barrier_whose_environments_raised_fails_with_their_errors():
    bench = Bench()
    bench.beat(b"broker", "broker", T0)
    bench.ctl.deliver(b"cli", p.ResetRequest(options={"level": 9}), now=T0)
    bench.ctl.deliver(b"broker", p.BarrierDone(epoch=1, workers_reset=1, workers_lost=0,
                                               errors=["ValueError: no level 9"]), now=T0 + 1)
    (reply,) = bench.to(b"cli")
    assert isinstance(reply, p.Reply) and not reply.ok
    assert reply.detail == ("epoch 1: 1 workers reset; environments raised on reset (reset "
                            "again without the options):\nValueError: no level 9")


def test_a_barrier_not_done_by_its_deadline_fails_and_the_next_one_may_start():
    bench = Bench(barrier_timeout_s=2.0)
    bench.ctl.deliver(b"cli", p.ResetRequest(options={}), now=T0)
    assert bench.to(b"cli") == [p.Reply(ok=False, detail="no broker is registered")]
    assert bench.broadcasts() == []

    bench.beat(b"broker", "broker", T0)
    bench.ctl.deliver(b"cli", p.ResetRequest(options={}), now=T0 + 0.5)
    assert bench.ctl.run_timers(T0 + 0.5) == T0 + 1.5, "the broker's expiry comes first"
    bench.beat(b"broker", "broker", T0 + 1.4)
    bench.beat(b"broker", "broker", T0 + 2.4)
    bench.ctl.run_timers(T0 + 2.4)
    assert bench.to(b"cli") == []
    bench.ctl.run_timers(T0 + 2.6)
    assert bench.to(b"cli") == [p.Reply(
        ok=False, detail="reset barrier epoch 1 not completed within 2.0s")]
    bench.ctl.deliver(b"broker", p.BarrierDone(epoch=1, workers_reset=1, workers_lost=0,
                                               errors=[]), now=T0 + 2.7)
    assert bench.to(b"cli") == [], "a done after the deadline answers no one"
    bench.ctl.deliver(b"cli", p.ResetRequest(options={}), now=T0 + 2.8)
    assert bench.broadcasts()[-1] == p.Barrier(epoch=2, options={})


def test_a_swap_goes_to_the_only_slot_and_its_reply_back_to_whoever_asked():
    bench = Bench()
    swap = p.TrainerSwap(slot="", args=["--lr", "0.1"])
    bench.ctl.deliver(b"cli", swap, now=T0)
    assert bench.to(b"cli") == [p.Reply(
        ok=False, detail="no trainer slot is registered (start one with `stepbus trainer`)")]

    bench.beat(b"s1", "slot", T0)
    bench.beat(b"w0", "worker", T0)
    bench.ctl.deliver(b"cli", swap, now=T0 + 0.1)
    assert bench.to(b"s1") == [swap]
    bench.ctl.deliver(b"cli2", swap, now=T0 + 0.2)
    assert bench.to(b"cli2") == [p.Reply(ok=False, detail="a swap is already under way")]

    bench.ctl.deliver(b"w0", p.Reply(ok=True, detail="not mine to give"), now=T0 + 0.3)
    assert bench.out.take() == [] and bench.ctl.rejects.counts["unexpected kind"] == 1
    assert bench.ctl.rejects.by_sender["w0"]["unexpected kind"] == 1
    answer = p.Reply(ok=True, detail="learner pid 9 running with --lr 0.1")
    bench.ctl.deliver(b"s1", answer, now=T0 + 0.4)
    assert bench.to(b"cli") == [answer]
    bench.ctl.deliver(b"s1", answer, now=T0 + 0.5)
    assert bench.out.take() == [], "a second reply is refused, not relayed"
    assert bench.ctl.rejects.by_sender["s1"]["unexpected kind"] == 1
    bench.ctl.run_timers(T0 + 0.5 + controller.SWAP_TIMEOUT_S)
    assert bench.to(b"cli") == [], "an answered swap does not time out"


def test_with_two_slots_a_swap_must_name_one():
    bench = Bench()
    bench.beat(b"s1", "slot", T0)
    bench.beat(b"s2", "slot", T0)
    bench.ctl.deliver(b"cli", p.TrainerSwap(slot="", args=[]), now=T0)
    assert bench.to(b"cli") == [p.Reply(ok=False,
                                        detail="2 trainer slots (s1, s2): name one with --slot")]
    bench.ctl.deliver(b"cli", p.TrainerSwap(slot="nope", args=[]), now=T0)
    assert bench.to(b"cli") == [p.Reply(ok=False,
                                        detail="no trainer slot named 'nope' (slots: s1, s2)")]
    bench.ctl.deliver(b"cli", p.TrainerSwap(slot="s2", args=["--lr", "1"]), now=T0)
    assert bench.to(b"s2") == [p.TrainerSwap(slot="s2", args=["--lr", "1"])]
    assert bench.to(b"s1") == []


def test_a_swap_the_slot_does_not_answer_in_time_fails():
    bench = Bench()
    bench.beat(b"s1", "slot", T0)
    bench.ctl.deliver(b"cli", p.TrainerSwap(slot="", args=[]), now=T0)
    bench.out.take()
    for t in range(1, 30):  # the slot stays alive, but says nothing of the swap
        bench.beat(b"s1", "slot", T0 + t)
        bench.ctl.run_timers(T0 + t)
    assert bench.to(b"cli") == []
    bench.ctl.run_timers(T0 + controller.SWAP_TIMEOUT_S + 0.1)
    assert bench.to(b"cli") == [p.Reply(ok=False,
                                        detail="the trainer slot did not answer within 30s")]
    bench.ctl.deliver(b"s1", p.Reply(ok=True, detail="late"), now=T0 + 31)
    assert bench.out.take() == [], "a late answer is refused"
    bench.ctl.deliver(b"cli", p.TrainerSwap(slot="", args=[]), now=T0 + 31)
    assert bench.to(b"s1") == [p.TrainerSwap(slot="", args=[])], "the next swap may start"


def test_a_swap_whose_slot_leaves_or_goes_silent_fails_at_once():
    """A slot killed mid-swap (SIGKILL: no goodbye) is found by its silence; the CLI hears
    so then, not after SWAP_TIMEOUT_S."""
    bench = Bench()
    bench.beat(b"s1", "slot", T0)
    bench.beat(b"w0", "worker", T0)
    bench.ctl.deliver(b"cli", p.TrainerSwap(slot="", args=[]), now=T0)
    bench.out.take()
    bench.beat(b"w0", "worker", T0 + controller.LIVENESS_S)
    bench.ctl.run_timers(T0 + controller.LIVENESS_S + 0.1)
    assert bench.to(b"cli") == [p.Reply(ok=False, detail=(
        f"trainer slot s1 went silent for {controller.LIVENESS_S + 0.1:.1f}s before answering "
        "the swap"))]
    bench.ctl.run_timers(T0 + controller.SWAP_TIMEOUT_S + 1)
    assert bench.to(b"cli") == [], "answered once, not again at the deadline"

    bench.beat(b"s2", "slot", T0 + 40)
    bench.ctl.deliver(b"cli", p.TrainerSwap(slot="", args=[]), now=T0 + 40)
    assert bench.to(b"s2") == [p.TrainerSwap(slot="", args=[])], "the next swap may start"
    bench.beat(b"w0", "worker", T0 + 40.5, leaving=True)
    assert bench.to(b"cli") == [], "another process leaving is not the slot"
    bench.beat(b"s2", "slot", T0 + 41, leaving=True)
    assert bench.to(b"cli") == [p.Reply(
        ok=False, detail="trainer slot s2 left before answering the swap")]


def test_shutdown_is_rebroadcast_and_the_controller_exits_once_every_process_left():
    bench = Bench()
    for ident, role in ((b"broker", "broker"), (b"w0", "worker"), (b"watch", "cli")):
        bench.beat(ident, role, T0)
    bench.ctl.deliver(b"cli", p.ShutdownRequest(reason="stepbus shutdown"), now=T0 + 0.1)
    assert bench.to(b"cli") == [p.Reply(ok=True, detail="shutting down")]
    assert bench.broadcasts() == [p.Shutdown(reason="stepbus shutdown")]
    assert bench.beat(b"broker", "broker", T0 + 0.15).shutting_down
    bench.ctl.run_timers(T0 + 0.15)
    bench.ctl.run_timers(T0 + 0.3)
    bench.ctl.run_timers(T0 + 0.35)
    assert bench.broadcasts() == [p.Shutdown(reason="shutdown")] * 2, "again for late ears"
    bench.ctl.tick(T0 + 0.35)
    assert not bench.ctl.stop_reason
    bench.beat(b"broker", "broker", T0 + 0.4, leaving=True)
    bench.ctl.tick(T0 + 0.4)
    assert not bench.ctl.stop_reason, "the worker is still there"
    bench.beat(b"w0", "worker", T0 + 0.5, leaving=True)
    bench.ctl.tick(T0 + 0.5)
    assert bench.ctl.stop_reason == "all processes left", "a CLI watching does not count"


def test_after_a_signal_the_controller_broadcasts_shutdown_and_exits_when_the_grace_is_over():
    bench = Bench(shutdown_grace_s=3.0)
    bench.beat(b"w0", "worker", T0)
    bench.clock.t = T0 + 1
    bench.ctl.on_signal("SIGTERM")
    assert bench.broadcasts() == [p.Shutdown(reason="controller received SIGTERM")]
    for t in (T0 + 1.5, T0 + 3.9):  # the worker is frozen: alive to the table, never leaving
        bench.beat(b"w0", "worker", t)
        bench.ctl.tick(t)
    assert not bench.ctl.stop_reason
    bench.ctl.tick(T0 + 4.1)
    assert bench.ctl.stop_reason == "shutdown grace over"


def test_the_run_state_names_the_horizon_the_assembler_reports():
    bench = Bench()
    assert bench.beat(b"broker", "broker", T0).horizon == 0, "no assembler has said yet"
    bench.beat(b"assembler", "assembler", T0, horizon=128)
    assert bench.beat(b"broker", "broker", T0 + 0.5).horizon == 128
    bench.beat(b"worker", "worker", T0 + 0.5, horizon=7)  # only the assembler's counts
    assert bench.beat(b"broker", "broker", T0 + 0.6).horizon == 128


def test_a_restarted_controller_carries_on_the_run_its_peers_report_while_it_is_young():
    bench = Bench()
    own = bench.ctl.run_id
    assert bench.beat(b"learner", "trainer", T0 + 1).run_id == own, "a new peer knows no run"
    assert bench.beat(b"young", "worker", T0 + 1.2, run_id="20261123-101500-abc123",
                      uptime_s=0.5).run_id == own, "younger than the controller: not the run's"
    assert bench.beat(b"worker", "worker", T0 + 1.3, run_id="../../etc",
                      uptime_s=100.0).run_id == own, "not a run id: ignored"
    assert bench.beat(b"broker", "broker", T0 + 1.5, run_id="20261123-101500-abc123",
                      uptime_s=100.0).run_id == "20261123-101500-abc123", "carried on"
    other = bench.beat(b"stray", "worker", T0 + 2, run_id="20261122-000000-def456",
                       uptime_s=100.0)
    assert other.run_id == "20261123-101500-abc123", "adopted once: another id is not"
    later = Bench()
    assert later.beat(b"broker", "broker", T0 + controller.ADOPT_RUN_S + 1,
                      run_id="20261123-101500-abc123", uptime_s=100.0).run_id == \
        later.ctl.run_id, "too late: its own id has been handed out"
