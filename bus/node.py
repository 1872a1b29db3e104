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
    """Counts refused input by reason; logs the first of each (reason, sender) only, so a
    hostile or broken peer cannot flood the log. The counts show in `stepbus status`."""

    MAX_REMEMBERED = 10_000  # (reason, sender) pairs; a spoofing flood cannot grow memory

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.counts: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()

    def refuse(self, sender: str, error: p.ProtocolError) -> None:
        self.counts[error.reason] += 1
        key = (error.reason, sender)
        if key not in self._logged and len(self._logged) < self.MAX_REMEMBERED:
            self._logged.add(key)
            self.log.warning("dropped message from %s: %s (further ones from it are only "
                             "counted)", sender, error)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def send(sock: zmq.Socket, msg: p.Message, *, to: bytes | None = None,
         block: bool = True) -> bool:
    """Send a message (to a ROUTER peer when `to` is set); False if it could not be queued."""
    frames = p.encode(msg)
    if to is not None:
        frames = [to, *frames]
    try:
        sock.send_multipart(frames, copy=False, flags=0 if block else zmq.NOBLOCK)
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise
    return True


def recv(sock: zmq.Socket, rejects: RejectLog, *,
         routed: bool = False) -> tuple[bytes | None, p.Message | None]:
    """Receive one message without blocking; a refused one is counted and returned as None."""
    frames = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
    sender: bytes | None = None
    if routed:
        sender = frames[0].bytes
        frames = frames[1:]
    try:
        return sender, p.decode(frames)
    except p.ProtocolError as exc:
        rejects.refuse(_sender_name(sender, sock), exc)
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


def _sender_name(sender: bytes | None, sock: zmq.Socket) -> str:
    if sender is None:
        return f"peer of {sock.getsockopt(zmq.LAST_ENDPOINT).decode(errors='replace')}"
    return sender.decode(errors="replace") if sender.isascii() else sender.hex()


def drain(sock: zmq.Socket, handle: Callable[[], None], limit: int = 1000) -> None:
    """Handle up to `limit` queued messages from a socket that poll said is readable."""
    for _ in range(limit):
        if not sock.poll(0, zmq.POLLIN):
            return
        handle()


class ControllerLink:
    """A process's link to the controller: heartbeats (which register it), run state replies,
    and broadcasts. The heartbeat reply carries the run state, so a broadcast missed by a late
    subscriber is still learned within one heartbeat."""

    def __init__(self, ctx: zmq.Context, *, role: str, name: str, controller: str,
                 broadcast: str, log: logging.Logger) -> None:
        self.role, self.name, self.log = role, name, log
        self.dealer = wiring.socket(ctx, zmq.DEALER, connect=controller)
        self.dealer.setsockopt(zmq.SNDHWM, 10)
        self.sub = wiring.socket(ctx, zmq.SUB, connect=broadcast)
        self.rejects = RejectLog(log)
        self.state: p.RunState | None = None
        self.shutdown_reason = ""
        self._next_beat = 0.0
        self._figures: Callable[[], dict[str, Any]] = dict
        self.host, self.pid = pysocket.gethostname(), os.getpid()

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
            send(self.dealer, p.Heartbeat(role=self.role, name=self.name, host=self.host,
                                          pid=self.pid, leaving=leaving,
                                          figures=self._figures()), block=False)
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
                    if msg.shutting_down:
                        self.shutdown_reason = self.shutdown_reason or "controller shutdown"
                elif isinstance(msg, p.Shutdown):
                    self.shutdown_reason = self.shutdown_reason or msg.reason
                elif msg is not None:
                    out.append(msg)
        return out

    def close(self) -> None:
        self.beat(time.monotonic(), leaving=True)
