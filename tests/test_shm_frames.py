"""`stepbus worker --shm-frames`: observations through shared memory on one host, with every
observation checked against what the env produced, and the socket whenever shared memory
cannot be used (a broker that cannot map the segment, a stopped assembler)."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from conftest import (
    EVERY_UPDATE,
    Cluster,
    TrajectoryInbox,
    act_as_trainer,
    send_message,
    wait_for,
)
from controller_probe import status_rows
from scripted_envs import STAMP_SHAPE, stamp
from test_deterministic import TIMING, cluster_of_its_own

from stepbus.bus import protocol as p
from stepbus.bus import shm
from stepbus.models import mlp
from stepbus.policy import ActionSpace

ENV = ("--env", "scripted_envs:stamp_frames", "--envs-per-worker", "8")
DICT_ENV = ("--env", "space_envs:match_dict", "--envs-per-worker", "8")
# Every batch through shared memory, however small (by default only those of 64 KiB and up).
SHM = ("--shm-frames", "--shm-min-batch-bytes", "0")
NO_SHM = ("--no-shm-frames", "--shm-min-batch-bytes", "0")  # none, though any size would do
OBS_DIM = int(np.prod(STAMP_SHAPE))


def worker_name(tag: str) -> str:
    """Names of our own, so segments of other test runs on this machine are never ours."""
    return f"shm{os.getpid()}-{tag}"


def segments(name: str, *, half_made: bool = False) -> list[str]:
    """The worker's whole segments (and, with `half_made`, those it is still making: a test
    that acts on a segment must not act on one whose header is not written yet)."""
    found = glob.glob(f"{shm.DIR}/{shm.segment_name(name, '')}*")
    return found if half_made else [path for path in found if shm.PART not in path]


def figures(c: Cluster, role: str) -> dict:
    return next((r for r in status_rows(c) if r["role"] == role), {})


class Checker:
    """The test as trainer: takes trajectories in, checks each observation bit for bit against
    the env's stamp and each agent's trajectories for continuity, and hands out credit."""

    def __init__(self, c: Cluster) -> None:
        self.weights, self.inbox = act_as_trainer(c, OBS_DIM)
        self.params = mlp.init_params(OBS_DIM, ActionSpace("discrete", n=2), (8,),
                                      np.random.default_rng(0))
        self.steps = 0
        self.next_step: dict[str, tuple[int, int]] = {}  # agent -> (episode seed, next step)

    def take(self, inbox: TrajectoryInbox) -> p.Trajectory:
        t = inbox.recv(10)
        seed, start = t.episode_seed, t.episode_step
        assert seed != -1 and start >= 0, t.agent
        for j, frame in enumerate(t.obs):
            assert np.array_equal(frame, stamp(seed, start + j)), (t.agent, seed, start + j)
        assert isinstance(t.bootstrap_obs, np.ndarray), t.agent
        assert np.array_equal(t.bootstrap_obs, stamp(seed, start + len(t.obs)))
        expected = self.next_step.get(t.agent)
        if expected is not None and expected[0] == seed:  # nothing of the episode lost
            assert start == expected[1], (t.agent, expected, start)
        self.next_step[t.agent] = (seed, start + len(t.obs))
        self.steps += len(t.obs)
        return t

    def run_until(self, steps: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.steps < steps:
            assert time.monotonic() < deadline, f"{self.steps} of {steps} steps"
            self.take(self.inbox)
            self.credit(self.steps)

    def credit(self, consumed: int, *, starving: bool = False) -> None:
        """Say we took in `consumed` steps: the broker steps up to its window beyond that (and,
        `starving`, tops the window up: we wait for data it thinks is in flight)."""
        send_message(self.weights, p.Weights(
            trainer="t", incarnation="t1", policy="default", version=1,
            consumed_steps=consumed, batch_steps=256, starving=starving, params=self.params))

    def close(self) -> None:
        self.weights.close()
        self.inbox.close()


def start(c: Cluster, name: str, *extra: str, broker: bool = True) -> None:
    c.start("controller")
    if broker:
        c.start("broker")
    c.start("assembler")
    c.start("worker", "--name", name, *SHM, *ENV, *extra)


def test_observations_arrive_intact_through_shared_memory_and_a_stopped_assembler(
        cluster: Cluster) -> None:
    name = worker_name("a")
    start(cluster, name)
    checker = Checker(cluster)
    try:
        checker.run_until(1500)
        wait_for(lambda: figures(cluster, "broker").get("shm_slots_forwarded", 0) > 10, 20,
                 "slots forwarded")
        # A stopped assembler: its stamp goes stale (the broker sends rows) and it releases no
        # slots (the worker sends rows), and nothing is lost once it goes on.
        assembler = next(proc for proc in cluster.procs if proc.name.startswith("assembler"))
        assembler.signal(signal.SIGSTOP)
        def batches_on_the_socket() -> bool:
            checker.credit(checker.steps, starving=True)
            return figures(cluster, "worker").get("shm_full", 0) + figures(
                cluster, "broker").get("shm_rows_forwarded", 0) > 0

        try:  # starving, we are granted steps beyond the window (queued for the assembler)
            wait_for(batches_on_the_socket, 20,
                     "batches on the socket while the assembler is stopped")
        finally:
            assembler.signal(signal.SIGCONT)
        checker.run_until(checker.steps + 3000)
        wait_for(lambda: figures(cluster, "broker").get("shm_slots_forwarded", 0) > 50, 20,
                 "slots again")
        row = figures(cluster, "assembler")
        assert row["shm_read"] > 0
        for lost in ("gaps", "steps_lost", "shm_mismatch", "shm_unreadable", "rejected"):
            assert row[lost] == 0, (lost, row)
    finally:
        checker.close()


def test_broker_that_cannot_map_the_segment_gets_rows_on_the_socket(cluster: Cluster) -> None:
    name = worker_name("b")
    start(cluster, name, broker=False)
    found = wait_for(lambda: segments(name), 20, "the worker's segment")
    os.unlink(found[0])  # as if the broker ran on another host
    cluster.start("broker")
    checker = Checker(cluster)
    try:
        checker.run_until(1500)
        # figures travel with heartbeats (every 0.5 s): wait for the worker's to show steps
        worker = wait_for(lambda: (lambda row: row if row.get("env_steps", 0) > 0 else None)(
            figures(cluster, "worker")), 10, "the worker's figures to show its steps")
        # ... and the broker's refusal, counted at the worker's hello, on its next heartbeat
        broker = wait_for(lambda: (lambda row: row if row.get("shm_refused") else None)(
            figures(cluster, "broker")), 10, "the broker's figures to show its refusal")
        assert broker["shm_refused"] == 1 and broker["shm_slots_forwarded"] == 0, broker
        assert worker["shm_batches"] == 0 and worker["env_steps"] > 0, worker
        assert figures(cluster, "assembler")["shm_read"] == 0
    finally:
        checker.close()


def test_a_killed_workers_segment_is_removed(cluster: Cluster) -> None:
    name = worker_name("c")
    start(cluster, name)
    checker = Checker(cluster)
    try:
        checker.run_until(500)
        [first] = segments(name)
        worker = next(proc for proc in cluster.procs if proc.name.startswith("worker"))
        worker.signal(signal.SIGKILL)
        worker.wait(5)  # reaped, as honcho would
        # The broker forgets it after the liveness timeout and removes what it left behind.
        wait_for(lambda: not os.path.exists(first), 20, "the broker to remove the segment")
        # A worker killed while no broker maps its segment: its next incarnation removes it.
        second = cluster.start("worker", "--name", name, *SHM, *ENV)
        [old] = wait_for(lambda: segments(name), 20, "a new segment")
        second.signal(signal.SIGKILL)
        second.wait(5)
        third = cluster.start("worker", "--name", name, *SHM, *ENV)
        wait_for(lambda: not os.path.exists(old) and segments(name), 20,
                 "the old segment replaced")
        third.signal(signal.SIGTERM)
        assert third.wait(10) == 0
        assert segments(name, half_made=True) == []  # a worker that exits removes its own
    finally:
        checker.close()


def run_deterministic(shm_frames: bool, env: tuple[str, ...] = ENV) -> tuple[list[dict], str]:
    with cluster_of_its_own() as c:
        procs = [c.start("controller"), c.start("broker", "--seed", "3", "--deterministic"),
                 c.start("assembler"),
                 c.start("worker", "--name", worker_name("d"), "--seed", "3", *env,
                         *(SHM if shm_frames else NO_SHM)),
                 c.start("learner", "--seed", "3", "--target-return", "0", "--max-updates",
                         "6", "--hidden", "8", *EVERY_UPDATE)]  # compared update by update
        codes = [proc.wait(90) for proc in procs]
        assert codes == [0] * 5, codes
        return c.metrics(), procs[2].output()


@pytest.mark.parametrize("env", [ENV, DICT_ENV], ids=["box", "dict"])
def test_trajectories_are_bit_equal_with_and_without_shared_memory(env: tuple[str, ...]) -> None:
    """A Box's frames and a nested Dict's leaves (floats, ints, bits, bytes) alike."""
    plain, plain_log = run_deterministic(False, env)
    shared, shared_log = run_deterministic(True, env)
    assert "read from shared memory" not in plain_log
    assert "read from shared memory" in shared_log
    assert len(plain) == len(shared) == 6
    for a, b in zip(plain, shared, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING} == {
            k: v for k, v in b.items() if k not in TIMING}


def test_hostile_segment_names_are_refused() -> None:
    for name in ("../etc/passwd", "stepbus-../../x", "other", "stepbus-a/b", "", "stepbus-"):
        assert not shm.valid_name(name)
        try:
            shm.Reader(name, "00" * 16)
        except shm.Refused:
            continue
        raise AssertionError(name)
    writer = shm.Writer(shm.segment_name(worker_name("e"), "x"), np.zeros((2, 3), np.float32))
    try:
        for nonce in ("zz", "00" * 16, "00"):  # not hex, another nonce, too short
            try:
                shm.Reader(writer.name, nonce)
            except shm.Refused:
                continue
            raise AssertionError(nonce)
        reader = shm.Reader(writer.name, writer.nonce.hex())
        like = np.zeros((0, 3), np.float32)
        assert reader.view(-1, like) is None
        assert reader.view(shm.SLOTS, like) is None
        assert reader.view(0, np.zeros((0, 3), np.float64)) is None
        s = writer.acquire()
        slot = writer.views[s]
        assert isinstance(slot, np.ndarray)
        slot[:] = 1.5
        writer.publish(s, 7)
        view = reader.view(s, like)
        assert isinstance(view, np.ndarray) and reader.holds(s, 7) and (view == 1.5).all()
        assert not view.flags.writeable
        # Until the reader releases it, a slot is not handed out again.
        taken = {writer.acquire(0) for _ in range(3 * shm.SLOTS)}
        assert s not in taken
        # ... or until RECLAIM_S have passed (its reader died): then a late reader sees that the
        # slot holds another batch (the assembler counts it and does not use the rows).
        writer.publish(writer.acquire(), 8)  # the slot of the batch before is never handed out
        writer.since[s] -= shm.RECLAIM_S + 1
        taken = {writer.acquire(0) for _ in range(3 * shm.SLOTS)}
        assert s in taken and writer.reclaimed == 1 and not reader.holds(s, 7)
    finally:
        writer.close()
    assert not os.path.exists(writer.path)


def test_a_slot_holds_every_leaf_of_a_batch_each_in_an_aligned_block_of_its_own() -> None:
    like: dict[str, np.ndarray] = {
        "pos": np.zeros((3, 2), np.float32), "cell": np.zeros(3, np.int64),
        "bits": np.zeros((3, 3), np.int8), "img": np.zeros((3, 2, 2), np.uint8)}
    writer = shm.Writer(shm.segment_name(worker_name("l"), "x"), like)
    try:
        reader = shm.Reader(writer.name, writer.nonce.hex())
        for s in (0, 1):
            leaves = writer.views[s]
            assert isinstance(leaves, dict) and list(leaves) == list(like)
            for i, leaf in enumerate(leaves.values()):
                leaf[...] = (np.arange(leaf.size) + 10 * s + i).reshape(leaf.shape)
            writer.publish(s, s)
            view = reader.view(s, {key: leaf[:0] for key, leaf in like.items()})
            assert isinstance(view, dict) and list(view) == list(like)
            for key, leaf in view.items():
                assert leaf.dtype == like[key].dtype and leaf.shape == like[key].shape
                assert np.array_equal(leaf, leaves[key]) and leaf.flags.aligned, key
        assert reader.view(0, {"pos": like["pos"][:0]}) is None, "another layout's bytes"
        assert reader.view(0, np.zeros((0, 23), np.uint8)) is not None, "only sizes are known"
    finally:
        writer.close()


def test_no_segment_with_no_shm_frames(cluster: Cluster) -> None:
    """Batches any size would do (--shm-min-batch-bytes 0), the broker on this host: none."""
    name = worker_name("f")
    cluster.start("controller")
    cluster.start("broker")
    cluster.start("assembler")
    cluster.start("worker", "--name", name, *ENV, *NO_SHM)
    weights, inbox = act_as_trainer(cluster, OBS_DIM)
    try:
        inbox.recv(20)
        assert segments(name, half_made=True) == []
    finally:
        weights.close()
        inbox.close()


def test_no_segment_for_a_broker_on_another_host(cluster: Cluster) -> None:
    """A steps endpoint beyond this host (TCP, not loopback): no broker there could map a
    segment, so the worker makes none, whatever its flags and batch size."""
    name = worker_name("r")
    cluster.start("controller")
    worker = cluster.start("worker", "--name", name, *SHM, *ENV, "--steps", "tcp://192.0.2.1:9")
    wait_for(lambda: "connecting to tcp://192.0.2.1:9" in worker.output(), 30,
             "the worker to make its envs and connect")
    assert segments(name, half_made=True) == []
    worker.signal(signal.SIGTERM)
    assert worker.wait(10) == 0


def test_a_segment_half_made_by_a_killed_worker_is_removed_by_its_next_incarnation() -> None:
    """A worker killed while it makes its segment leaves it under a name that says whose it
    is (no header says it yet): the next incarnation removes it, and never a live maker's."""
    name = worker_name("h")
    gone = subprocess.Popen(["true"])  # a pid that has exited
    gone.wait()
    half = f"{shm.DIR}/{shm.segment_name(name, 'aaaa')}{shm.PART}{gone.pid}"
    mine = f"{shm.DIR}/{shm.segment_name(name, 'bbbb')}{shm.PART}{os.getpid()}"
    for path in (half, mine):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)  # its header not written yet
    long_name = worker_name("h" * 200)  # its segment's name cut at the longest there is
    long_half = f"{shm.DIR}/{shm.segment_name(long_name, 'cccc')}{shm.PART}{gone.pid}"
    with open(long_half, "wb") as f:
        f.write(b"\0" * 100)
    try:
        assert shm.remove_orphans(name) == 1
        assert not os.path.exists(half) and os.path.exists(mine)
        assert shm.remove_orphans(long_name) == 1 and not os.path.exists(long_half)
    finally:
        for path in (half, mine, long_half):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
