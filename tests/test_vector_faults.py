"""A vector env never hangs on a dead process: a worker killed, frozen or restarted, or the
broker killed or frozen, makes step/recv raise one typed BusError within the liveness bound;
close() works after it and leaves nothing running, and reset() attaches again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import vector_envs
from conftest import Cluster
from vector_envs import Made

import stepbus.vector as sv
from stepbus.bus import node
from stepbus.vector import link

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
def test_a_lost_broker_raises_broker_lost_within_its_silence_bound(make: Made, sig: int
                                                                   ) -> None:
    envs = make("CartPole-v1", 2, workers=1, autoreset_mode="SameStep")
    envs.reset(seed=0)
    os.kill(process(envs, "broker"), sig)
    took, _ = steps_until_raised(envs, sv.BrokerLost)
    assert took < BROKER_BOUND_S


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


def test_time_the_caller_spends_elsewhere_is_not_the_brokers_silence(make: Made) -> None:
    """A training loop updating its model between steps reads the relay's heartbeats late:
    they were queued, not missing, and no BrokerLost may follow."""
    envs = make("CartPole-v1", 2, workers=1)
    envs.link.silence_s = 2.0
    envs.reset(seed=0)
    time.sleep(3.0)  # the caller busy (a PPO update), not waiting on the bus
    obs, *_ = envs.step(np.zeros(2, np.int64))
    assert obs.shape == (2, 4)
