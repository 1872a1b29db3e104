"""The step broker's state machine in-process: decoded messages in, sends read back from an
outbox, time from an explicit clock. The wiring and the faults of real processes are in
test_pipeline, test_broker_faults and test_faults."""

from __future__ import annotations

import dataclasses
import logging
import types

import gymnasium as gym
import numpy as np
import pytest
import zmq
from conftest import ManualClock

from stepbus.bus import broker, node, worker_table
from stepbus.bus import protocol as p
from stepbus.bus.credit import DETERMINISM_GIVE_UP_S
from stepbus.bus.node import RejectLog
from stepbus.bus.topology import AnyPort, PortName
from stepbus.models import mlp
from stepbus.policy import ActionSpace
from stepbus.workers import envs

SPEC = envs.space_spec(gym.make("CartPole-v1"))
OBS_DIM = SPEC.obs_shape[0]
T0 = 1000.0


def weights(version: int, consumed: int = 0, *, starving: bool = False, batch_steps: int = 256,
            policy: str = "default", incarnation: str = "t1", favourite: int = -1
            ) -> p.Weights:
    """A trainer's WEIGHTS report with real MLP weights (that always pick `favourite`, if
    given, so a row's action tells which policy chose it)."""
    params = mlp.init_params(OBS_DIM, ActionSpace("discrete", n=2), (8,),
                             np.random.default_rng(version))
    if favourite >= 0:
        params["pi.1.b"] = np.where(np.arange(2) == favourite, 50.0, 0.0)
    return p.Weights(trainer=f"t-{policy}", incarnation=incarnation, policy=policy,
                     version=version, consumed_steps=consumed, batch_steps=batch_steps,
                     starving=starving, params=params)


class Bench:
    """One broker object on an outbox, the test playing its workers, trainers and
    controller."""

    def __init__(self, *, run_state: bool = True, blocked: set[str] | None = None,
                 policy_map: str = "", out: node.Outbox | None = None, **cfg: object) -> None:
        self.clock = ManualClock(T0)
        self.out = out or node.Outbox(blocked)
        self.broker = broker.Broker(broker.Config(policy_map=policy_map, **cfg),  # type: ignore
                                    self.out, logging.getLogger("test.broker"),
                                    rules=broker.policies.parse_map(policy_map),
                                    clock=self.clock)
        self.commands: dict[bytes, p.Reset | p.Step] = {}  # the last one each worker got
        # sent to workers, not yet looked at by the test
        self.unread: list[node.Sent[p.Reset] | node.Sent[p.Step]] = []
        self.incarnations: dict[bytes, str] = {}
        if run_state:
            self.deliver(b"", p.RunState(run_id="r", epoch=0, options={},
                                         shutting_down=False))

    def deliver(self, peer: bytes, msg: p.Message) -> None:
        self.broker.deliver(peer, msg, now=self.clock.t)

    def tick(self) -> float:
        return self.broker.tick(self.clock.t)

    def later(self, seconds: float) -> None:
        self.clock.t += seconds

    def commands_to(self, ident: bytes, kind: type | types.UnionType = p.Reset | p.Step
                    ) -> list[p.Reset | p.Step]:
        """The commands of `kind` sent to a worker since the last look."""
        self.collect()
        taken = [s for s in self.unread if s.to == ident and isinstance(s.msg, kind)]
        self.unread = [s for s in self.unread if not any(s is t for t in taken)]
        return [s.msg for s in taken]

    def collect(self) -> None:
        """Move what went to workers out of the outbox, remembering each worker's last
        command (what `answer` answers)."""
        for s in self.out.take_sent(p.Reset) + self.out.take_sent(p.Step):
            assert s.port == "steps" and s.to is not None
            self.commands[s.to] = s.msg
            self.unread.append(s)

    def join(self, name: str, num_envs: int = 2, incarnation: str = "i1", seq: int = 0,
             agents: list[str] | None = None) -> bytes:
        ident = name.encode()
        self.incarnations[ident] = incarnation
        self.deliver(ident, p.WorkerHello(worker=name, incarnation=incarnation,
                                          env_id="CartPole-v1", num_envs=num_envs, seed=0,
                                          spec=SPEC, seq=seq, agents=agents or []))
        return ident

    def result(self, ident: bytes, rows: int = 2) -> p.StepResult:
        """The worker's reply to the last Reset or Step it got."""
        self.collect()
        cmd = self.commands[ident]
        return p.StepResult(incarnation=self.incarnations[ident], epoch=cmd.epoch, seq=cmd.seq,
                            first=isinstance(cmd, p.Reset),
                            obs=np.zeros((rows, OBS_DIM), np.float32),
                            reward=np.ones(rows, np.float32), terminated=np.zeros(rows, bool),
                            truncated=np.zeros(rows, bool),
                            final_obs=np.zeros((0, OBS_DIM), np.float32))

    def answer(self, ident: bytes, rows: int = 2) -> None:
        self.deliver(ident, self.result(ident, rows))

    def steps_to(self, ident: bytes) -> list[p.Step]:
        return self.commands_to(ident, p.Step)  # type: ignore[return-value]

    def figure(self, name: str) -> object:
        return self.broker.figures()[name]


def test_the_credit_window_holds_stepping_until_a_weights_report_reopens_it():
    bench = Bench(max_steps_ahead=8)
    w = bench.join("w0")
    bench.deliver(b"t", weights(1))
    for _ in range(4):  # 2 envs: 4 steps fill a window of 8
        bench.answer(w)
        bench.tick()
        assert len(bench.steps_to(w)) == 1
    bench.answer(w)
    assert bench.tick() == float("inf"), "nothing to look again for: the trainer wakes us"
    assert bench.steps_to(w) == []
    assert bench.figure("outstanding_steps") == 8 and bench.figure("credit_window") == 8
    assert bench.figure("held_by") == "default: credit window"

    bench.deliver(b"t", weights(1, consumed=8))
    bench.tick()
    [step] = bench.steps_to(w)
    assert step.policy_version == 1 and step.actions.shape == (2,)
    assert bench.figure("outstanding_steps") == 2
    assert bench.figure("credit_topups") == 0


def test_a_starving_trainer_tops_up_a_full_window_and_the_grant_doubles():
    bench = Bench(max_steps_ahead=8)
    w = bench.join("w0")
    bench.deliver(b"t", weights(1, batch_steps=4))
    for _ in range(4):
        bench.answer(w)
        bench.tick()
        assert len(bench.steps_to(w)) == 1
    bench.answer(w)
    bench.tick()
    assert bench.steps_to(w) == [] and bench.figure("outstanding_steps") == 8

    bench.deliver(b"t", weights(1, starving=False, batch_steps=4))
    assert bench.figure("credit_topups") == 0, "a trainer that is not starving gets no credit"
    bench.deliver(b"t", weights(1, starving=True, batch_steps=4))
    assert bench.figure("credit_topups") == 1
    assert bench.figure("outstanding_steps") == 4, "one batch granted"
    bench.tick()
    assert len(bench.steps_to(w)) == 1, "stepping goes on"

    grants = []
    for _ in range(2):  # the grant: a batch, or all the credit granted so far, up to a window
        for _ in range(2):
            bench.answer(w)
            bench.tick()
        assert bench.figure("outstanding_steps") == 8
        bench.deliver(b"t", weights(1, starving=True, batch_steps=4))
        grants.append(8 - bench.figure("outstanding_steps"))  # type: ignore[operator]
        bench.tick()  # the reply that waited is stepped
    assert grants == [4, 8] and bench.figure("credit_topups") == 3
    assert bench.figure("stale_dropped") == 0


def test_a_starving_trainer_gets_credit_at_once_only_for_steps_a_fault_may_have_lost():
    """With the window sized for the partial trajectories, a trainer that starves while it
    is full waits for steps that are late (a frozen assembler): granting credit for them would
    let stepping run past its policy-lag bound. An assembler gone may have lost them all."""
    bench = Bench()
    w = bench.join("w0")
    bench.deliver(b"t", weights(1, batch_steps=4))
    for _ in range(100):
        bench.answer(w)
        bench.tick()
        if not bench.steps_to(w):
            break
    window = bench.figure("credit_window")
    assert window == 2 * 4 + 2 * 34 and bench.figure("outstanding_steps") == window
    for _ in range(4):
        bench.later(0.25)
        bench.deliver(b"t", weights(1, starving=True, batch_steps=4))
    assert bench.figure("credit_topups") == 0 and bench.steps_to(w) == [], "late, not lost"
    bench.broker.on_socket_event(broker.EXPERIENCE_EVENTS, zmq.EVENT_DISCONNECTED)
    assert bench.figure("assembler_disconnects") == 1
    bench.deliver(b"t", weights(1, starving=True, batch_steps=4))
    assert bench.figure("credit_topups") == 1 and bench.figure("credit_unexplained") == 0
    bench.tick()
    assert len(bench.steps_to(w)) == 1, "stepping goes on"
    credit = bench.broker.slots[0].credit
    lost = credit.lost
    bench.join("w1")  # a worker joining (a reset with no step in flight) loses nothing
    bench.join("w1", seq=1)  # nor one saying hello again while its reset is pending
    assert credit.lost == lost


def test_a_barrier_resets_every_worker_and_is_done_only_when_all_reset_counting_the_lost():
    bench = Bench()
    w0, w1, w2 = (bench.join(f"w{i}") for i in range(3))
    bench.deliver(b"t", weights(1))
    for w in (w0, w1, w2):
        bench.answer(w)
    bench.tick()
    for w in (w0, w1, w2):
        assert [type(c) for c in bench.commands_to(w)] == [p.Reset, p.Step]
    assert len(bench.out.take(p.Experience)) == 3
    bench.answer(w0)  # w0's reply waits for inference; w1 and w2 are still stepping

    bench.deliver(b"", p.Barrier(epoch=1, options={"level": 3}))
    [reset] = bench.commands_to(w0)
    assert reset == p.Reset(epoch=1, seq=reset.seq, options={"level": 3})
    [experience] = bench.out.take(p.Experience)
    assert experience.worker == "w0" and experience.action is None, \
        "the waiting observation goes to the assembler as a bootstrap, without an action"
    assert bench.commands_to(w1) == [] and bench.commands_to(w2) == [], "in flight: not yet"
    assert bench.figure("epoch") == 1

    bench.answer(w1)  # a step from before the barrier: kept, then the worker is reset
    [reset1] = bench.commands_to(w1)
    assert isinstance(reset1, p.Reset) and reset1.options == {"level": 3}
    bench.deliver(w1, p.RemoteError(origin="w1/env 0", error_type="ValueError",
                                    message="bad level", traceback="", context={}))
    bench.answer(w0)
    bench.tick()
    assert bench.out.take(p.BarrierDone) == [], "w1 has not answered its reset yet"

    bench.later(1.0)
    for w in (w0, w1):
        bench.deliver(w, p.Heartbeat(role="worker", name=w.decode(), host="h", pid=1,
                                     leaving=False, figures={}))
    bench.later(1.0)  # w2 has been silent 2 s: lost during the barrier
    bench.tick()
    assert bench.out.take(p.BarrierDone) == []
    bench.answer(w1)
    bench.tick()
    sent = bench.out.take_sent(p.BarrierDone)
    assert [(s.port, s.msg) for s in sent] == [("controller", p.BarrierDone(
        epoch=1, workers_reset=2, workers_lost=1, errors=["w1/env 0: ValueError: bad level"]))]
    steps = [bench.steps_to(w) for w in (w0, w1)]
    assert [[s.epoch for s in got] for got in steps] == [[1], [1]], "stepping resumes"
    bench.tick()
    assert bench.out.take(p.BarrierDone) == [], "reported once"


def test_a_stale_or_foreign_step_result_is_dropped_and_counted():
    bench = Bench()
    w = bench.join("w0")
    bench.deliver(b"t", weights(1))
    first = bench.result(w)
    bench.deliver(w, first)
    bench.tick()
    assert len(bench.steps_to(w)) == 1 and len(bench.out.take(p.Experience)) == 1
    current = bench.result(w)
    stale = [first,  # an answer already taken: a duplicate
             dataclasses.replace(current, incarnation="i0"),  # the worker's previous life
             dataclasses.replace(current, seq=current.seq + 5)]
    for msg in stale:
        bench.deliver(w, msg)
    bench.deliver(b"stranger", current)
    assert bench.figure("stale_dropped") == 4
    bench.tick()
    assert bench.steps_to(w) == [] and bench.out.take(p.Experience) == [], "nothing acted on"
    bench.deliver(w, current)
    bench.tick()
    assert len(bench.steps_to(w)) == 1 and bench.figure("stale_dropped") == 4


def test_a_silent_worker_is_forgotten_and_the_assembler_told_and_its_seq_remembered():
    bench = Bench()
    w0, w1 = bench.join("w0"), bench.join("w1")
    bench.later(1.0)
    bench.deliver(w1, p.Heartbeat(role="worker", name="w1", host="h", pid=1, leaving=False,
                                  figures={}))
    bench.later(worker_table.LIVENESS_S - 1.0 + 0.1)
    bench.tick()
    sent = bench.out.take_sent(p.WorkerLost)
    assert [(s.port, s.msg.worker, s.msg.incarnation) for s in sent] == [
        ("experience", "w0", "i1")]
    assert sent[0].msg.reason == f"silent for {worker_table.LIVENESS_S + 0.1:.1f}s"
    assert bench.figure("workers") == 1 and bench.figure("workers_lost") == 1
    late = bench.result(w0)  # its reply to its first reset, too late: it is not known any more
    bench.commands_to(w0)
    bench.deliver(w0, late)
    assert bench.figure("stale_dropped") == 1
    bench.join("w0", incarnation="i2")
    [reset] = bench.commands_to(w0)
    assert isinstance(reset, p.Reset) and reset.seq > late.seq, \
        "numbered above anything used with its previous incarnation"


def test_a_new_broker_defers_hellos_until_the_run_state_gives_the_epoch_and_options():
    bench = Bench(run_state=False)
    w = bench.join("w0")
    assert bench.commands_to(w) == [], "no reset without the run's options"
    bench.deliver(b"", p.RunState(run_id="r", epoch=2, options={"level": 3},
                                  shutting_down=False))
    assert bench.commands_to(w) == [p.Reset(epoch=2, seq=1, options={"level": 3})]
    assert bench.figure("epoch") == 2


def test_without_a_controller_deferred_hellos_are_served_after_the_grace():
    bench = Bench(run_state=False)
    w = bench.join("w0")
    bench.broker.run_timers(T0 + broker.RUN_STATE_GRACE_S - 0.1)
    assert bench.commands_to(w) == []
    bench.broker.run_timers(T0 + broker.RUN_STATE_GRACE_S)
    assert bench.commands_to(w) == [p.Reset(epoch=0, seq=1, options={})]


def test_stepping_holds_while_the_assembler_cannot_take_experience():
    bench = Bench(blocked={"experience"})
    w = bench.join("w0")
    bench.deliver(b"t", weights(1))
    bench.answer(w)
    bench.tick()
    assert bench.steps_to(w) == [] and bench.figure("assembler_blocked") is True
    assert bench.broker.wake_on_writable == {"experience"}, "the loop wakes when it can send"
    bench.out.blocked.clear()
    bench.tick()
    assert len(bench.steps_to(w)) == 1 and bench.figure("assembler_blocked") is False
    assert bench.broker.wake_on_writable == set()
    assert bench.figure("experience_dropped") == 0


def test_deterministic_mode_acts_with_the_version_due_at_each_step_count():
    """Window 4, 2 envs: at step count S the version made from at most S - 4 steps acts."""
    bench = Bench(max_steps_ahead=4, deterministic=True)
    w = bench.join("w0")
    bench.deliver(b"t", weights(1))  # made from 0 steps
    versions = []
    for count in range(0, 12, 2):
        if count == 4:  # the trainer took in 4 steps and made version 2 from them
            bench.deliver(b"t", weights(2, consumed=4))
        if count == 8:
            bench.deliver(b"t", weights(2, consumed=8))
        bench.answer(w)
        bench.tick()
        [step] = bench.steps_to(w)
        versions.append(step.policy_version)
    assert versions == [1, 1, 1, 1, 2, 2], "version 2 from step count 8 = 4 + window on"
    assert bench.figure("determinism_lost") == 0


def waiting_for_the_trainer() -> tuple[Bench, bytes]:
    """Window 4, 2 envs, 6 steps stepped; the trainer says it starves having taken in 1 of
    them: a version made from 2 may still come, so stepping waits."""
    bench = Bench(max_steps_ahead=4, deterministic=True)
    w = bench.join("w0")
    bench.deliver(b"t", weights(1))
    for _ in range(3):
        bench.deliver(b"t", weights(1, consumed=bench.broker.slots[0].credit.produced))
        bench.answer(w)
        bench.tick()
        assert len(bench.steps_to(w)) == 1
    bench.deliver(b"t", weights(1, consumed=1, starving=True))
    bench.answer(w)
    bench.tick()
    assert bench.steps_to(w) == [], "waits for the trainer's intake"
    return bench, w


def test_deterministic_mode_waits_for_the_trainer_then_gives_up_reproducibility():
    bench, w = waiting_for_the_trainer()
    bench.later(DETERMINISM_GIVE_UP_S)
    bench.deliver(w, p.Heartbeat(role="worker", name="w0", host="h", pid=1, leaving=False,
                                 figures={}))
    # ... and the trainer still says it starves (it does every 0.25 s on a quiet link)
    bench.deliver(b"t", weights(1, consumed=1, starving=True))
    bench.tick()
    assert len(bench.steps_to(w)) == 1 and bench.figure("determinism_lost") == 1


def test_deterministic_mode_waits_through_an_update_longer_than_its_give_up_bound():
    """A trainer that said it starved, then took in the steps and went quiet in a long update
    (seconds on a loaded machine, or the serial runner, where the broker waits while the
    learner learns): its old claim is no reason to give up reproducibility."""
    bench, w = waiting_for_the_trainer()
    bench.later(2 * DETERMINISM_GIVE_UP_S)  # the update, with nothing heard from the trainer
    bench.deliver(w, p.Heartbeat(role="worker", name="w0", host="h", pid=1, leaving=False,
                                 figures={}))
    bench.tick()
    assert bench.steps_to(w) == [] and bench.figure("determinism_lost") == 0, "still waits"
    # The update's weights say it does not starve: the give-up clock starts again. Still one
    # step short of the 6 - window due (its count is 1), it waits...
    bench.deliver(b"t", weights(2, consumed=1))
    bench.tick()
    assert bench.steps_to(w) == []
    bench.later(0.25)
    bench.deliver(b"t", weights(2, consumed=1, starving=True))  # ... starving anew
    bench.tick()
    assert bench.steps_to(w) == [] and bench.figure("determinism_lost") == 0, \
        "the seconds of the update did not count towards giving up"
    bench.deliver(b"t", weights(3, consumed=6))
    bench.tick()
    [step] = bench.steps_to(w)
    assert step.policy_version == 2 and bench.figure("determinism_lost") == 0


def test_each_policy_acts_on_its_own_rows_and_stepping_waits_for_every_policys_weights():
    bench = Bench(policy_map="[ac]=red")
    w = bench.join("w0", agents=["a", "b", "c", "d"])
    bench.deliver(b"t", weights(3, favourite=0))
    bench.answer(w, rows=8)
    bench.tick()
    assert bench.steps_to(w) == [] and bench.figure("held_by") == "red: no weights"
    bench.deliver(b"t", weights(7, favourite=1, policy="red", incarnation="r1"))
    bench.tick()
    [step] = bench.steps_to(w)
    assert step.actions.tolist() == [1, 0, 1, 0] * 2, "a and c act with red's weights"
    [experience] = bench.out.take(p.Experience)
    assert experience.policy_versions is not None
    assert experience.policy_versions.tolist() == [7, 3, 7, 3] * 2
    assert experience.agent_policies == ["red", "default", "red", "default"]
    figures = bench.broker.figures()
    assert (figures["policy_rows_default"], figures["policy_rows_red"]) == (4, 4)
    assert (figures["policy_version_default"], figures["policy_version_red"]) == (3, 7)


def test_a_learner_of_an_unknown_policy_is_refused_by_name(caplog: pytest.LogCaptureFixture):
    bench = Bench(policy_map="[ac]=red")
    with caplog.at_level(logging.WARNING, logger="test.broker"):
        bench.deliver(b"typo-ident", p.TrainerHello(trainer="typo", policy="blue"))
    figures = bench.broker.figures()
    assert figures["rejected_unknown_policy"] == 1
    assert figures["rejected_from"] == "typo-ident:1", "its routing id, not the name it gives"
    assert "'blue': --policy-map names default, red" in caplog.text
    assert "from typo-ident (claims to be 'typo'): unknown policy" in caplog.text


def test_every_refusal_names_the_routing_id_never_a_name_in_the_message(
        caplog: pytest.LogCaptureFixture):
    """A hostile peer naming a real worker or trainer in its messages has its refusals
    counted against its own routing id: the peer it names is never blamed."""
    bench = Bench()
    w = bench.join("w0")
    bench.deliver(b"t", weights(1))
    hello = p.WorkerHello(worker="w0", incarnation="x", env_id="CartPole-v1", num_envs=0,
                          seed=0, spec=SPEC, seq=0)
    bad = weights(4)
    lies = [(hello, "'w0'): bad hello"),
            (dataclasses.replace(hello, num_envs=2, spec=dataclasses.replace(SPEC, obs_shape=[5])),
             "'w0'): spec mismatch"),
            (dataclasses.replace(weights(2), batch_steps=0), "'t-default'): bad weights"),
            (weights(3, policy="blue"), "'t-blue'): unknown policy"),
            (dataclasses.replace(bad, params={**bad.params, "pi.0.w": np.zeros((3, 8))}),
             "'t-default'): bad weights")]
    for lie, line in lies:
        bench.later(RejectLog.LOG_INTERVAL_S)  # each one logged
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="test.broker"):
            bench.deliver(b"mallory", lie)
        assert f"dropped message from mallory (claims to be {line}" in caplog.text
    with caplog.at_level(logging.WARNING, logger="test.broker"):
        bench.answer(w, rows=3)  # the real w0 sends a result of the wrong shape: its own
    assert "dropped message from w0: bad step result" in caplog.text, "a claim that is its id"
    figures = bench.broker.figures()
    assert figures["rejected"] == 6
    assert figures["rejected_from"] == "mallory:5, w0:1"


def test_a_deferred_hello_refused_later_is_counted_against_its_sender_not_the_controller():
    bench = Bench(run_state=False)
    bench.deliver(b"mallory", p.WorkerHello(
        worker="w0", incarnation="x", env_id="CartPole-v1", num_envs=0, seed=0, spec=SPEC,
        seq=0))
    assert bench.figure("rejected") == 0, "deferred until the run state comes"
    bench.broker.deliver(b"", p.RunState(run_id="r", epoch=0, options={}, shutting_down=False),
                         now=bench.clock.t, sender="controller tcp://127.0.0.1:7340")
    assert bench.figure("rejected_from") == "mallory:1"


class FullExperienceQueue(node.Outbox):
    """The experience port says it has room, then cannot queue: the race (the assembler's
    queue filled or it went away in between) that the broker counts as dropped."""

    def send(self, port: AnyPort, msg: p.Message, *, to: bytes | None = None,
             block: bool = False) -> bool:
        return port != PortName.EXPERIENCE and super().send(port, msg, to=to, block=block)


def test_a_result_the_assembler_cannot_take_is_counted_against_its_socket_not_the_worker():
    bench = Bench(out=FullExperienceQueue())
    w = bench.join("w0")
    bench.deliver(b"t", weights(1))
    bench.answer(w)
    bench.tick()  # acts: its experience goes out (outside any message's handling)
    assert bench.figure("experience_dropped") == 1
    assert bench.figure("rejected_from") == f"assembler at {broker.Config().experience}:1"


def test_weights_that_do_not_fit_the_spaces_are_refused_and_not_acted_with():
    bench = Bench()
    w = bench.join("w0")
    bad = weights(1)
    bad = dataclasses.replace(bad, params={**bad.params, "pi.0.w": np.zeros((3, 8))})
    bench.deliver(b"t", bad)
    bench.answer(w)
    bench.tick()
    assert bench.steps_to(w) == [] and bench.figure("rejected_bad_weights") == 1
    assert bench.figure("weights_refused") == 1
    assert str(bench.figure("held_by")).startswith("default: pi.0.w of shape (3, 8)")


def test_a_worker_that_says_hello_again_while_we_wait_on_it_is_reset_once_a_message_was_lost():
    bench = Bench()
    w = bench.join("w0")
    [lost] = bench.commands_to(w)  # this reset never reaches the worker
    bench.later(broker.IDLE_RESET_S / 2)
    bench.join("w0")  # idle, it says hello again (same incarnation)
    assert bench.commands_to(w) == [], "too soon to call the reset lost"
    bench.later(broker.IDLE_RESET_S)
    bench.join("w0")
    [again] = bench.commands_to(w)
    assert isinstance(again, p.Reset) and again.seq == lost.seq + 1
    assert bench.figure("workers") == 1 and bench.figure("workers_lost") == 0



def test_after_a_freeze_stale_hellos_on_a_dead_connection_are_retried_quietly_not_counted_lost(
        caplog: pytest.LogCaptureFixture):
    bench = Bench()
    bench.deliver(b"t", weights(1))
    w = bench.join("w0")
    bench.answer(w)
    bench.tick()
    assert [type(c) for c in bench.commands_to(w)] == [p.Reset, p.Step], \
        "in flight: its reply is what the freeze holds up"
    caplog.set_level(logging.INFO)
    caplog.clear()
    bench.later(8.0)  # the broker was frozen; the worker's connection is being replaced
    bench.broker.on_stalled(8.0)  # what its loop tells it on waking
    bench.tick()
    assert bench.figure("workers_lost") == 0, "its own silence is not the worker's"
    bench.out.blocked.add("steps")  # until the new connection is attached, sends fail
    for _ in range(10):  # hellos queued on the dead connection, all at once
        bench.join("w0")
        bench.tick()
    # ROUTER_HANDOVER gives the replaced connection a made-up routing id: what is still queued
    # on it comes from a stranger that claims to be the worker
    bench.deliver(b"\x00k\x8bEg", p.WorkerHello(
        worker="w0", incarnation="i1", env_id="CartPole-v1", num_envs=2, seed=0, spec=SPEC,
        seq=0, agents=[]))
    assert bench.figure("stale_hellos") == 1 and bench.figure("workers") == 1
    assert bench.figure("workers_lost") == 0
    assert "unreachable" not in caplog.text and "joined" not in caplog.text
    bench.out.blocked.clear()
    bench.later(0.5)
    bench.join("w0")  # the first hello on the new connection: one RESET gets through
    [reset] = bench.commands_to(w)
    assert isinstance(reset, p.Reset)
    bench.later(broker.IDLE_RESET_S / 2)
    bench.join("w0")
    assert bench.commands_to(w) == [], "reachable again: no further resets"
    assert bench.figure("workers_lost") == 0


def test_a_worker_unreachable_for_the_liveness_timeout_is_lost_once_even_if_hellos_come():
    bench = Bench()
    bench.deliver(b"t", weights(1))
    w = bench.join("w0")
    bench.out.blocked.add("steps")
    bench.answer(w)
    bench.tick()  # the STEP cannot be sent: unreachable from now
    for _ in range(4):
        bench.later(worker_table.LIVENESS_S / 3)
        bench.join("w0")  # it is heard from, yet every send to it fails
        bench.tick()
    assert [m.reason for m in bench.out.take(p.WorkerLost)] == [
        f"unreachable for {worker_table.LIVENESS_S * 4 / 3:.1f}s"]
    assert bench.figure("workers_lost") == 1


def test_credit_window_allows_for_the_horizon_the_run_state_names() -> None:
    """The allowance per env row is the assembler's real horizon (+2), not its default."""
    bench = Bench()
    bench.join("w1", num_envs=4)
    credit = bench.broker.slots[0].credit
    default_window = credit.window()
    state = p.RunState(run_id="r", epoch=0, options={}, shutting_down=False, horizon=128)
    bench.deliver(b"", state)
    assert credit.window() == default_window + (128 - 32) * 4
    bench.deliver(b"", dataclasses.replace(state, horizon=0))  # 0: no assembler has said
    assert credit.window() == default_window + (128 - 32) * 4


def test_a_trainer_that_said_hello_before_any_worker_gets_the_spec_when_the_first_one_joins():
    """At a honcho start the learner asks before a worker has brought the spaces: it is told
    as soon as they are known, not at its next hello; a flood of hellos is held in bounds."""
    bench = Bench()
    bench.deliver(b"trainer-ident", p.TrainerHello(trainer="t-default", policy="default"))
    for i in range(2 * broker.MAX_AWAITING_SPEC):
        bench.deliver(f"flood-{i}".encode(), p.TrainerHello(trainer="x", policy="default"))
    assert bench.out.take(p.EnvSpec, port="policy") == [], "no spec to give yet"
    bench.join("w1")
    told = bench.out.take_sent(p.EnvSpec)
    assert told[0].to == b"trainer-ident" and told[0].msg.spec == SPEC
    assert len(told) == broker.MAX_AWAITING_SPEC, "the rest say hello again"
    bench.deliver(b"trainer-ident", p.TrainerHello(trainer="t-default", policy="default"))
    assert [s.to for s in bench.out.take_sent(p.EnvSpec)] == [b"trainer-ident"]


def test_a_hello_claiming_a_huge_box_observation_is_refused_before_any_model_is_built():
    """The first hello's spaces size the model: a billion numbers a row would have had the
    broker allocate its first layer without bound. Refused in one line; the next is taken."""
    bench = Bench()
    huge = dataclasses.replace(SPEC, obs_shape=[1 << 15, 1 << 15], obs_dtype="|u1")
    assert "1,073,741,824 numbers a row" in broker.checks.spec_problem(huge)
    frame = dataclasses.replace(SPEC, obs_shape=[1024, 1024, 4], obs_dtype="|u1")
    assert broker.checks.spec_problem(frame) == "", "one 1024x1024 RGBA frame is the most"
    assert broker.checks.spec_problem(dataclasses.replace(frame, obs_shape=[1024, 1024, 5]))
    bench.deliver(b"evil", p.WorkerHello(worker="evil", incarnation="i1", env_id="x",
                                         num_envs=1, seed=0, spec=huge, seq=0))
    assert bench.broker.figures()["spec_refused"] == 1 and bench.broker.spec is None
    bench.join("w0")
    assert bench.broker.spec == SPEC


def test_only_a_broker_that_is_not_deterministic_may_rescale_its_credit() -> None:
    """A restarted broker may take the dead one's steps in flight as its own (bus/credit.py);
    deterministic mode places due versions on the credit scale, which must stay put."""
    assert all(s.credit.rescales for s in Bench().broker.slots)
    assert not any(s.credit.rescales for s in Bench(deterministic=True).broker.slots)
