"""The relaying broker (`stepbus broker --external`) as an object fed messages in process: what
it tells the vector client and passes to workers, without sockets or sleeping."""

from __future__ import annotations

import dataclasses
import logging

import gymnasium as gym
import numpy as np
from conftest import ManualClock

from stepbus.bus import node, relay
from stepbus.bus import protocol as p
from stepbus.workers import envs

SPEC = envs.space_spec(gym.make("CartPole-v1"))
CLIENT = b"client"


def hello(name: str, incarnation: str = "a", rows: int = 2) -> p.WorkerHello:
    return p.WorkerHello(worker=name, incarnation=incarnation, env_id="CartPole-v1",
                         num_envs=rows, seed=0, spec=SPEC, seq=0)


def result(seq: int, incarnation: str = "a", rows: int = 2, epoch: int = 0) -> p.StepResult:
    z = np.zeros(rows, bool)
    return p.StepResult(incarnation=incarnation, epoch=epoch, seq=seq, first=True,
                        obs=np.zeros((rows, 4), np.float32), reward=np.zeros(rows, np.float32),
                        terminated=z, truncated=z, final_obs=np.zeros((0, 4), np.float32))


def bench() -> tuple[relay.Relay, node.Outbox, ManualClock]:
    clock, out = ManualClock(100.0), node.Outbox()
    r = relay.Relay(out, logging.getLogger("test"), clock=clock)
    r.deliver(CLIENT, p.VectorHello(client="test"))
    for name in ("w1", "w0"):
        r.deliver(name.encode(), hello(name))
    return r, out, clock


def test_the_client_learns_the_workers_in_name_order_and_each_change() -> None:
    r, out, _ = bench()
    specs = out.take(p.VectorSpec)
    assert [m.name for m in specs[-1].workers] == ["w0", "w1"]
    assert [m.rows for m in specs[-1].workers] == [2, 2]
    r.deliver(b"w0", hello("w0", incarnation="b"))  # restarted: its episodes are gone
    lost = out.take(p.WorkerLost)
    assert [(m.worker, m.incarnation) for m in lost] == [("w0", "a")]
    assert out.take(p.VectorSpec)[-1].workers[0].incarnation == "b"


def test_requests_go_to_the_named_worker_and_results_back_with_its_name() -> None:
    r, out, _ = bench()
    out.take()
    r.deliver(CLIENT, p.Reset(epoch=0, seq=0, options={}, seeds=[5, 6], worker="w1"))
    sent = out.take_sent(p.Reset)
    assert sent[0].to == b"w1" and sent[0].msg.worker == "" and sent[0].msg.seeds == [5, 6]
    r.deliver(b"w1", result(sent[0].msg.seq))
    back = out.take_sent(p.StepResult)
    assert back[0].to == CLIENT and back[0].msg.worker == "w1"


def test_a_request_nobody_can_answer_is_answered_with_worker_lost() -> None:
    """The client waits on every request: one the relay cannot pass on must not be silent."""
    r, out, _ = bench()
    out.take()
    r.deliver(CLIENT, p.Step(epoch=0, seq=0, policy_version=-1, actions=np.zeros(2, np.int64),
                             worker="nobody"))
    r.deliver(CLIENT, p.Reset(epoch=0, seq=0, options={}, worker="w0"))
    r.deliver(CLIENT, p.Reset(epoch=0, seq=0, options={}, worker="w0"))  # it is busy
    assert [m.worker for m in out.take(p.WorkerLost)] == ["nobody", "w0"]


def test_steps_keep_the_epoch_their_worker_reset_into() -> None:
    """A barrier elsewhere in the run (a new epoch) must not make the worker drop our steps."""
    r, out, _ = bench()
    r.deliver(CLIENT, p.Reset(epoch=0, seq=0, options={}, worker="w0"))
    reset = out.take(p.Reset)[0]
    r.deliver(b"w0", result(reset.seq, epoch=reset.epoch))
    r.deliver(b"", p.RunState(run_id="r", epoch=3, options={}, shutting_down=False))
    r.deliver(CLIENT, p.Step(epoch=0, seq=0, policy_version=-1, actions=np.zeros(2, np.int64),
                             worker="w0"))
    assert out.take(p.Step)[0].epoch == reset.epoch


def test_a_silent_worker_is_reported_lost_and_the_client_hears_the_relay_beat() -> None:
    r, out, clock = bench()
    out.take()
    clock.t += node.LIVENESS_S / 2
    r.deliver(b"w1", p.Heartbeat(role="worker", name="w1", host="h", pid=1, leaving=False,
                                 figures={}))
    clock.t += node.LIVENESS_S * 0.75
    r.run_timers(clock.t)
    r.tick(clock.t)
    assert [m.worker for m in out.take(p.WorkerLost)] == ["w0"]
    assert [m.name for m in out.take(p.VectorSpec)[-1].workers] == ["w1"]
    assert out.take(p.Heartbeat), "the relay's beat to the client"


def test_a_split_workers_hello_is_refused_and_the_client_never_sees_it() -> None:
    r, out, _ = bench()
    out.take()
    split = dataclasses.replace(hello("w2:0"), split_of="w2")
    r.deliver(b"w2:0", split)
    assert out.take(p.VectorSpec) == [] and out.take(p.Reset) == []
    assert r.rejects.total == 1


def test_a_worker_idle_after_answering_a_request_whose_answer_never_came_is_lost() -> None:
    """Its hello says which request it answered last: at the one we wait on, the answer was
    lost (a full queue), and the client, which waits on it, must hear so rather than hang."""
    r, out, _ = bench()
    r.deliver(CLIENT, p.Reset(epoch=0, seq=0, options={}, worker="w0"))
    asked = out.take(p.Reset)[0].seq
    out.take()
    r.deliver(b"w0", dataclasses.replace(hello("w0"), seq=asked - 1))  # sent before it was asked
    assert out.take(p.WorkerLost) == []
    r.deliver(b"w0", dataclasses.replace(hello("w0"), seq=asked))
    lost = out.take(p.WorkerLost)
    assert [(m.worker, m.reason) for m in lost] == [
        ("w0", f"its answer to request {asked} was lost")]


def test_a_worker_answering_down_a_lane_is_not_lost_when_its_hello_overtakes_the_answer(
        ) -> None:
    """Its hello comes on the socket, its answer down the lane: the hello may be read first,
    and the answer is still on its way, not lost."""
    r, out, _ = bench()
    r.answered_elsewhere = {"w0"}
    r.deliver(CLIENT, p.Reset(epoch=0, seq=0, options={}, worker="w0"))
    asked = out.take(p.Reset)[0].seq
    out.take()
    r.deliver(b"w0", dataclasses.replace(hello("w0"), seq=asked))
    assert out.take(p.WorkerLost) == []
    r.deliver(b"w0", result(asked))
    assert [m.worker for m in out.take(p.StepResult)] == ["w0"]
