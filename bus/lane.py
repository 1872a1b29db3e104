"""A lane: a pair of named pipes between a vector env's caller and one worker it started on the
same host, carrying that worker's requests and answers (RESET, STEP, their STEP_RESULTs, env
calls) as the messages they are on a socket, frame for frame.

Why pipes beside ZeroMQ: a lockstep step waits on one round trip per worker, and on this path
ZeroMQ's I/O threads wake four times per message where a pipe wakes its reader once; with
small batches (8 CartPole envs) the wakes, not the bytes, were the cost of a step. Heartbeats
and hellos stay on the worker's socket, so liveness, joins and restarts are the relay's as
ever; a lane only replaces the transport of what a worker is asked and answers.

The FIFOs live in the caller's private directory (mode 0700); what comes through one is decoded
and checked as anything from a socket is. The caller opens its ends first (the one it writes
read-write, so neither open ever waits), then starts the worker, which opens the other ends.
When the worker's process ends, its end closes and the caller reads end of file at once.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import select
import stat
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepbus.bus import node, topology
from stepbus.bus import protocol as p
from stepbus.bus.topology import AnyPort, PortName

COUNT = struct.Struct("<I")  # frames in a message, then each frame's length
MAX_FRAMES = p.MAX_ARRAYS + 1  # as a socket's: the header and the arrays
MAX_MESSAGE_BYTES = topology.MAX_MESSAGE_BYTES
READ_BYTES = 1 << 20


class LaneError(Exception):
    """The other end broke the framing or went away; the lane is unusable."""


@dataclass(frozen=True)
class LanePaths:
    """The two FIFOs of one lane, named after the worker."""

    to_worker: Path
    to_caller: Path

    @classmethod
    def of(cls, prefix: str | os.PathLike[str]) -> LanePaths:
        """`prefix` is what the worker is given (`stepbus worker --lane PREFIX`)."""
        return cls(Path(f"{os.fspath(prefix)}.in"), Path(f"{os.fspath(prefix)}.out"))

    def make(self) -> None:
        for path in (self.to_worker, self.to_caller):
            os.mkfifo(path, 0o600)


def _check_fifos(paths: LanePaths) -> None:
    for path in (paths.to_worker, paths.to_caller):
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            raise LaneError(f"{path} is not a FIFO")


def hung_up(fd: int) -> bool:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return any(events & select.POLLHUP for _, events in poll.poll(0))


def pack(frames: Sequence[Any]) -> list[memoryview]:
    """A message's frames as the lane writes them: the count and lengths, then the frames."""
    views = [memoryview(f).cast("B") for f in frames]
    head = struct.pack(f"<{len(views) + 1}I", len(views), *(v.nbytes for v in views))
    return [memoryview(head), *views]


class Lane:
    """One end of a lane: `send` writes a whole message, `receive` yields the complete
    messages readable now.

    The worker's writes block (its caller may be busy for minutes between steps, and the
    worker has nothing else to do); the caller's give up after `write_timeout_s`, so a request
    to a worker that stopped reading (frozen) never holds the caller past the liveness bound.
    """

    def __init__(self, read_fd: int, write_fd: int, write_timeout_s: float = math.inf) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self.write_timeout_s = write_timeout_s
        os.set_blocking(read_fd, False)
        self.pending = bytearray()
        self.ended = False  # the other end closed (its process ended), or a write failed
        self.received = 0  # whole messages read
        self.closed = False

    @classmethod
    def caller_end(cls, paths: LanePaths) -> Lane:
        """Opened before the worker starts: neither open waits for the other end."""
        _check_fifos(paths)
        write_fd = os.open(paths.to_worker, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            read_fd = os.open(paths.to_caller, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            os.close(write_fd)
            raise
        return cls(read_fd, write_fd, write_timeout_s=node.LIVENESS_S)

    @classmethod
    def worker_end(cls, paths: LanePaths) -> Lane:
        """The caller holds its ends open already; without them (no caller) this fails at
        once rather than waiting for one.

        Raises:
            LaneError: a path is not a FIFO, or nobody reads the caller's end.
        """
        try:
            _check_fifos(paths)
            write_fd = os.open(paths.to_caller, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            reason = "nobody reads it" if exc.errno == errno.ENXIO else exc.strerror
            raise LaneError(f"cannot open the lane {paths.to_caller}: {reason}") from exc
        try:
            os.set_blocking(write_fd, True)
            read_fd = os.open(paths.to_worker, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            os.close(write_fd)
            raise
        return cls(read_fd, write_fd)

    def send(self, msg: p.Message) -> None:
        """Raises:
            LaneError: the reader is gone, or read nothing for `write_timeout_s` (the lane is
                unusable then: part of a message may be in it)."""
        views = pack(p.encode(msg))
        deadline = time.monotonic() + self.write_timeout_s
        try:
            while views:  # one system call, one wake-up of the reader, for a whole message
                try:
                    written = os.writev(self.write_fd, views)
                except BlockingIOError:
                    self.wait_writable(deadline)
                    continue
                while views and written >= views[0].nbytes:
                    written -= views.pop(0).nbytes
                if views:
                    views[0] = views[0][written:]
        except OSError as exc:
            self.ended = True
            raise LaneError(f"the lane's reader is gone ({exc})") from exc

    def wait_writable(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            self.ended = True
            raise LaneError(f"the other end read nothing for {self.write_timeout_s:g} s")
        poll = select.poll()
        poll.register(self.write_fd, select.POLLOUT)
        poll.poll(math.ceil(left * 1000))

    def receive(self) -> Iterator[list[memoryview]]:
        """The frames of each complete message readable now (decode them with
        `protocol.decode`); sets `ended` at end of file.

        Raises:
            LaneError: a frame count or length out of bounds: nothing after it can be trusted.
        """
        while not self.ended:
            try:
                chunk = os.read(self.read_fd, READ_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                # A FIFO reads as empty before its writer first opens it too: only a hang-up
                # (a writer came and went) is the end.
                self.ended = hung_up(self.read_fd)
                break
            self.pending += chunk
            if len(chunk) < READ_BYTES:
                break
        while True:
            frames = self.take_one()
            if frames is None:
                return
            yield frames

    def take_one(self) -> list[memoryview] | None:
        """The first complete message in `pending`, removed from it; None if none is whole."""
        if len(self.pending) < COUNT.size:
            return None
        (count,) = COUNT.unpack_from(self.pending)
        if not 1 <= count <= MAX_FRAMES:
            raise LaneError(f"a message of {count} frames (at most {MAX_FRAMES})")
        head = COUNT.size * (count + 1)
        if len(self.pending) < head:
            return None
        sizes = struct.unpack_from(f"<{count}I", self.pending, COUNT.size)
        total = head + sum(sizes)
        if total > MAX_MESSAGE_BYTES:
            raise LaneError(f"a message of {total} bytes (at most {MAX_MESSAGE_BYTES})")
        if len(self.pending) < total:
            return None
        body = memoryview(bytes(self.pending[head:total]))
        del self.pending[:total]
        self.received += 1
        frames, at = [], 0
        for size in sizes:
            frames.append(body[at:at + size])
            at += size
        return frames

    def close(self) -> None:
        """Once only: a second close could close a descriptor the number was reused for."""
        if self.closed:
            return
        self.closed = self.ended = True
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


class LanePorts(node.SocketPorts):
    """A worker's sockets, except that what it answers on "steps" goes down its lane: all but
    its hellos and heartbeats, which keep telling the relay it is alive on the socket."""

    ON_THE_SOCKET = (p.WorkerHello, p.Heartbeat)

    def __init__(self, sockets: dict[str, Any], lane: Lane) -> None:
        super().__init__(sockets)
        self.lane = lane

    def send(self, port: AnyPort, msg: p.Message, *, to: bytes | None = None,
             block: bool = False) -> bool:
        if port != PortName.STEPS or isinstance(msg, self.ON_THE_SOCKET):
            return super().send(port, msg, to=to, block=block)
        try:
            self.lane.send(msg)
        except LaneError:
            return False
        return True


def deliver_all(lane: Lane, process: node.Process, peer: bytes, kinds: tuple[type, ...],
                sender: str) -> None:
    """Every whole message readable on `lane` to `process`, checked as the loop checks a
    socket's: one that does not decode, or is of a kind not taken here, is refused and counted.

    Raises:
        LaneError: the framing broke.
    """
    for frames in lane.receive():
        try:
            msg = p.decode(frames)
        except p.ProtocolError as exc:
            process.rejects.refuse(sender, exc)
            continue
        if not isinstance(msg, kinds):
            process.rejects.refuse(sender, p.ProtocolError("unexpected kind", msg.KIND.name))
            continue
        process.deliver(peer, msg, sender=sender)
