"""Holds each packet a netfilter queue hands over for a delay +- jitter, then lets it go: the
stand-in for `tc qdisc add ... netem delay D J` on a kernel built without netem
(benchmarks/bad_network.py runs it in the router between its two hosts; as root).

    ip netns exec ROUTER python benchmarks/delay_queue.py --queue 0 --delay-ms 50 --jitter-ms 10

An iptables rule `-j NFQUEUE --queue-num N` hands every packet it matches to this process over
netlink (nfnetlink_queue, metadata only: the packet itself stays in the kernel). The verdict,
ACCEPT, is given `delay` plus a uniform draw in [-jitter, +jitter] later, and the packet goes on
where it was stopped, so TCP on both hosts sees the delay in its round trip, with the loss of the
same path, as it would through netem. What it is not: packets are never reordered (in each
direction, told by the interface a packet came in on, a packet goes no sooner than the one
before it, so a draw shorter than its predecessor's waits for it: netem with a FIFO, not
netem's default, which reorders); the timer is this process's, a few ms late on a loaded
machine; and it costs a netlink round trip of CPU per packet, taken from the machine the
pipeline runs on. Stops on SIGTERM or SIGINT, letting every packet it holds go first, and prints
one JSON line of figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

NETLINK_NETFILTER = 12
SO_RCVBUFFORCE = 33
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NFQA_PACKET_HDR, NFQA_VERDICT_HDR, NFQA_IFINDEX_INDEV = 1, 2, 5
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND, NFQNL_COPY_META = 1, 1
NF_ACCEPT = 1
QUEUE_MAXLEN = 65_536  # packets the kernel holds for us before it drops
RCVBUF = 32 << 20  # a full netlink buffer would lose a packet's notice, and the packet with it
NLA_TYPE_MASK = 0x3FFF  # without the nested and byte-order flags
VERDICTS_PER_SEND = 512  # 16 KiB a send, well within a socket's send buffer


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _message(msg_type: int, flags: int, queue: int, attrs: bytes, seq: int = 0) -> bytes:
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack("!H", queue) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags,
                       seq, 0) + body


def _attrs(data: bytes) -> dict[int, bytes]:
    out, at = {}, 0
    while at + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, at)
        if length < 4:
            break
        out[kind & NLA_TYPE_MASK] = data[at + 4:at + length]
        at += (length + 3) & ~3
    return out


def open_queue(queue: int) -> socket.socket:
    """A netlink socket bound to netfilter queue `queue`, metadata only; OSError if the
    kernel refuses (no nfnetlink_queue, the queue taken, not root)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
        sock.bind((0, 0))
        attrs = (_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0))
                 + _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                 + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN)))
        sock.send(_message(NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, queue, attrs, seq=1))
        reply = sock.recv(65536)
        kind = struct.unpack_from("=H", reply, 4)[0]
        error = struct.unpack_from("=i", reply, 16)[0] if kind == NLMSG_ERROR else 0
        if error:
            raise OSError(-error, f"binding netfilter queue {queue}")
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


@dataclass
class DelayQueue:
    """Packets held, per input interface in arrival order, each with the time it may go."""

    sock: socket.socket
    queue: int
    delay_s: float
    jitter_s: float
    rng: random.Random
    held: dict[int, collections.deque[tuple[float, int]]] = field(default_factory=dict)
    last_release: dict[int, float] = field(default_factory=dict)
    packets: int = 0
    most_held: int = 0
    late_s: float = 0.0  # summed over packets: how far past its time each one went

    def take(self, now: float) -> None:
        """Every packet notice waiting on the socket, scheduled."""
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return
            at = 0
            while at + 16 <= len(data):
                length, msg_type = struct.unpack_from("=IH", data, at)
                if msg_type == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    self.schedule(_attrs(data[at + 20:at + length]), now)
                at += max(16, (length + 3) & ~3)

    def schedule(self, attrs: dict[int, bytes], now: float) -> None:
        header = attrs.get(NFQA_PACKET_HDR)
        if header is None or len(header) < 4:
            return
        packet_id = struct.unpack_from("!I", header)[0]
        indev = struct.unpack("!I", attrs[NFQA_IFINDEX_INDEV])[0] \
            if len(attrs.get(NFQA_IFINDEX_INDEV, b"")) == 4 else 0
        draw = self.delay_s + self.rng.uniform(-self.jitter_s, self.jitter_s)
        release = max(now + draw, self.last_release.get(indev, 0.0))
        self.last_release[indev] = release
        line = self.held.setdefault(indev, collections.deque())
        line.append((release, packet_id))
        self.packets += 1
        self.most_held = max(self.most_held, sum(len(q) for q in self.held.values()))

    def release(self, now: float, everything: bool = False) -> float | None:
        """Verdicts for the packets whose time has come (all of them with `everything`), in
        one send; the time the next one is due (None: none held)."""
        verdicts = []
        for line in self.held.values():
            while line and (everything or line[0][0] <= now):
                due, packet_id = line.popleft()
                self.late_s += max(0.0, now - due)
                verdicts.append(_message(NFQNL_MSG_VERDICT, NLM_F_REQUEST, self.queue,
                                         _attr(NFQA_VERDICT_HDR,
                                               struct.pack("!II", NF_ACCEPT, packet_id))))
        for at in range(0, len(verdicts), VERDICTS_PER_SEND):
            self.sock.send(b"".join(verdicts[at:at + VERDICTS_PER_SEND]))
        heads = [line[0][0] for line in self.held.values() if line]
        return min(heads) if heads else None

    def figures(self) -> dict[str, Any]:
        return {"packets": self.packets, "most_held": self.most_held,
                "mean_late_ms": round(1000 * self.late_s / max(1, self.packets), 3)}


def serve(dq: DelayQueue, stop: list[bool]) -> None:
    """Until `stop` holds a True: take notices, let packets go on time."""
    while not stop:
        now = time.monotonic()
        due = dq.release(now)
        wait = 0.5 if due is None else max(0.0, due - now)
        try:
            readable, _, _ = select.select([dq.sock], [], [], wait)
        except InterruptedError:
            continue
        if readable:
            dq.take(time.monotonic())
    dq.release(time.monotonic(), everything=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=int, default=0, help="netfilter queue number")
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--jitter-ms", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.jitter_ms > args.delay_ms or args.delay_ms < 0:
        print("delay_queue: --jitter-ms must be within 0 and --delay-ms", file=sys.stderr)
        return 2
    stop: list[bool] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        sock = open_queue(args.queue)
    except OSError as exc:
        print(f"delay_queue: cannot bind netfilter queue {args.queue}: {exc}", file=sys.stderr)
        return 1
    dq = DelayQueue(sock, args.queue, args.delay_ms / 1000, args.jitter_ms / 1000,
                    random.Random(args.seed))
    print(f"delay_queue: queue {args.queue}, {args.delay_ms:g} +- {args.jitter_ms:g} ms",
          file=sys.stderr, flush=True)
    try:
        serve(dq, stop)
    finally:
        sock.close()
    print(json.dumps(dq.figures()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
