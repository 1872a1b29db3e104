"""The trajectory assembler as a real process, fed scripted step sequences over its sockets:
decoding, signals and the shutdown flush. Its trajectory semantics are in
test_assembler_state."""

from __future__ import annotations

import signal

import pytest
import zmq
from conftest import Cluster, TrajectoryInbox, send_message
from test_assembler_state import Script

from stepbus.bus import protocol as p


@pytest.fixture
def assembler(cluster: Cluster):
    proc = cluster.start("assembler", "--horizon", "4")
    push = cluster.socket(zmq.PUSH, cluster.endpoints["experience"])
    pull = TrajectoryInbox(cluster.socket(zmq.PULL, cluster.endpoints["trajectories"]))
    yield proc, push, pull
    push.close()
    pull.close()


def feed(push: zmq.Socket, *messages: p.Experience) -> None:
    for msg in messages:
        send_message(push, msg)


def test_shutdown_flushes_partial_trajectories_as_truncated(assembler):
    proc, push, pull = assembler
    s = Script(k=2)
    feed(push, s.first(), s.step(), s.step(), s.step(terminated=[0]))
    ended = pull.recv()  # proves every step so far reached the assembler
    assert ended.agent == "w/0" and ended.terminated
    proc.signal(signal.SIGTERM)
    flushed = pull.recv()
    assert flushed.agent == "w/1" and flushed.truncated and not flushed.terminated
    assert len(flushed.rewards) == 3 and flushed.bootstrap_obs.tolist() == [1, 3]
    assert proc.wait(5) == 0
    assert "Traceback" not in proc.output()


def test_garbage_is_counted_and_the_assembler_keeps_serving(assembler):
    proc, push, pull = assembler
    push.send_multipart([b"\x93\x01\x02"])
    push.send_multipart([b"not msgpack at all \xff\xfe"])
    s = Script()
    feed(push, s.first(), *[s.step() for _ in range(4)])
    assert isinstance(pull.recv(), p.Trajectory)
    assert proc.popen.poll() is None
    assert "dropped message" in proc.output()


