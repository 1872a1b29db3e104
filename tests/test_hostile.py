"""Hostile and broken input against running processes: refused, counted, never fatal."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import signal
from pathlib import Path
from typing import Any

import msgpack
import msgpack_numpy
import numpy as np
import pytest
import zmq
from conftest import EVERY_UPDATE, Cluster, send_message, wait_for
from controller_probe import status_rows

from stepbus.bus import node, topology
from stepbus.bus import protocol as p
from stepbus.processor import assembler

# What a real CartPole-v1 worker declares (its reward_threshold too), so a scripted hello of it
# is accepted next to one.
CARTPOLE_SPEC = p.SpaceSpec([4], "<f4", "discrete", action_n=2, reward_threshold=475.0)


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


SQUATTER_HELLOS = 30  # more than any other peer's refusals: first in rejected_from


def well_formed_lies(cluster: Cluster) -> None:
    """Messages that decode, from peers that lie: a worker whose results have the wrong shape,
    a trainer with values no honest one sends, and a squatter with a routing id of its own
    saying hello in the real worker's name (its refusals count against its id, never w0)."""
    # the liar: a well-formed worker hello with the right spaces, then results of the wrong shape
    liar = cluster.socket(zmq.DEALER, cluster.endpoints["steps"])
    liar.setsockopt(zmq.IDENTITY, b"liar")
    send_message(liar, p.WorkerHello(worker="liar", incarnation="x", env_id="CartPole-v1",
                                     num_envs=2, seed=0, spec=CARTPOLE_SPEC, seq=0))
    assert liar.poll(5000), "the broker answers a good hello with a reset"
    reset = p.decode(liar.recv_multipart())
    assert isinstance(reset, p.Reset)
    send_message(liar, p.StepResult(
        incarnation="x", epoch=reset.epoch, seq=reset.seq, first=True,
        obs=np.zeros((2, 7), np.float32),
        reward=np.zeros(2, np.float32), terminated=np.zeros(2, bool),
        truncated=np.zeros(2, bool), final_obs=np.zeros((0, 7), np.float32)))
    liar.close()
    # Well-formed messages with values no honest peer sends.
    trainer = cluster.socket(zmq.DEALER, cluster.endpoints["policy"])
    for batch_steps, num_params in ((2**63, 1), (-10**6, 1), (256, 0)):
        params = {"pi.0.w": np.ones((4, 3))} if num_params else {}
        send_message(trainer, p.Weights(trainer="rogue", incarnation="r", policy="default",
                                        version=10**6, consumed_steps=0,
                                        batch_steps=batch_steps, starving=True, params=params))
    trainer.close(linger=1000)
    # A squatter with a routing id of its own, saying hello in the real worker's name: its
    # refusals are counted against its id, never against w0.
    squatter = topology.stand_in(zmq.DEALER)
    squatter.setsockopt(zmq.IDENTITY, b"squatter")
    squatter.connect(cluster.endpoints["steps"])
    for _ in range(SQUATTER_HELLOS):
        send_message(squatter, p.WorkerHello(worker="w0", incarnation="s", env_id="x",
                                             num_envs=-1000, seed=0, spec=CARTPOLE_SPEC, seq=0))
    squatter.close(linger=1000)


def test_hostile_messages_on_every_bound_socket_are_refused_and_learning_goes_on(
        cluster: Cluster, tmp_path: Path):
    marker = tmp_path / "unpickled"
    # we stop it ourselves; records counted as updates
    procs = cluster.start_all(trainer_args=("--target-return", "0", *EVERY_UPDATE))
    wait_for(lambda: len(cluster.metrics()) >= 2, 60, "training under way")
    sent = 0
    for name, kind in (("controller", zmq.DEALER), ("steps", zmq.DEALER),
                       ("policy", zmq.DEALER), ("experience", zmq.PUSH)):
        sock = cluster.socket(kind, cluster.endpoints[name])
        for frames in corpus(marker):
            sock.send_multipart(frames)
            sent += 1
        sock.close(linger=1000)
    well_formed_lies(cluster)

    def rejected_by_role() -> dict[str, dict]:
        return {r["role"]: r for r in status_rows(cluster)}

    rows = wait_for(lambda: (r := rejected_by_role()) and all(
        r.get(role, {}).get("rejected", 0) > 0 for role in ("controller", "broker", "assembler"))
        and f"squatter:{SQUATTER_HELLOS}" in r["broker"].get("rejected_from", "") and r, 30,
        "every attacked process to report refused messages")
    assert "w0" not in rows["broker"]["rejected_from"], rows["broker"]
    wait_for(lambda: (cluster.metrics()[-1]["mean_return"] or 0) >= 150, 90,
             "learning to go on after the attack (mean return 150)")
    assert cluster.cli("shutdown").returncode == 0
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    assert not marker.exists(), "nothing was ever unpickled"
    broker_log = procs["broker"].output()
    assert "bad step result" in broker_log and "liar" in broker_log
    assert "bad weights" in broker_log and "num_envs -1000" in broker_log
    assert ("dropped message from squatter (claims to be 'w0'): bad hello: num_envs -1000"
            in broker_log)
    assert "dropped message from w0" not in broker_log
    assert "Traceback" not in cluster.dump()


def trajectory(n: int = 32, **changes: Any) -> p.Trajectory:
    fields: dict[str, Any] = dict(
        agent="w/0", epoch=0, terminated=False, truncated=False, episode_return=None,
        episode_length=None, obs=np.zeros((n, 4), np.float32),
        actions=np.zeros(n, np.int64), logp=np.full(n, -0.69, np.float32),
        values=np.zeros(n, np.float32), rewards=np.ones(n, np.float32),
        policy_versions=np.ones(n, np.int64), bootstrap_obs=np.zeros(4, np.float32),
        assembler="", seq=-1)
    fields.update(changes)
    return p.Trajectory(**fields)


def test_the_trainer_refuses_trajectories_it_cannot_train_on_and_keeps_learning(
        cluster: Cluster):
    """A real trainer between a scripted broker and a scripted assembler."""
    broker = cluster.socket(zmq.ROUTER, cluster.endpoints["policy"], bind=True)
    assembler = cluster.socket(zmq.PUSH, cluster.endpoints["trajectories"], bind=True)
    cluster.start("controller")
    trainer = cluster.start("trainer", "--target-return", "0")
    assert broker.poll(30_000), "the trainer asks the broker for the spaces"
    ident, *frames = broker.recv_multipart()
    assert isinstance(p.decode(frames), p.TrainerHello)
    broker.send_multipart([ident, *p.encode(p.EnvSpec(env_id="CartPole-v1", spec=CARTPOLE_SPEC,
                                                      policy_version=-1))])
    bad: list[p.Trajectory | p.Trajectories] = [
        trajectory(policy_versions=np.ones(0, np.int64)),
        trajectory(bootstrap_obs=np.zeros(5, np.float32)),
        trajectory(actions=np.full(32, 2, np.int64)),
        trajectory(actions=np.zeros(32, np.float32)),
        trajectory(obs=np.full((32, 4), np.nan, np.float32)),
        trajectory(logp=np.zeros(31, np.float32)),
        trajectory(n=0),
        trajectory(bootstrap_from_last=True),  # not truncated: it had a next observation
    ]
    pair = p.Trajectories.of([trajectory(seq=1), trajectory(seq=2)])
    bad += [  # batches: each refused whole
        dataclasses.replace(pair, lengths=[32, 31]),
        dataclasses.replace(pair, lengths=[64, 0]),
        dataclasses.replace(pair, seqs=[1, 1]),
        dataclasses.replace(pair, bootstrap_from_last=[False]),
        dataclasses.replace(pair, agents=["w/0"]),
        dataclasses.replace(pair, bootstrap_obs=np.zeros((1, 4), np.float32)),
        dataclasses.replace(pair, episode_returns=[float("nan"), None], episode_lengths=[3, None]),
        dataclasses.replace(pair, seqs=[], agents=[], epochs=[], lengths=[], terminated=[],
                            truncated=[], episode_returns=[], episode_lengths=[], episodes=[],
                            episode_seeds=[], episode_steps=[]),
    ]
    for t in [*bad, *[trajectory() for _ in range(7)], pair]:
        send_message(assembler, t)

    versions: list[int] = []

    def weights_seen() -> list[int]:
        while broker.poll(100):
            _, *frames = broker.recv_multipart()
            msg = p.decode(frames)
            if isinstance(msg, p.Weights):
                versions.append(msg.version)
        return versions

    wait_for(weights_seen, 30, "the trainer's first weights")
    wait_for(lambda: max(weights_seen()) > versions[0], 30,
             "an update on the good trajectories (a higher version)")
    trainer.signal(signal.SIGTERM)
    assert trainer.wait(10) == 0
    assert f"{len(bad)} messages refused" in trainer.output()
    assert "Traceback" not in trainer.output()


# ---------------------------------------------------------------------------------------------
# RejectLog: counted by reason and sender, logged at most once per second per sender.


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reject_log() -> tuple[node.RejectLog, list[str], FakeClock]:
    lines: list[str] = []
    log = logging.getLogger("test.rejects")
    log.propagate = False
    log.handlers = [ListHandler(lines)]
    clock = FakeClock()
    return node.RejectLog(log, clock=clock), lines, clock


class ListHandler(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_refusals_are_counted_by_reason_and_sender() -> None:
    rejects, _, _ = reject_log()
    for sender, reason, n in (("liar", "bad msgpack", 3), ("liar", "bad dtype", 2),
                              ("6b8b4567", "bad msgpack", 1)):
        for _ in range(n):
            rejects.refuse(sender, p.ProtocolError(reason))
    assert rejects.total == 6
    assert rejects.counts == {"bad msgpack": 4, "bad dtype": 2}
    assert rejects.by_sender == {"liar": {"bad msgpack": 3, "bad dtype": 2},
                                 "6b8b4567": {"bad msgpack": 1}}


def test_each_sender_is_logged_at_most_once_per_second_and_again_when_it_comes_back() -> None:
    rejects, lines, clock = reject_log()
    for _ in range(500):  # a flood within one second: one line
        rejects.refuse("liar", p.ProtocolError("bad msgpack", "x"))
        clock.now += 0.001
    assert lines == ["dropped message from liar: bad msgpack: x"]
    rejects.refuse("other", p.ProtocolError("bad dtype"))  # another sender is not held back
    assert len(lines) == 2 and "other" in lines[1]
    clock.now += 0.6  # past one second since liar's line: its next refusal is logged
    rejects.refuse("liar", p.ProtocolError("frame count"))
    assert lines[2] == ("dropped message from liar: frame count (and 499 more from it since "
                        "its last line)")
    clock.now += 3600  # an hour later, still misbehaving: it shows up again
    rejects.refuse("liar", p.ProtocolError("bad msgpack"))
    assert lines[3] == "dropped message from liar: bad msgpack"
    seconds = 20
    for _ in range(seconds * 100):  # a steady flood: one line per second
        rejects.refuse("liar", p.ProtocolError("bad msgpack"))
        clock.now += 0.01
    assert len(lines) - 4 <= seconds + 1
    assert rejects.total == 500 + 1 + 1 + 1 + seconds * 100


def test_spoofed_senders_cannot_grow_memory_or_the_log() -> None:
    rejects, lines, clock = reject_log()
    cap = node.RejectLog.MAX_SENDERS
    for i in range(cap * 20):
        rejects.refuse(f"spoof-{i}-" + "x" * 300, p.ProtocolError("bad msgpack"))
        clock.now += 0.0001
    assert len(rejects.by_sender) == cap + 1
    assert rejects.by_sender[node.RejectLog.OTHER_SENDERS]["bad msgpack"] == cap * 19
    assert all(len(name) <= node.RejectLog.MAX_NAME for name in rejects.by_sender)
    assert len(rejects._next_line) <= cap + 1 and len(rejects._unlogged) <= cap + 1
    assert len(lines) == cap + 1  # each named sender once, the rest as one sender
    assert rejects.total == cap * 20


def test_reject_figures_are_few_short_scalars() -> None:
    rejects, _, _ = reject_log()
    assert rejects.figures() == {"rejected": 0}  # a clean status row stays clean
    reasons = ["bad msgpack", "bad dtype", "frame count", "bad shape", "unknown kind",
               "bad fields", "protocol version"]
    for i, reason in enumerate(reasons):
        for _ in range(10 - i):
            rejects.refuse(f"sender{i % 4}", p.ProtocolError(reason))
    figures = rejects.figures()
    assert figures["rejected"] == rejects.total == sum(range(4, 11))
    assert figures["rejected_bad_msgpack"] == 10 and figures["rejected_bad_dtype"] == 9
    assert "rejected_bad_fields" not in figures  # past the 5 most frequent reasons
    assert figures["rejected_other_reasons"] == 5 + 4
    assert figures["rejected_from"] == "sender0:16, sender1:14, sender2:12 (+1)"
    assert len(figures) == 1 + 5 + 1 + 1
    assert all(isinstance(v, (int, str)) for v in figures.values())


@pytest.mark.parametrize("kind", [zmq.PULL, zmq.ROUTER])
def test_recv_names_the_sender_of_a_refused_message(kind: int) -> None:
    """ROUTER: the routing id; otherwise, over TCP, the peer's address (it cannot choose it)."""
    rejects, lines, _ = reject_log()
    ctx: zmq.Context = zmq.Context.instance()
    sock = topology.socket(ctx, kind, bind="tcp://127.0.0.1:0")
    peer = topology.stand_in(zmq.DEALER if kind == zmq.ROUTER else zmq.PUSH, ctx=ctx)
    try:
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.IDENTITY, b"liar")
        peer.connect(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        peer.send(b"\xc1 not msgpack")
        assert sock.poll(5000)
        assert node.recv(sock, rejects, routed=kind == zmq.ROUTER)[1] is None
    finally:
        peer.close(0)
        sock.close(0)
    (sender,) = rejects.by_sender
    assert sender == "liar" if kind == zmq.ROUTER else sender.startswith("127.0.0.1 on tcp://")
    assert rejects.counts == {"bad msgpack": 1} and sender in lines[0]


def test_a_name_the_message_claims_is_only_shown_in_the_log_line() -> None:
    rejects, lines, clock = reject_log()
    rejects.refuse("mallory", p.ProtocolError("bad hello", "num_envs 0"), claims="w0")
    clock.now += 1.0
    rejects.refuse("w0", p.ProtocolError("bad hello"), claims="w0")  # its own name: said once
    assert lines == ["dropped message from mallory (claims to be 'w0'): bad hello: num_envs 0",
                     "dropped message from w0: bad hello"]
    assert rejects.by_sender == {"mallory": {"bad hello": 1}, "w0": {"bad hello": 1}}
    assert rejects.figures()["rejected_from"] == "w0:1, mallory:1"


def test_a_handler_refusal_names_the_tcp_peer_that_sent_it_not_the_name_inside() -> None:
    """A well-formed receipt the assembler cannot use, from a PUSH over TCP: refused by its
    handler, counted against the connection's peer address, the trainer it names only
    claimed."""
    ctx: zmq.Context = zmq.Context.instance()
    sock = topology.socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:0")
    peer = topology.stand_in(zmq.PUSH, ctx=ctx)
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    asm = assembler.Assembler(assembler.Config(), node.Outbox(), logging.getLogger("test.asm"),
                              outlet_endpoints={"default": "tcp://127.0.0.1:1"},
                              incarnation="a1")
    try:
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(endpoint)
        send_message(peer, p.Receipt(trainer="w0", incarnation="L1", assembler="a1",
                                     policy="blue", taken=np.zeros(1, np.int64),
                                     learned=np.zeros(0, np.int64)))
        assert sock.poll(5000)
        got, msg, sender = node.recv_from(sock, asm.rejects)
        assert msg is not None and got is None
        asm.deliver(b"", msg, sender=sender)
    finally:
        peer.close(0)
        sock.close(0)
    assert asm.rejects.by_sender == {f"127.0.0.1 on {endpoint}": {"bad receipt": 1}}
    assert asm.figures()["rejected_from"] == f"127.0.0.1 on {endpoint}:1"
