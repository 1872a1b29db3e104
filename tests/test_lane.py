"""Lanes (bus/lane.py): the named pipes a vector env's steps take to and from a worker it
started. Real FIFOs in a temp directory: whole messages both ways, a frame batch larger than a
pipe holds, an end seen at once when the other process's end closes, a broken frame refused,
and an open that never waits for a missing other end."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_for

from stepbus.bus import lane, node
from stepbus.bus import protocol as p
from stepbus.bus.lane import Lane, LaneError, LanePaths


@pytest.fixture
def paths(tmp_path: Path) -> LanePaths:
    made = LanePaths.of(tmp_path / "lane-w")
    made.make()
    return made


@pytest.fixture
def ends(paths: LanePaths) -> Iterator[tuple[Lane, Lane]]:
    caller = Lane.caller_end(paths)
    worker = Lane.worker_end(paths)
    try:
        yield caller, worker
    finally:
        caller.close()
        worker.close()


def received(end: Lane, want: int = 1, timeout_s: float = 10.0) -> list[p.Message]:
    got: list[p.Message] = []

    def enough() -> bool:
        got.extend(p.decode(f) for f in end.receive())
        return len(got) >= want

    wait_for(enough, timeout_s, f"{want} messages down the lane")
    return got


def step(actions: np.ndarray, seq: int = 1) -> p.Step:
    return p.Step(epoch=1, seq=seq, policy_version=0, actions=actions)


def test_messages_go_whole_both_ways_in_order(ends: tuple[Lane, Lane]) -> None:
    caller, worker = ends
    for seq in (1, 2, 3):
        caller.send(step(np.arange(8), seq))
    got = received(worker, 3)
    assert [m.seq for m in got] == [1, 2, 3]  # type: ignore[attr-defined]
    assert np.array_equal(got[0].actions, np.arange(8))  # type: ignore[attr-defined]
    error = p.RemoteError(origin="worker w", error_type="ValueError", message="boom",
                          traceback="", context={"env": 3})
    worker.send(error)
    assert received(caller) == [error]
    assert (caller.received, worker.received) == (1, 3)


def test_a_frame_batch_larger_than_the_pipe_holds_arrives_whole(
        ends: tuple[Lane, Lane]) -> None:
    """The writer blocks until the reader drains the pipe; nothing is cut or interleaved."""
    caller, worker = ends
    frames = np.random.default_rng(0).integers(0, 255, (16, 84, 84, 4), dtype=np.uint8)
    writer = threading.Thread(target=worker.send, args=(step(frames, 7),))
    writer.start()
    got = received(caller)
    writer.join(10)
    assert not writer.is_alive()
    assert np.array_equal(got[0].actions, frames)  # type: ignore[attr-defined]


def test_before_the_worker_opens_its_end_the_callers_end_is_not_ended(
        paths: LanePaths) -> None:
    """A FIFO reads empty before its writer first opens it, as after it closed: only the
    latter is the end."""
    caller = Lane.caller_end(paths)
    try:
        assert list(caller.receive()) == [] and not caller.ended
    finally:
        caller.close()


def test_a_worker_process_that_ends_ends_the_callers_lane_at_once(paths: LanePaths) -> None:
    caller = Lane.caller_end(paths)
    try:
        child = subprocess.run(
            [sys.executable, "-c",
             "import sys; from stepbus.bus.lane import Lane, LanePaths; "
             "Lane.worker_end(LanePaths.of(sys.argv[1]))",
             str(paths.to_worker)[:-len(".in")]], timeout=60, capture_output=True, text=True)
        assert child.returncode == 0, child.stderr
        wait_for(lambda: list(caller.receive()) == [] and caller.ended, 10,
                 "the caller's end to see the worker's close")
    finally:
        caller.close()


def test_a_worker_end_with_nobody_at_the_other_refuses_at_once(paths: LanePaths,
                                                               tmp_path: Path) -> None:
    with pytest.raises(LaneError, match="nobody reads it"):
        Lane.worker_end(paths)
    (tmp_path / "plain.in").write_text("")
    (tmp_path / "plain.out").write_text("")
    with pytest.raises(LaneError, match="not a FIFO"):
        Lane.worker_end(LanePaths.of(tmp_path / "plain"))


@pytest.mark.parametrize("head, why", [
    (struct.pack("<I", 0), "0 frames"),
    (struct.pack("<I", lane.MAX_FRAMES + 1), f"{lane.MAX_FRAMES + 1} frames"),
    (struct.pack("<II", 1, lane.MAX_MESSAGE_BYTES), "bytes"),
])
def test_a_frame_count_or_length_out_of_bounds_breaks_the_lane(
        ends: tuple[Lane, Lane], head: bytes, why: str) -> None:
    caller, worker = ends
    os.write(worker.write_fd, head)
    with pytest.raises(LaneError, match=why):
        received(caller)


class Taker(node.Process):
    """What `deliver_all` hands a process, kept."""

    def __init__(self) -> None:
        super().__init__(node.Outbox(), logging.getLogger("test"))
        self.steps: list[p.Step] = []

    def on_step(self, peer: bytes, msg: p.Step) -> None:
        self.steps.append(msg)


def test_what_does_not_decode_or_is_not_taken_there_is_refused_and_the_rest_delivered(
        ends: tuple[Lane, Lane]) -> None:
    caller, worker = ends
    caller.send(p.Heartbeat(role="broker", name="b", host="h", pid=1, leaving=False,
                            figures={}))
    os.writev(caller.write_fd, lane.pack([b"\x93not msgpack"]))
    caller.send(step(np.arange(3)))
    taker = Taker()

    def delivered() -> bool:
        lane.deliver_all(worker, taker, b"", (p.Step,), "the lane")
        return len(taker.steps) == 1

    wait_for(delivered, 10, "the step")
    assert taker.rejects.total == 2


def test_a_caller_whose_worker_reads_nothing_gives_up_after_its_timeout(
        ends: tuple[Lane, Lane]) -> None:
    """A frozen worker never holds its caller past the bound: the lane is then unusable."""
    caller, _ = ends
    caller.write_timeout_s = 0.2
    with pytest.raises(LaneError, match=r"read nothing for 0\.2 s"):
        caller.send(step(np.zeros((16, 84, 84, 4), np.uint8)))  # more than a pipe holds
    assert caller.ended
