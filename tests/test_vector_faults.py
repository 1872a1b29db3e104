"""A vector env never hangs on a dead process: a worker killed, frozen or restarted, or a
relaying broker (`connect`'s) killed or frozen, makes step/recv raise one typed BusError within
the liveness bound; close() works after it and leaves nothing running, and reset() attaches
again."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterator

import gymnasium as gym
import numpy as np
import pytest
import vector_envs
from conftest import Cluster
from vector_envs import Made

import stepbus.vector as sv
from stepbus.bus import node
from stepbus.bus import protocol as p
from stepbus.vector import link
from stepbus.workers import envs

# The longest a step may wait on a dead process: the broker's liveness timeout for a worker
# (or our silence bound for the broker), a poll, and room for a loaded 2-core machine.
WORKER_BOUND_S = node.LIVENESS_S + 4.0
BROKER_BOUND_S = link.BROKER_SILENCE_S + 4.0


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Made]:
    yield from vector_envs.closing_make(monkeypatch)


def steps_until_raised(envs: sv.BusVectorEnv, error: type[sv.BusError]) -> tuple[float, str]:
    """Step until `error`; how long that took from the first step, and its message."""
    started = time.monotonic()
    with pytest.raises(error) as raised:
        for _ in range(10_000):
            envs.step(np.zeros(envs.num_envs, np.int64))
    return time.monotonic() - started, str(raised.value)


def process(envs: sv.BusVectorEnv, name: str) -> int:
    assert envs.launched is not None
    return next(child.pid for child in envs.launched.procs if child.name == name)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_worker_raises_worker_lost_within_the_liveness_bound(make: Made, sig: int
                                                                    ) -> None:
    envs = make("CartPole-v1", 4, workers=2)
    envs.reset(seed=0)
    envs.step(np.zeros(4, np.int64))
    pid = process(envs, "vec-0001")
    os.kill(pid, sig)
    took, message = steps_until_raised(envs, sv.WorkerLost)
    assert took < WORKER_BOUND_S and "vec-0001" in message
    with pytest.raises(sv.WorkerLost):  # remembered until a reset attaches again
        envs.step(np.zeros(4, np.int64))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_broker_raises_broker_lost_within_its_silence_bound(cluster: Cluster, sig: int
                                                                   ) -> None:
    """connect()'s relay is a process of its own (make()'s runs in the env's process)."""
    cluster.start("controller")
    broker = cluster.start("broker", "--external")
    cluster.start("worker", "--name", "w0", "--envs-per-worker", "2")
    envs = sv.connect(cluster.endpoints["controller"], 2, autoreset_mode="SameStep")
    try:
        envs.reset(seed=0)
        broker.signal(sig)
        took, _ = steps_until_raised(envs, sv.BrokerLost)
        assert took < BROKER_BOUND_S
    finally:
        envs.close()


def test_async_recv_raises_too(make: Made) -> None:
    envs = make("CartPole-v1", 4, workers=2, batch_size=2)
    envs.reset(seed=0)
    os.kill(process(envs, "vec-0000"), signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(sv.WorkerLost):
        for _ in range(10_000):
            envs.send(np.zeros(4, np.int64))
            envs.recv()
            envs.recv()
    assert time.monotonic() - started < WORKER_BOUND_S


def test_a_restarted_worker_raises_then_reset_attaches_again(cluster: Cluster) -> None:
    """connect(): workers started elsewhere (here by the test); one restarts under its name."""
    cluster.start("controller")
    cluster.start("broker", "--external")
    workers = {name: cluster.start("worker", "--name", name, "--envs-per-worker", "2")
               for name in ("w0", "w1")}
    envs = sv.connect(cluster.endpoints["controller"], 4)
    try:
        first, _ = envs.reset(seed=3)
        envs.step(np.ones(4, np.int64))
        workers["w1"].signal(signal.SIGKILL)
        workers["w1"].wait(5)
        cluster.start("worker", "--name", "w1", "--envs-per-worker", "2")
        took, message = steps_until_raised(envs, sv.WorkerLost)
        assert took < WORKER_BOUND_S and "w1" in message
        again, _ = envs.reset(seed=3)  # waits for w1's new incarnation, then resets all
        assert np.array_equal(again, first)
        envs.step(np.ones(4, np.int64))
    finally:
        envs.close()
    assert all(w.popen.poll() is None for w in cluster.procs[:2]), "connect leaves them be"


def test_time_the_caller_spends_elsewhere_is_not_the_workers_silence(make: Made) -> None:
    """A training loop updating its model between steps leaves the relay in its process
    unturned: the workers' heartbeats were queued, not missing, and no WorkerLost may
    follow."""
    envs = make("CartPole-v1", 4, workers=2)
    envs.reset(seed=0)
    time.sleep(2 * node.LIVENESS_S)  # the caller busy (a PPO update), not waiting on the bus
    obs, *_ = envs.step(np.zeros(4, np.int64))
    assert obs.shape == (4, 4)


def test_time_the_caller_spends_elsewhere_is_not_a_relay_processs_silence(
        cluster: Cluster) -> None:
    """connect(): the relay process's heartbeats, read late, were queued, not missing, and no
    BrokerLost may follow."""
    cluster.start("controller")
    cluster.start("broker", "--external")
    cluster.start("worker", "--name", "w0", "--envs-per-worker", "2")
    envs = sv.connect(cluster.endpoints["controller"], 2)
    try:
        assert isinstance(envs.link, link.Link)
        envs.link.silence_s = 2.0
        envs.reset(seed=0)
        time.sleep(3.0)
        obs, *_ = envs.step(np.zeros(2, np.int64))
        assert obs.shape == (2, 4)
    finally:
        envs.close()


class ScriptedLink(link.Link):
    """The relay's side played from a script: what the env sends is kept, what it receives
    comes from `replies`, in order."""

    def __init__(self, replies: list[p.Message]) -> None:  # no socket
        self.name, self.heard_at, self.broker_pid = "scripted", time.monotonic(), 0
        self.sent: list[p.Message] = []
        self.replies = replies

    def send(self, msg: p.Message) -> None:
        self.sent.append(msg)

    def recv(self, timeout_s: float = math.inf) -> p.Message | None:
        assert self.replies, f"the env waits for more than the script has (sent {self.sent})"
        return self.replies.pop(0)


def test_a_step_result_still_on_its_way_is_not_taken_for_the_reset_that_follows() -> None:
    """A STEP's result that was in flight when another worker was lost reaches the env after
    it attached again and sent its RESET: it must be dropped, not handed back as the reset's
    observations (which gave rows of a `reset(seed=3)` unlike another `reset(seed=3)`'s)."""
    spec = envs.space_spec(gym.make("CartPole-v1"))
    members = [p.Member(name=n, incarnation="i", rows=2, agents=0) for n in ("w0", "w1")]

    def result(worker: str, value: float, first: bool) -> p.StepResult:
        return p.StepResult(incarnation="i", epoch=0, seq=0, first=first,
                            obs=np.full((2, 4), value, np.float32),
                            reward=np.zeros(2, np.float32), terminated=np.zeros(2, bool),
                            truncated=np.zeros(2, bool), final_obs=np.zeros((0, 4), np.float32),
                            worker=worker)

    scripted = ScriptedLink([p.VectorSpec(env_id="CartPole-v1", spec=spec, workers=members),
                             result("w0", 9.0, first=False),  # the stale STEP's
                             result("w0", 1.0, first=True), result("w1", 2.0, first=True)])
    env = sv.BusVectorEnv(scripted, 4, infos=False)
    obs, _ = env.reset(seed=3)
    assert obs[:, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
    assert [type(m).__name__ for m in scripted.sent[1:]] == ["Reset", "Reset"]
