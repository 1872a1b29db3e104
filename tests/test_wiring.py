"""The project's socket options with real processes: a bound socket whose receive queue is full
when its peer hangs up stays alive (libzmq's own heartbeats would abort it: see bus/topology.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from stepbus.bus import topology, wiring

# The bound side, in a process of its own, since the failure is an abort(). It answers the
# peer's first message and then holds what the peer sends without reading, as a busy broker or
# learner does, until told the peer has gone; then waits past two intervals of the 1 s
# heartbeats libzmq would send if they were on, and reads it all.
BOUND = """
import sys, time, zmq
from stepbus.bus import topology
ctx = zmq.Context()
sock = topology.socket(ctx, zmq.ROUTER, bind=sys.argv[1], rcvhwm=4)
print("bound", flush=True)
peer, _ = sock.recv_multipart()
for _ in range(50):  # more than the peer reads: over TCP its close then resets the connection
    sock.send_multipart([peer, b"y" * 100_000], zmq.NOBLOCK)
sys.stdin.readline()
time.sleep(2.5)
taken = 0
while sock.poll(200):
    sock.recv_multipart()
    taken += 1
print(taken, flush=True)
sock.close(0)
ctx.term()
"""
PAYLOAD = b"x" * 100_000  # a few fill the kernel's buffers, so the receiver's queue is what stops


def fill_and_hang_up(endpoint: str) -> int:
    """Send to `endpoint` until the receiver takes no more, then close at once; how many sent."""
    ctx: zmq.Context = zmq.Context.instance()
    peer = topology.stand_in(zmq.DEALER, ctx=ctx)
    peer.setsockopt(zmq.SNDHWM, 4)
    peer.setsockopt(zmq.RCVHWM, 1)  # what it is sent stays unread in the kernel's buffers
    peer.connect(endpoint)
    sent = 0
    try:
        while peer.poll(2000, zmq.POLLOUT):  # not writable for 2 s: every queue is full
            peer.send(PAYLOAD, zmq.NOBLOCK)
            sent += 1
            assert sent < 10_000, "the receiver's queue never filled"
    finally:
        peer.close(0)
    return sent


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_full_receiver_outlives_its_peer_hanging_up(tmp_path: Path, transport: str) -> None:
    endpoint = (f"ipc://{tmp_path}/bound" if transport == "ipc"
                else f"tcp://127.0.0.1:{wiring.free_tcp_ports(1)[0]}")
    bound = subprocess.Popen([sys.executable, "-c", BOUND, endpoint], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert bound.stdout is not None and bound.stdin is not None
        if (first := bound.stdout.readline()).strip() != "bound":
            pytest.fail(first + bound.communicate(timeout=30)[0])
        sent = fill_and_hang_up(endpoint)
        bound.stdin.write("gone\n")
        bound.stdin.flush()
        out, _ = bound.communicate(timeout=30)
    finally:
        bound.kill()
    assert bound.returncode == 0, out
    assert 4 <= int(out.split()[-1]) <= sent, out  # its full queue, read after the hang-up
