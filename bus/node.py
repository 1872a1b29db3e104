"""What every stepbus process shares: quiet signal handling, the controller link, and the
accounting of untrusted input. Each process module is one poll loop built from these parts."""

from __future__ import annotations

import logging
import os
import signal
import socket as pysocket
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq
from stepbus.bus import protocol as p
from stepbus.bus import wiring

from stepbus import entry

HEARTBEAT_INTERVAL_S = 0.5
LIVENESS_INTERVALS = 3  # a peer silent for this many heartbeat intervals is dead
MAX_POLL_MS = 200  # upper bound on any poll, so a stop signal is seen within it


def setup_logging(role: str) -> logging.Logger:
    level = os.environ.get("STEPBUS_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s", force=True
    )
    return logging.getLogger(f"stepbus.{role}")


class StopFlag:
    """SIGINT/SIGTERM set a flag instead of raising, so loops finish their duties and exit 0."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGINT,
                                                              signal.SIGTERM)) -> None:
        self.reason = ""
        for sig in signals:
            signal.signal(sig, self._on_signal)
        if entry.EARLY_SIGNALS:  # arrived while the process was still importing
            self.reason = signal.Signals(entry.EARLY_SIGNALS[0]).name

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.reason = self.reason or signal.Signals(signum).name

    def __bool__(self) -> bool:
        return bool(self.reason)


class RejectLog:
    """Refused input, counted by (reason, sender) and logged at most once per second per
    sender, so a hostile or broken peer can neither flood the log nor drop out of it: a sender
    still misbehaving an hour later is logged again, with how many of its refusals were only
    counted since its previous line. `figures()` puts the counts in `stepbus status`."""

    MAX_SENDERS = 256  # senders counted by name; a spoofing flood of names cannot grow memory
    OTHER_SENDERS = "(other senders)"  # everyone past MAX_SENDERS, counted and logged as one
    LOG_INTERVAL_S = 1.0
    MAX_NAME = 64  # characters of a sender name kept (ROUTER identities reach 255 bytes)
    FIGURE_REASONS = 5  # reasons shown as rejected_<reason>; the rest add up in one figure
    FIGURE_SENDERS = 3  # senders named in rejected_from

    def __init__(self, log: logging.Logger,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.clock = log, clock
        self.counts: Counter[str] = Counter()  # by reason
        self.by_sender: dict[str, Counter[str]] = {}  # sender -> reason -> count
        self._next_line: dict[str, float] = {}  # sender -> earliest time of its next log line
        self._unlogged: Counter[str] = Counter()  # sender -> refusals since its last line

    def refuse(self, sender: str, error: p.ProtocolError) -> None:
        sender = sender[:self.MAX_NAME]
        if sender not in self.by_sender and len(self.by_sender) >= self.MAX_SENDERS:
            sender = self.OTHER_SENDERS
        self.counts[error.reason] += 1
        self.by_sender.setdefault(sender, Counter())[error.reason] += 1
        now = self.clock()
        if now < self._next_line.get(sender, now):
            self._unlogged[sender] += 1
            return
        self._next_line[sender] = now + self.LOG_INTERVAL_S
        unlogged = self._unlogged.pop(sender, 0)
        self.log.warning("dropped message from %s: %s%s", sender, error,
                         f" (and {unlogged} more from it since its last line)" if unlogged
                         else "")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def figures(self) -> dict[str, int | str]:
        """Scalars for a status row: `rejected` (all), and once anything was refused
        `rejected_<reason>` for the most frequent reasons (`rejected_other_reasons` for the
        rest) and `rejected_from`, the senders refused most, e.g. "liar:12, 6b8b4567:3 (+2)"."""
        figures: dict[str, int | str] = {"rejected": self.total}
        reasons = self.counts.most_common()
        for reason, n in reasons[:self.FIGURE_REASONS]:
            figures[f"rejected_{reason.replace(' ', '_')}"] = n
        if len(reasons) > self.FIGURE_REASONS:
            figures["rejected_other_reasons"] = sum(n for _, n in reasons[self.FIGURE_REASONS:])
        if self.by_sender:
            senders = sorted(((sum(c.values()), name) for name, c in self.by_sender.items()),
                             reverse=True)
            named = ", ".join(f"{name[:24]}:{n}" for n, name in senders[:self.FIGURE_SENDERS])
            more = len(senders) - self.FIGURE_SENDERS
            figures["rejected_from"] = named + (f" (+{more})" if more > 0 else "")
        return figures


def send(sock: zmq.Socket, msg: p.Message, *, to: bytes | None = None,
         block: bool = True) -> bool:
    """Send a message (to a ROUTER peer when `to` is set); False if it could not be queued."""
    frames = p.encode(msg)
    if to is not None:
        frames = [to, *frames]
    # Zero-copy only pays for big frames (observation frames): pyzmq copies small ones anyway,
    # after building a Frame object for each, which costs more than the copy.
    copy = all(memoryview(f).nbytes < wiring.ZERO_COPY_FROM for f in frames)
    try:
        sock.send_multipart(frames, copy=copy, flags=0 if block else zmq.NOBLOCK)
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise
    return True


def recv(sock: zmq.Socket, rejects: RejectLog, *,
         routed: bool = False) -> tuple[bytes | None, p.Message | None]:
    """Receive one message without blocking; a refused one is counted and returned as None,
    as is none at all (poll's readable is a hint: with CURVE it can come before a message)."""
    try:
        frames = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
    except zmq.Again:
        return None, None
    sender: bytes | None = None
    if routed:
        sender = frames[0].bytes
        frames = frames[1:]
    try:
        return sender, p.decode(frames)
    except p.ProtocolError as exc:
        rejects.refuse(_sender_name(sender, sock, frames), exc)
        return sender, None


def serve(sock: zmq.Socket, rejects: RejectLog,
          handlers: dict[type, Callable[[bytes, Any, float], None]]) -> None:
    """Handle every queued message on a ROUTER socket by its kind; kinds this socket does not
    take are refused like any other bad input."""

    def one() -> None:
        sender, msg = recv(sock, rejects, routed=True)
        if msg is None or sender is None:
            return
        handler = handlers.get(type(msg))
        if handler is None:
            rejects.refuse(_sender_name(sender, sock),
                           p.ProtocolError("unexpected kind", msg.KIND.name))
        else:
            handler(sender, msg, time.monotonic())

    drain(sock, one)


def handle(sock: zmq.Socket, rejects: RejectLog, handlers: dict[type, Callable[[Any], None]],
           sender: str) -> None:
    """Receive one message on a non-ROUTER socket and hand it to the handler for its kind
    (`serve`'s counterpart); kinds this socket does not take are refused like bad input."""
    _, msg = recv(sock, rejects)
    if msg is None:
        return
    handler = handlers.get(type(msg))
    if handler is None:
        rejects.refuse(sender, p.ProtocolError("unexpected kind", msg.KIND.name))
    else:
        handler(msg)


def _sender_name(sender: bytes | None, sock: zmq.Socket, frames: Any = ()) -> str:
    """A ROUTER peer's routing id (its name, or hex when it set none); otherwise the TCP peer's
    address, which the peer cannot choose, or failing that (ipc) the endpoint."""
    if sender is not None:
        return sender.decode(errors="replace") if sender.isascii() else sender.hex()
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode(errors="replace")
    try:
        address = frames[-1].get("Peer-Address") if endpoint.startswith("tcp://") else ""
    except (AttributeError, IndexError, zmq.ZMQError):
        address = ""
    return f"{address} on {endpoint}" if address else f"peer of {endpoint}"


DRAIN_BUDGET_S = 0.05  # one drain may not keep a loop from its heartbeats longer than this


def drain(sock: zmq.Socket, handle: Callable[[], None], limit: int = 1000) -> None:
    """Handle up to `limit` queued messages from a socket that poll said is readable, for at
    most DRAIN_BUDGET_S: on a busy machine 1000 messages took long enough for the controller to
    take the silent process for dead; the rest waits for the next pass of the loop."""
    deadline = time.monotonic() + DRAIN_BUDGET_S
    for _ in range(limit):
        if not sock.poll(0, zmq.POLLIN) or time.monotonic() > deadline:
            return
        handle()


class ControllerLink:
    """A process's link to the controller: heartbeats (which register it), run state replies,
    and broadcasts. The heartbeat reply carries the run state, so a broadcast missed by a late
    subscriber is still learned within one heartbeat. It also carries where the run's sockets
    are bound (what binding processes declare as `binds`), so an empty `broadcast` is found
    that way, and so is any endpoint a process asks `discover` for."""

    def __init__(self, ctx: zmq.Context, *, role: str, name: str, controller: str,
                 broadcast: str, log: logging.Logger, binds: dict[str, str] | None = None
                 ) -> None:
        self.role, self.name, self.log = role, name, log
        self.controller, self.binds = controller, binds or {}
        self.dealer = wiring.socket(ctx, zmq.DEALER, connect=controller, sndhwm=10)
        self.sub = wiring.socket(ctx, zmq.SUB)
        if broadcast:
            self.sub.connect(broadcast)
        self.broadcast = broadcast
        self.rejects = RejectLog(log)
        self.state: p.RunState | None = None
        self.shutdown_reason = ""
        self._next_beat = 0.0
        self._figures: Callable[[], dict[str, Any]] = dict
        self.host, self.pid = pysocket.gethostname(), os.getpid()
        self.started = time.monotonic()  # the process's own uptime survives a controller restart

    def sockets(self) -> list[zmq.Socket]:
        return [self.dealer, self.sub]

    def beat(self, now: float, figures: Callable[[], dict[str, Any]] | None = None, *,
             leaving: bool = False) -> float:
        """Send a heartbeat if one is due; returns the time of the next one. `figures` is
        called only when a beat goes out (loops call this on every wake-up); without it, the
        last figures function given is used."""
        if figures is not None:
            self._figures = figures
        if now >= self._next_beat or leaving:
            figures = self._figures()
            if self.rejects.total:  # refused on this link: part of the process's count
                figures["rejected"] = figures.get("rejected", 0) + self.rejects.total
            figures["uptime_s"] = round(now - self.started, 1)
            send(self.dealer, p.Heartbeat(role=self.role, name=self.name, host=self.host,
                                          pid=self.pid, leaving=leaving, figures=figures,
                                          binds=self.binds), block=False)
            self._next_beat = now + HEARTBEAT_INTERVAL_S
        return self._next_beat

    def send(self, msg: p.Message) -> None:
        send(self.dealer, msg, block=False)

    def poll(self, events: dict[zmq.Socket, int]) -> list[p.Message]:
        """Messages from the controller that the owning loop must act on (barriers)."""
        out: list[p.Message] = []
        for sock in (self.dealer, self.sub):
            if sock not in events:
                continue
            for _ in range(100):
                if not sock.poll(0, zmq.POLLIN):
                    break
                _, msg = recv(sock, self.rejects)
                if isinstance(msg, p.RunState):
                    if self.state is None:
                        self.log.info("registered with controller (run %s)", msg.run_id)
                    self.state = msg
                    if not self.broadcast and self.advertised("broadcast"):
                        self.broadcast = self.advertised("broadcast")
                        self.sub.connect(self.broadcast)
                        self.log.info("broadcasts from %s (the controller says)",
                                      self.broadcast)
                    if msg.shutting_down:
                        self.shutdown_reason = self.shutdown_reason or "controller shutdown"
                elif isinstance(msg, p.Shutdown):
                    self.shutdown_reason = self.shutdown_reason or msg.reason
                elif msg is not None:
                    out.append(msg)
        return out

    def advertised(self, name: str) -> str:
        """Where the controller says endpoint `name` is bound ("" if it has not said), as
        reachable from here: a wildcard host is the host we reach the controller on."""
        address = self.state.endpoints.get(name, "") if self.state is not None else ""
        return wiring.reachable(address, via=self.controller)

    def discover(self, name: str, stop: StopFlag) -> str:
        """Wait (heartbeating) until the controller says where endpoint `name` is bound; ""
        if the process is told to stop first."""
        poller = zmq.Poller()
        for sock in self.sockets():
            poller.register(sock, zmq.POLLIN)
        started, said = time.monotonic(), False
        while not stop and not self.shutdown_reason:
            now = time.monotonic()
            next_beat = self.beat(now)
            self.poll(dict(poller.poll(max(0, min(next_beat - now, 0.25)) * 1000)))
            if address := self.advertised(name):
                self.log.info("%s endpoint %s (the controller says)", name, address)
                return address
            if not said and now - started > 3.0:
                said = True
                self.log.info("waiting for the controller at %s to say where the %s endpoint is "
                              "(the process that binds it registers there)", self.controller,
                              name)
        return ""

    def close(self) -> None:
        self.beat(time.monotonic(), leaving=True)
