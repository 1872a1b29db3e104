"""Hostile and broken input against running processes: refused, counted, never fatal."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import msgpack
import msgpack_numpy
import numpy as np
import zmq
from conftest import Cluster, send_message, wait_for
from stepbus.bus import protocol as p


class Touch:
    """Unpickling this creates a file: proof that someone unpickled our bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def corpus(marker: Path) -> list[list[bytes]]:
    pickled = pickle.dumps(Touch(marker))
    numpy_obj = {b"nd": True, b"type": b"O", b"kind": b"O", b"shape": [1], b"data": pickled}
    header = msgpack.packb([p.PROTOCOL_VERSION, int(p.Kind.HEARTBEAT), {
        "role": "x", "name": numpy_obj, "host": "h", "pid": 1, "leaving": False,
        "figures": {}}, []])
    return [
        [b"\xff\xfe garbage"],
        [msgpack_numpy.packb(np.array([Touch(marker)], dtype=object))],
        [msgpack.packb(numpy_obj)],
        [header] if isinstance(header, bytes) else [b""],
        [msgpack.packb([p.PROTOCOL_VERSION + 1, int(p.Kind.HEARTBEAT), {}, []])],
        [msgpack.packb([p.PROTOCOL_VERSION, 999, {}, []])],
        [msgpack.packb([p.PROTOCOL_VERSION, int(p.Kind.STEP_RESULT), {
            "incarnation": "i", "epoch": 0, "seq": 1, "first": False}, [
            ["obs", "|O", [1]], ["reward", "<f4", [1]], ["terminated", "|b1", [1]],
            ["truncated", "|b1", [1]], ["final_obs", "<f4", [0]]]]), b"x" * 8, b"\0\0\0\0",
         b"\0", b"\0", b""],
        [msgpack.packb([p.PROTOCOL_VERSION, int(p.Kind.WEIGHTS), {}, [["params.x", "<f8",
                                                                      [2**40]]]]), b""],
        [b"\x91" * 5000 + b"\xc0"],
    ]


def test_hostile_messages_on_every_bound_socket_are_refused_and_learning_goes_on(
        cluster: Cluster, tmp_path: Path):
    marker = tmp_path / "unpickled"
    procs = cluster.start_all(trainer_args=("--target-return", "150"))
    wait_for(lambda: len(cluster.metrics()) >= 2, 60, "training under way")
    sent = 0
    for name, kind in (("controller", zmq.DEALER), ("steps", zmq.DEALER),
                       ("policy", zmq.DEALER), ("experience", zmq.PUSH)):
        sock = cluster.socket(kind, cluster.endpoints[name])
        for frames in corpus(marker):
            sock.send_multipart(frames)
            sent += 1
        sock.close(linger=1000)
    # A liar: a well-formed worker hello with the right spaces, then results of the wrong shape.
    liar = cluster.socket(zmq.DEALER, cluster.endpoints["steps"])
    liar.setsockopt(zmq.IDENTITY, b"liar")
    real_spec = {"obs_shape": [4], "obs_dtype": "<f4", "action_kind": "discrete", "action_n": 2,
                 "action_shape": [], "action_low": [], "action_high": []}
    send_message(liar, p.WorkerHello(worker="liar", incarnation="x", env_id="CartPole-v1",
                                     num_envs=2, seed=0, spec=real_spec))
    assert liar.poll(5000), "the broker answers a good hello with a reset"
    reset = p.decode(liar.recv_multipart())
    assert isinstance(reset, p.Reset)
    send_message(liar, p.StepResult(
        incarnation="x", epoch=reset.epoch, seq=reset.seq, first=True,
        obs=np.zeros((2, 7), np.float32),
        reward=np.zeros(2, np.float32), terminated=np.zeros(2, bool),
        truncated=np.zeros(2, bool), final_obs=np.zeros((0, 7), np.float32)))
    liar.close()

    def rejected_by_role() -> dict[str, int]:
        status = cluster.cli("status", "--json", "--timeout", "2")
        rows = json.loads(status.stdout)["processes"] if status.returncode == 0 else []
        return {r["role"]: r.get("rejected", 0) for r in rows}

    wait_for(lambda: all(rejected_by_role().get(role, 0) > 0 for role in
                         ("controller", "broker", "assembler")), 30,
             "every attacked process to report refused messages")
    codes = {name: proc.wait(90) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    assert cluster.metrics()[-1]["mean_return"] >= 150, "learning went on"
    assert not marker.exists(), "nothing was ever unpickled"
    broker_log = procs["broker"].output()
    assert "bad step result" in broker_log and "liar" in broker_log
    assert "Traceback" not in cluster.dump()
