"""What every stepbus process shares: the `Process` base class and the one `Loop` that runs
it, quiet signal handling, the controller link, and the accounting of untrusted input."""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import math
import os
import signal
import socket as pysocket
import stat
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar, overload

import zmq

from stepbus import early_signals
from stepbus.bus import protocol as p
from stepbus.bus import topology, wiring
from stepbus.bus.topology import AnyPort, PortName, Role

HEARTBEAT_INTERVAL_S = 0.5
LIVENESS_INTERVALS = 3  # a peer silent for this many heartbeat intervals is dead
LIVENESS_S = HEARTBEAT_INTERVAL_S * LIVENESS_INTERVALS
# While a process waits to learn where an endpoint is bound, it asks this often: each heartbeat
# brings the controller's current run state, and the process that binds the endpoint may
# register a moment after this one (a honcho start), which at the heartbeat interval cost 0.5 s.
# Only for the first seconds: a binding process that is down (backing off, another host not up
# yet) must not have every waiting process ask the controller 20 times a second.
DISCOVER_INTERVAL_S = 0.05
DISCOVER_QUICK_FOR_S = 3.0
MAX_POLL_MS = 200  # upper bound on any poll, so a stop signal is seen within it
# libzmq's socket monitor event: a 16-bit event id and a 32-bit value, then the endpoint. Read
# here rather than with pyzmq's zmq.utils.monitor, whose import of asyncio and ssl costs every
# process 30 ms at start.
MONITOR_EVENT = struct.Struct("=Hi")
STALLED_S = 1.0  # a loop pass this late (past the poll's timeout) means the process stalled
# On a thread shared with other loops (the serial runner) every other role's turn is a stall:
# a long one (a PPO update) must not make a peer look silent, so stalls count from this, and
# are no news worth a warning.
STALLED_SHARED_S = 0.2


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
        if early_signals.EARLY_SIGNALS:  # arrived while the process was still importing
            self.reason = signal.Signals(early_signals.EARLY_SIGNALS[0]).name

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
    FIGURE_NAME = 40  # characters of each: "10.0.0.5 on tcp://10.0.0.1:7344" fits

    def __init__(self, log: logging.Logger,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.clock = log, clock
        self.counts: Counter[str] = Counter()  # by reason
        self.by_sender: dict[str, Counter[str]] = {}  # sender -> reason -> count
        self._next_line: dict[str, float] = {}  # sender -> earliest time of its next log line
        self._unlogged: Counter[str] = Counter()  # sender -> refusals since its last line

    def refuse(self, sender: str, error: p.ProtocolError, *, claims: str = "") -> None:
        """Count and maybe log a refusal. `sender` is the transport's name for the peer (a
        ROUTER routing id, a TCP peer address), never a name the message gives: that one may
        come as `claims`, which only the log line shows ("claims to be ...")."""
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
        claim = claims[:self.MAX_NAME]
        self.log.warning("dropped message from %s%s: %s%s", sender,
                         f" (claims to be {claim!r})" if claim and claim != sender else "",
                         error, f" (and {unlogged} more from it since its last line)"
                         if unlogged else "")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def figures(self) -> dict[str, int | str]:
        """Scalars for a status row: `rejected` (all), and once anything was refused
        `rejected_<reason>` for the most frequent reasons (`rejected_other_reasons` for the
        rest) and `rejected_from`, the senders refused most as the transport names them, e.g.
        "liar:12, 006b8b4567:3, 10.0.0.9 on tcp://10.0.0.5:7344:1 (+2)"."""
        figures: dict[str, int | str] = {"rejected": self.total}
        reasons = self.counts.most_common()
        for reason, n in reasons[:self.FIGURE_REASONS]:
            figures[f"rejected_{reason.replace(' ', '_')}"] = n
        if len(reasons) > self.FIGURE_REASONS:
            figures["rejected_other_reasons"] = sum(n for _, n in reasons[self.FIGURE_REASONS:])
        if self.by_sender:
            senders = sorted(((sum(c.values()), name) for name, c in self.by_sender.items()),
                             reverse=True)
            named = ", ".join(f"{name[:self.FIGURE_NAME]}:{n}"
                              for n, name in senders[:self.FIGURE_SENDERS])
            more = len(senders) - self.FIGURE_SENDERS
            figures["rejected_from"] = named + (f" (+{more})" if more > 0 else "")
        return figures


# Plain ints: cheap to combine and compare, where pyzmq's flag enums are Python-level objects.
_SNDMORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)
_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)


def send(sock: zmq.Socket, msg: p.Message, *, to: bytes | None = None,
         block: bool = False) -> bool:
    """Send a message (to a ROUTER peer when `to` is set); False if it could not be queued.
    Blocking only when asked: a connection whose handshake is refused may leave no pipe to
    queue on, and a blocking send then waits without bound."""
    frames = p.encode(msg)
    if to is not None:
        frames = [to, *frames]
    # Zero-copy only pays for big frames (observation frames): pyzmq copies small ones anyway,
    # after building a Frame object for each, which costs more than the copy.
    copy = all(memoryview(f).nbytes < topology.ZERO_COPY_FROM for f in frames)
    flags = 0 if block else _NOBLOCK
    try:
        # send_multipart's loop without its checks of each frame (ours are all buffers) and
        # its flag enums' arithmetic: a third of the CPU a small message's send took.
        for frame in frames[:-1]:
            sock.send(frame, flags | _SNDMORE, copy=copy)
        sock.send(frames[-1], flags, copy=copy)
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
    peer, msg, _ = recv_from(sock, rejects, routed=routed)
    return peer, msg


def recv_from(sock: zmq.Socket, rejects: RejectLog, *, routed: bool = False
              ) -> tuple[bytes | None, p.Message | None, Sender]:
    """`recv`, and who sent the message as the transport names it."""
    try:
        frames = recv_frames(sock)
    except zmq.Again:
        return None, None, Sender()
    peer: bytes | None = None
    if routed:
        peer = frames[0].bytes
        frames = frames[1:]
    sender = Sender(peer or b"", sock, frames[-1] if frames else None)
    try:
        return peer, p.decode(frames), sender
    except p.ProtocolError as exc:
        rejects.refuse(str(sender), exc)
        return peer, None, sender


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """One multipart message without blocking (zmq.Again: none), as recv_multipart gives it
    but asking each frame whether more follow rather than the socket (an option lookup through
    pyzmq's enums for every frame)."""
    frames = [sock.recv(_NOBLOCK, copy=False)]
    while frames[-1].more:  # the rest of a message comes with its first part: never Again
        frames.append(sock.recv(_NOBLOCK, copy=False))
    return frames


class Sender:
    """Who sent the message in hand, as the transport names it: a ROUTER peer's routing id
    (its name, or hex when it set none); otherwise the TCP peer's address, which the peer
    cannot choose, or failing that (ipc) the endpoint. Worked out only when a refusal asks
    (`str`), so taking a message in costs nothing more."""

    __slots__ = ("frame", "peer", "socket")

    def __init__(self, peer: bytes = b"", socket: zmq.Socket | None = None,
                 frame: Any = None) -> None:
        self.peer, self.socket, self.frame = peer, socket, frame

    def __str__(self) -> str:
        if self.peer:
            return peer_name(self.peer)
        if self.socket is None:
            return UNNAMED_SENDER
        last = self.socket.getsockopt(zmq.LAST_ENDPOINT)
        endpoint = last.decode(errors="replace") if isinstance(last, bytes) else str(last)
        try:
            address = (self.frame.get("Peer-Address") if endpoint.startswith("tcp://")
                       and self.frame is not None else "")
        except (AttributeError, zmq.ZMQError):
            address = ""
        return f"{address} on {endpoint}" if address else f"peer of {endpoint}"


UNNAMED_SENDER = "(sender unknown)"  # a refusal outside any message's handling


DRAIN_BUDGET_S = 0.05  # one drain may not keep a loop from its heartbeats longer than this


def drain(sock: zmq.Socket, handle: Callable[[], None], limit: int = 1000,
          until: Callable[[], bool] | None = None) -> None:
    """Handle up to `limit` queued messages from a socket that poll said is readable, for at
    most DRAIN_BUDGET_S: on a busy machine 1000 messages took long enough for the controller to
    take the silent process for dead; the rest waits for the next pass of the loop. `until`
    ends the drain early once it says so (the handler has no room for more)."""
    deadline = time.monotonic() + DRAIN_BUDGET_S
    for _ in range(limit):  # the first message is taken on poll's word, unasked again
        if until is not None and until():
            return
        handle()
        if not readable(sock) or time.monotonic() > deadline:
            return


def readable(sock: zmq.Socket) -> bool:
    """Whether a message waits on `sock`: what a zero-timeout poll tells (ZMQ_EVENTS), without
    the poller `Socket.poll` builds on every call."""
    return bool(events_of(sock) & _POLLIN)


def events_of(sock: zmq.Socket) -> int:
    """The socket's ZMQ_EVENTS: POLLIN set when a message waits, POLLOUT when one can go."""
    return sock.getsockopt(_EVENTS)  # type: ignore[return-value]


# A supervised process's pipe to its supervisor (bus/supervisor.py): the environment variable
# that names its write end, and the byte a process writes once, past its start-up.
BEAT_FD_ENV = "STEPBUS_BEAT_FD"
STARTED = b"!"


class SupervisorBeat:
    """A process's side of its supervisor's watch: a byte on a pipe every heartbeat interval,
    written by its loop and by whatever else heartbeats for it (a worker's long env call, a
    learner's long update), so the supervisor can kill a process that froze; and a broken pipe
    when the supervisor is gone."""

    def __init__(self, fd: int | None = None) -> None:
        """`fd` None: not supervised (a bare `stepbus broker`, a test, the serial runner)."""
        self.fd = fd
        self.gone = False
        self._next = 0.0
        self._byte = b"."  # STARTED once `started` is called, until it is written
        self._lock = threading.Lock()  # the loop's thread and a `beating_through` thread
        if self.fd is not None:
            try:
                os.set_blocking(self.fd, False)
                os.set_inheritable(self.fd, False)  # ours, not a child's
            except OSError:
                self.fd = None  # not started by a supervisor after all

    @classmethod
    def from_env(cls) -> SupervisorBeat:
        """The pipe BEAT_FD_ENV names, taken out of the environment so that no process this
        one starts writes to whatever that number is in it; only a pipe is taken."""
        fd = os.environ.pop(BEAT_FD_ENV, "")
        if not fd.isdigit():
            return cls()
        try:
            is_pipe = stat.S_ISFIFO(os.fstat(int(fd)).st_mode)
        except OSError:
            is_pipe = False
        return cls(int(fd) if is_pipe else None)

    def started(self, now: float) -> None:
        """Past the start-up: settings, model and checkpoint taken (the trainer slot proves a
        swap by it); said with the next beat, which is now."""
        self._byte, self._next = STARTED, 0.0
        self.beat(now)

    def beat(self, now: float) -> None:
        if self.fd is None or now < self._next:
            return
        with self._lock:
            self._next = now + HEARTBEAT_INTERVAL_S
            try:
                os.write(self.fd, self._byte)
                self._byte = b"."
            except BlockingIOError:
                pass  # the supervisor has not read the last ones yet: it is alive
            except OSError:
                self.gone = True


@functools.cache
def supervisor_beat() -> SupervisorBeat:
    """This OS process's beat to its supervisor: one pipe, whichever loops and links run in it."""
    return SupervisorBeat.from_env()


@contextlib.contextmanager
def beating_through() -> Iterator[None]:
    """Around one long call a process makes on purpose (building a model from the spaces,
    resuming or writing a checkpoint): its supervisor goes on hearing it, from a thread, for
    as long as the call takes. A frozen process's threads all stop, so a freeze is still seen;
    a call that holds the GIL throughout is not beaten through."""
    beat = supervisor_beat()
    if beat.fd is None:
        yield
        return
    done = threading.Event()

    def beat_until_done() -> None:
        while not done.wait(HEARTBEAT_INTERVAL_S / 2):
            beat.beat(time.monotonic())

    thread = threading.Thread(target=beat_until_done, name="supervisor-beats", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


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
        sockets = topology.open_role(ctx, Role.LINK, {"controller": controller,
                                                       "broadcast": broadcast})
        self.dealer, self.sub = sockets[PortName.CONTROLLER], sockets[PortName.BROADCAST]
        self.broadcast = broadcast
        self.rejects = RejectLog(log)
        self.state: p.RunState | None = None
        self.shutdown_reason = ""
        self._last_beat = -math.inf
        self._figures: Callable[[], dict[str, Any]] = dict
        self.host, self.pid = pysocket.gethostname(), os.getpid()
        self.started = time.monotonic()  # the process's own uptime survives a controller restart

    def sockets(self) -> list[zmq.Socket]:
        return [self.dealer, self.sub]

    def beat(self, now: float, figures: Callable[[], dict[str, Any]] | None = None, *,
             leaving: bool = False, interval: float = HEARTBEAT_INTERVAL_S) -> float:
        """Send a heartbeat if one is due; returns the time of the next one, `interval` on.
        `figures` is called only when a beat goes out (loops call this on every wake-up);
        without it, the last figures function given is used. The supervisor hears a beat too:
        every heartbeat outside the loop (a long env call, a long update) comes through here."""
        supervisor_beat().beat(now)
        if figures is not None:
            self._figures = figures
        if now >= self._last_beat + interval or leaving:
            sent = self._figures()
            if self.rejects.total:  # refused on this link: part of the process's count
                sent["rejected"] = sent.get("rejected", 0) + self.rejects.total
            sent["uptime_s"] = round(now - self.started, 1)
            if self.state is not None:  # so a restarted controller carries the run on
                sent["run_id"] = self.state.run_id
            send(self.dealer, p.Heartbeat(role=self.role, name=self.name, host=self.host,
                                          pid=self.pid, leaving=leaving, figures=sent,
                                          binds=self.binds), block=False)
            self._last_beat = now
        return self._last_beat + interval

    def send(self, msg: p.Message) -> None:
        send(self.dealer, msg, block=False)

    def poll(self, events: dict[zmq.Socket, int], *, everything: bool = False
             ) -> list[p.Message]:
        """Messages from the controller that the owning loop must act on (barriers); with
        `everything`, the run state and shutdown too (a `Process` keeps its own copy)."""
        out: list[p.Message] = []
        for sock in (self.dealer, self.sub):
            if sock not in events:
                continue
            for _ in range(100):
                if not readable(sock):
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
                    if everything:
                        out.append(msg)
                elif isinstance(msg, p.Shutdown):
                    self.shutdown_reason = self.shutdown_reason or msg.reason
                    if everything:
                        out.append(msg)
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
            quick = now - started < DISCOVER_QUICK_FOR_S
            next_beat = self.beat(now, interval=DISCOVER_INTERVAL_S if quick
                                  else HEARTBEAT_INTERVAL_S)
            self.poll(dict(poller.poll(math.ceil(max(0.0, min(next_beat - now, 0.25)) * 1000))))
            if address := self.advertised(name):
                self.log.info("%s endpoint %s (the controller says)", name, address)
                return address
            if not said and now - started > DISCOVER_QUICK_FOR_S:
                said = True
                self.log.info("waiting for the controller at %s to say where the %s endpoint is "
                              "(the process that binds it registers there)", self.controller,
                              name)
        return ""

    def close(self) -> None:
        """The leaving beat, and the broadcasts' socket closed at once: it has nothing to
        send, yet when the controller had just exited it held the context's end for the whole
        linger (0.5 s in half of the honcho runs measured, for the last process to leave)."""
        self.beat(time.monotonic(), leaving=True)
        self.sub.close(linger=0)


# ----------------------------------------------------------------------------- process objects
#
# A process is a `Process` subclass: its state in typed fields, one `on_<kind>` method per
# message kind it receives, named timers, and sends through `Ports`. `Loop` runs one on real
# sockets; an in-process test runs one on an `Outbox` and feeds it decoded messages.


M = TypeVar("M", bound=p.Message)


@dataclass(frozen=True)
class Sent(Generic[M]):
    """One message a process sent: the port it went out on, and the ROUTER peer it went to."""

    port: str
    msg: M
    to: bytes | None = None


class Ports(Protocol):
    """Where a process's sends go, by port name: sockets in a real process, an outbox in a
    test."""

    def send(self, port: AnyPort, msg: p.Message, *, to: bytes | None = None,
             block: bool = False) -> bool: ...

    def writable(self, port: str) -> bool: ...


class Outbox:
    """Ports that record instead of sending, so a test reads back what a process sent. A port
    in `blocked` takes nothing (sends return False) and is not writable, like a full queue. A
    port the process's role does not have (`topology.ROLES`) is refused with ValueError, as a
    real process would fail on it: the `Process` tells the outbox its role."""

    def __init__(self, blocked: set[str] | None = None) -> None:
        self.sent: list[Sent[p.Message]] = []
        self.blocked: set[str] = blocked if blocked is not None else set()
        self.role: Role | None = None

    def attach(self, role: Role) -> None:
        self.role = role

    def send(self, port: AnyPort, msg: p.Message, *, to: bytes | None = None,
             block: bool = False) -> bool:
        if self.role is not None:
            topology.check_port(self.role, port)
        if port in self.blocked:
            return False
        self.sent.append(Sent(port, msg, to))
        return True

    def writable(self, port: str) -> bool:
        return port not in self.blocked

    def take(self, kind: type[M] | None = None, port: str | None = None) -> list[M]:
        """The messages sent (of `kind`, on `port`) since the last take; they leave the box."""
        taken = [s for s in self.sent if (kind is None or isinstance(s.msg, kind))
                 and (port is None or s.port == port)]
        self.sent = [s for s in self.sent if not _among(s, taken)]
        return [s.msg for s in taken]  # type: ignore[misc]

    @overload
    def take_sent(self, kind: type[M]) -> list[Sent[M]]: ...

    @overload
    def take_sent(self, kind: None = None) -> list[Sent[p.Message]]: ...

    def take_sent(self, kind: type[M] | None = None
                  ) -> list[Sent[M]] | list[Sent[p.Message]]:
        """Like `take`, with each message's port and peer."""
        taken = [s for s in self.sent if kind is None or isinstance(s.msg, kind)]
        self.sent = [s for s in self.sent if not _among(s, taken)]
        return taken


def _among(sent: Sent[p.Message], taken: list[Sent[p.Message]]) -> bool:
    """By identity: messages that hold arrays cannot be compared with `==`."""
    return any(sent is t for t in taken)


@dataclass
class Port:
    """A socket a process receives on: the kinds it takes there (anything else is refused as
    bad input), and whether its first frame names the peer (ROUTER)."""

    socket: zmq.Socket
    kinds: tuple[type, ...] = ()
    routed: bool = False
    monitor: bool = False  # a socket monitor: events for `Process.on_socket_event`


class SocketPorts:
    def __init__(self, sockets: dict[str, zmq.Socket]) -> None:
        self.sockets = sockets

    def send(self, port: AnyPort, msg: p.Message, *, to: bytes | None = None,
             block: bool = False) -> bool:
        return send(self.sockets[port], msg, to=to, block=block)

    def writable(self, port: str) -> bool:
        return bool(events_of(self.sockets[port]) & _POLLOUT)


@dataclass
class Timer:
    """A named deadline: `action(now)` runs once it is due, then again every `interval_s`
    (0: once)."""

    name: str
    due: float
    action: Callable[[float], None]
    interval_s: float = 0.0


class Process:
    """State and handlers of one stepbus process, free of sockets: `Loop` delivers decoded
    messages to `on_<kind>(peer, msg)` (`peer` is the ROUTER identity, b"" elsewhere), runs due
    timers and `tick` after every poll, and sends `figures()` in each heartbeat. A handler
    refuses what it cannot use with `refuse`, which names the sender as the transport does."""

    role: ClassVar[str] = ""
    sockets: ClassVar[Role] = Role.LINK  # its sockets, as `topology.ROLES` declares them

    def __init__(self, ports: Ports, log: logging.Logger, *, name: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ports, self.log, self.clock = ports, log, clock
        if isinstance(ports, Outbox):
            ports.attach(self.sockets)
        self.name = name or self.role
        self.rejects = RejectLog(log, clock)
        self.sender: Sender | str = UNNAMED_SENDER  # of the message being handled
        self.run_state: p.RunState | None = None  # the controller's latest word
        self.stop_reason = ""  # set: the loop ends, and `finish` does the shutdown duties
        self.timers: dict[str, Timer] = {}
        self.started = self.now = clock()
        # Ports whose room for another message should wake the loop (a consumer that was full
        # or gone): the loop polls them for it while they are in this set.
        self.wake_on_writable: set[str] = set()
        # File descriptors (not sockets) whose input should wake the loop, e.g. a child
        # process's pipe: the loop polls them while they are in this set.
        self.wake_on_readable_fds: set[int] = set()
        # Set: the process that takes this one's place on the same loop and sockets (a
        # learner, once its setup heard what it learns for).
        self.successor: Process | None = None
        self.exit_code = 0  # what the loop returns once the process stops
        self.stall_log_level = logging.WARNING  # of the line saying the process stalled

    # -- sending and refusing
    def send(self, port: AnyPort, msg: p.Message, *, to: bytes | None = None,
             block: bool = False) -> bool:
        return self.ports.send(port, msg, to=to, block=block)

    def refuse(self, reason: str, detail: str = "", *, claims: str = "") -> None:
        """Refuse the message being handled, counted against its sender as the transport
        names it (`deliver` keeps it), never a name the message chose: the message's own
        say of who sent it goes in `claims`, which only the log line shows."""
        self.rejects.refuse(str(self.sender), p.ProtocolError(reason, detail), claims=claims)

    # -- timers
    def every(self, name: str, interval_s: float, action: Callable[[float], None],
              first_due: float | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"timer {name!r}: interval {interval_s!r} s must be > 0")
        due = self.now + interval_s if first_due is None else first_due
        self.timers[name] = Timer(name, due, action, interval_s)

    def at(self, name: str, due: float, action: Callable[[float], None]) -> None:
        self.timers[name] = Timer(name, due, action)

    def cancel(self, name: str) -> None:
        self.timers.pop(name, None)

    def run_timers(self, now: float) -> float:
        """Run the due timers; the time the next one is due (inf: none)."""
        for timer in [t for t in self.timers.values() if t.due <= now]:
            if self.timers.get(timer.name) is not timer:
                continue  # cancelled or replaced by an action earlier in this pass
            if timer.interval_s:
                timer.due = max(timer.due + timer.interval_s, now)
            else:
                del self.timers[timer.name]
            timer.action(now)
        return min((t.due for t in self.timers.values()), default=math.inf)

    # -- messages
    def deliver(self, peer: bytes, msg: p.Message, now: float | None = None, *,
                sender: Sender | str = "") -> None:
        """Hand one decoded message to its `on_<kind>` method (a test calls this directly).
        `sender`: who sent it as the transport names it, for refusals (default: the ROUTER
        identity `peer`)."""
        self.now = self.clock() if now is None else now
        handling, self.sender = self.sender, sender or Sender(peer)
        try:
            handler = getattr(self, "on_" + msg.KIND.name.lower(), None)
            if handler is None:
                self.refuse("unexpected kind", msg.KIND.name)
                return
            handler(peer, msg)
        finally:
            self.sender = handling  # a message handled inside another's handler: back to it

    def on_run_state(self, peer: bytes, msg: p.RunState) -> None:
        self.run_state = msg  # the link has logged the registration
        if msg.shutting_down:
            self.stop("controller shutdown")

    def on_barrier(self, peer: bytes, msg: p.Barrier) -> None:
        """Every subscriber hears the broadcast; only the broker acts on it."""

    def on_shutdown(self, peer: bytes, msg: p.Shutdown) -> None:
        self.stop(msg.reason)

    def stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason

    def on_signal(self, reason: str) -> None:
        """SIGINT/SIGTERM (`reason` names it): stop. A process with duties that need the loop
        (children to see off, peers to tell) overrides this and stops once they are done."""
        self.stop(reason)

    # -- hooks the loop calls
    def on_stalled(self, seconds: float) -> None:
        """The loop did not run for `seconds` past its poll (SIGSTOP, or starved of CPU): a
        process judging peers by their silence must not blame them for its own."""

    def tick(self, now: float) -> float:
        """Timekeeping after every poll (purge, dispatch); when to look again, a time on this
        process's clock (0.0: at once; inf: at the next message or timer)."""
        return math.inf

    def figures(self) -> dict[str, Any]:
        return self.rejects.figures()

    def holds(self, port: str) -> bool:
        """Whether messages queued on `port` are to wait there for now (backpressure: no room
        for them yet): the loop neither reads nor polls a held port."""
        return False

    def on_socket_event(self, port: str, event: int) -> None:
        """An event (zmq.EVENT_*) from the socket monitor on `port` (a `Port(monitor=True)`)."""

    def on_peer_done(self, role: str) -> None:
        """A process of `role` running on the same thread (the serial runner) has finished
        its shutdown duties: what a socket event says across processes, where inproc:// gives
        none."""

    def drain_on_stop(self) -> tuple[str, float]:
        """A port to empty before `finish`, and for at most how long ("": none)."""
        return "", 0.0

    def on_drained(self) -> tuple[str, float]:
        """The `drain_on_stop` port is empty (or its time is up): make the last sends. Returns
        a port whose replies to them to serve before `finish`, while `awaiting()`, and for at
        most how long ("": none); `tick` runs before each wait for them."""
        return "", 0.0

    def awaiting(self) -> bool:
        """Whether replies on the `on_drained` port are still awaited."""
        return False

    def finish(self) -> None:
        """Shutdown duties (flush, checkpoint), after the loop ends."""


def peer_name(peer: bytes) -> str:
    """A ROUTER identity as a log line can show it: text when it is ASCII, else hex."""
    return peer.decode(errors="replace") if peer.isascii() else peer.hex()


# What the controller link may bring: anything else on it is refused, never dispatched.
LINK_KINDS = (p.RunState, p.Shutdown, p.Barrier, p.Reply, p.TrainerSwap)


@dataclass
class Opened:
    """A process on its sockets, ready to run: what each role's `open_*` gives, for its own
    OS process (`run_role`) or the serial runner (`stepbus run`)."""

    process: Process
    ports: dict[str, Port]
    link: ControllerLink | None
    cleanup: Callable[[], None] = lambda: None  # before the context goes (socket monitors)

    def loop(self, stop: StopFlag, poller: zmq.Poller | None = None) -> Loop:
        return Loop(self.process, self.ports, self.link, stop, poller=poller)


def run_role(opener: Callable[[zmq.Context], Opened | list[Opened] | None],
             security: wiring.Security, stop: StopFlag) -> int:
    """One role in its own OS process: its context, its sockets, its loop (or the loops of
    several processes on its thread: a split worker's), its exit code. An opener that returns
    None was told to stop while setting up: exit 0."""
    ctx = wiring.context(security)
    try:
        opened = opener(ctx)
        if opened is None:
            return 0
        group = opened if isinstance(opened, list) else [opened]
        try:
            if len(group) == 1:
                return group[0].loop(stop).run()
            poller = zmq.Poller()
            return serve([o.loop(stop, poller) for o in group], poller)
        finally:
            for o in group:
                o.cleanup()
    finally:
        wiring.destroy(ctx, topology.LINGER_MS)


def serve(loops: list[Loop], poller: zmq.Poller) -> int:
    """Turn every loop over one poller until each is done; the worst exit code among them.
    Loops still running when one raises say goodbye to the controller all the same."""
    active = list(loops)
    try:
        while active:
            timeouts = [loop.prepare() for loop in active]
            events = dict(poller.poll(min(timeouts)))
            for loop, timeout_ms in zip(active, timeouts, strict=True):
                loop.advance(events, timeout_ms)
            for done in [loop for loop in active if loop.stage is Stage.DONE]:
                active.remove(done)
                for loop in active:
                    loop.process.on_peer_done(done.process.role)
    finally:
        for loop in active:
            loop.close()
    return max(loop.process.exit_code for loop in loops)


class Stage(enum.Enum):
    """Where a loop is in its process's life."""

    RUNNING = "running"
    DRAINING = "draining"  # stopped: emptying the `drain_on_stop` port
    AWAITING = "awaiting"  # the last sends made: serving replies to them (`on_drained`)
    DONE = "done"  # `finish` ran, the controller link said goodbye


STAGE_POLL_MS = 50  # how often a stopping process looks again while it awaits replies


class Loop:
    """The one loop every process runs on: poll until the next deadline (timer, heartbeat, the
    process's own), decode, dispatch by kind, drain in time-bounded passes, heartbeat through
    the controller link, stop on a signal or the process's word, then its shutdown duties.

    A turn is `prepare` (the poll's timeout) and `advance` (what the poll found), so one
    process runs them on its own poller (`run`) and the serial runner runs several processes'
    turns over one shared poller, each seeing only its own sockets' events."""

    def __init__(self, process: Process, ports: dict[str, Port], link: ControllerLink | None,
                 stop: StopFlag, *, poller: zmq.Poller | None = None) -> None:
        """`link` None: no heartbeats and no controller messages (the controller itself).
        `poller`: one shared with other loops (the serial runner)."""
        self.process, self.ports, self.link, self.stop = process, ports, link, stop
        self.poller = poller if poller is not None else zmq.Poller()
        for sock in link.sockets() if link is not None else []:
            self.poller.register(sock, zmq.POLLIN)
        self.watch_out: set[str] = set()  # ports polled for POLLOUT (see `watch_writable`)
        self.held: set[str] = set()  # ports not polled for input (see `Process.holds`)
        for name in ports:
            self.register(name)
        self.watch_fds: set[int] = set()  # the process's `wake_on_readable_fds`, as polled
        self.signalled = False  # the process was told of a signal
        self.shared = poller is not None  # one thread for several loops: see `cpu_time`
        if self.shared:
            process.stall_log_level = logging.DEBUG
        self.own_cpu, self.entered_cpu = 0.0, 0.0  # CPU of this loop's turns; at this one's start
        self.last_mark, self.last_cpu = process.clock(), self.cpu_time()  # see `mark_time`
        self.look_again = math.inf  # the process's own next deadline (`tick`)
        self.stage = Stage.RUNNING
        self.stage_port, self.stage_deadline = "", 0.0  # draining or awaiting: where, until
        self.closed = link is None

    def run(self) -> int:
        """The process on its own poller until it is done; its exit code."""
        try:
            while self.stage is not Stage.DONE:
                timeout_ms = self.prepare()
                self.advance(dict(self.poller.poll(timeout_ms)), timeout_ms)
            return self.process.exit_code
        finally:
            self.close()

    def close(self) -> None:
        """Say goodbye to the controller (once), so it need not wait for our silence."""
        if not self.closed and self.link is not None:
            self.closed = True
            self.link.close()

    def cpu_time(self) -> float:
        """CPU seconds this loop's process used: the OS process's, or on a shared thread the
        sum of this loop's turns (`prepare` and `advance` count theirs)."""
        if not self.shared:
            return time.process_time()
        return self.own_cpu + (time.process_time() - self.entered_cpu if self.entered_cpu
                               else 0.0)

    @contextlib.contextmanager
    def own_turn(self) -> Iterator[None]:
        """On a shared thread, the CPU used inside counts as this loop's (`cpu_time`)."""
        if not self.shared:
            yield
            return
        self.entered_cpu = time.process_time()
        try:
            yield
        finally:
            self.own_cpu += time.process_time() - self.entered_cpu
            self.entered_cpu = 0.0

    def prepare(self) -> int:
        """Heartbeat and due timers; how long the next poll may wait (ms)."""
        with self.own_turn():
            return self.prepare_turn()

    def prepare_turn(self) -> int:
        supervisor_beat().beat(time.monotonic())  # in every stage: a drain is not a freeze
        if self.stage is not Stage.RUNNING:
            return 0 if self.stage is Stage.DRAINING else STAGE_POLL_MS
        if self.hand_over_signal():
            self.begin_stop()
            return 0
        proc = self.process
        now = self.mark_time(0.0)
        next_beat = self.link.beat(now, proc.figures) if self.link else math.inf
        deadline = min(next_beat, self.look_again, proc.run_timers(now))
        self.sync_fds()
        return int(max(0.0, min((deadline - now) * 1000, MAX_POLL_MS)))

    def advance(self, events: dict[Any, int], timeout_ms: int) -> None:
        """Act on what the poll found (`events` may hold other loops' sockets too)."""
        with self.own_turn():
            self.advance_turn(events, timeout_ms)

    def advance_turn(self, events: dict[Any, int], timeout_ms: int) -> None:
        if self.stage is Stage.RUNNING:
            self.turn(events, timeout_ms)
        elif self.stage is Stage.DRAINING:
            self.drain_remaining()
        elif self.stage is Stage.AWAITING:
            self.await_replies(events)

    def turn(self, events: dict[Any, int], timeout_ms: int) -> None:
        proc = self.process
        self.mark_time(timeout_ms / 1000)
        self.hand_over_signal()  # one that came during the poll, before the process looks
        self.pass_once(events)
        if proc.successor is not None:
            self.process, proc.successor = proc.successor, None
            self.process.stall_log_level = proc.stall_log_level
            proc = self.process
        self.look_again = proc.tick(self.mark_time(0.0))
        for name in self.watch_out ^ proc.wake_on_writable:
            self.watch_writable(name, name in proc.wake_on_writable)
        self.sync_held()

    # -- stopping
    def begin_stop(self) -> None:
        """The loop ends: nothing is polled but the port the shutdown duties need."""
        self.process.stop(self.stop.reason)
        for sock in [*(port.socket for port in self.ports.values()),
                     *(self.link.sockets() if self.link is not None else [])]:
            self.poller.register(sock, 0)  # 0: unregistered
        for fd in self.watch_fds:
            self.poller.unregister(fd)
        self.watch_fds = set()
        name, budget_s = self.process.drain_on_stop()
        if name:
            self.enter(Stage.DRAINING, name, budget_s)
        else:
            self.drained()

    def enter(self, stage: Stage, port: str, budget_s: float) -> None:
        self.stage, self.stage_port = stage, port
        self.stage_deadline = time.monotonic() + budget_s
        self.poller.register(self.ports[port].socket, zmq.POLLIN)

    def drain_remaining(self) -> None:
        """What is queued on the drain port now, within its time."""
        port = self.ports[self.stage_port]
        while time.monotonic() < self.stage_deadline and port.socket.poll(0, zmq.POLLIN):
            self.take_one(port)
        self.poller.register(port.socket, 0)
        self.drained()

    def drained(self) -> None:
        name, budget_s = self.process.on_drained()
        if name and self.process.awaiting():
            self.enter(Stage.AWAITING, name, budget_s)
        else:
            self.done()

    def await_replies(self, events: dict[Any, int]) -> None:
        proc, port = self.process, self.ports[self.stage_port]
        if proc.awaiting() and time.monotonic() < self.stage_deadline:
            proc.tick(proc.clock())
            if port.socket in events:
                drain(port.socket, functools.partial(self.take_one, port))
        if not proc.awaiting() or time.monotonic() >= self.stage_deadline:
            self.poller.register(port.socket, 0)
            self.done()

    def done(self) -> None:
        self.process.finish()
        self.stage = Stage.DONE
        self.close()

    def watch_writable(self, port: str, on: bool) -> None:
        """Wake when `port` can take a message again (a full or absent consumer)."""
        if on != (port in self.watch_out):
            self.watch_out.symmetric_difference_update({port})
            self.register(port)

    def sync_held(self) -> None:
        """Poll a port the process holds no longer for input (its queue would wake the loop in
        vain), and again once it is released."""
        held = {name for name, port in self.ports.items()
                if port.kinds and self.process.holds(name)}
        for name in held ^ self.held:
            self.held.symmetric_difference_update({name})
            self.register(name)

    def register(self, name: str) -> None:
        port = self.ports[name]
        wants_input = (port.kinds or port.monitor) and name not in self.held
        flags = (zmq.POLLIN if wants_input else 0) | (
            zmq.POLLOUT if name in self.watch_out else 0)
        self.poller.register(port.socket, flags)  # 0: unregistered

    def mark_time(self, allowed_s: float) -> float:
        """The time now; tells the process if more than `allowed_s` (a poll's timeout) plus
        STALLED_S passed since the last mark without it using the CPU: it was stopped or
        starved, not its peers. Time it spent working (slow inference, say) is not a stall, or
        a slow process would never find a peer dead. On a shared thread (the serial runner)
        only the CPU of this loop's own turns is its work: time the others took is a stall."""
        now, cpu = self.process.clock(), self.cpu_time()
        late = now - self.last_mark - allowed_s - (cpu - self.last_cpu)
        self.last_mark, self.last_cpu = now, cpu
        if late > (STALLED_SHARED_S if self.shared else STALLED_S):
            self.process.now = now
            self.process.on_stalled(late)
        return now

    def hand_over_signal(self) -> bool:
        """Tell the process of a signal (once); whether the loop is to end."""
        if self.stop and not self.signalled:
            self.signalled = True
            self.process.now = self.process.clock()
            self.process.on_signal(self.stop.reason)
        return bool(self.process.stop_reason)

    def sync_fds(self) -> None:
        """Poll exactly the file descriptors the process names now (a closed one never)."""
        wanted = self.process.wake_on_readable_fds
        for fd in self.watch_fds - wanted:
            self.poller.unregister(fd)
        for fd in wanted - self.watch_fds:
            self.poller.register(fd, zmq.POLLIN)
        self.watch_fds = set(wanted)

    def pass_once(self, events: dict[zmq.Socket, int]) -> None:
        if self.link is not None:
            controller = f"controller {self.link.controller}"  # what the link connects to
            for msg in self.link.poll(events, everything=True):
                if isinstance(msg, LINK_KINDS):
                    self.process.deliver(b"", msg, sender=controller)
                else:
                    self.link.rejects.refuse(controller, p.ProtocolError(
                        "unexpected kind", msg.KIND.name))
        for name, port in self.ports.items():
            if port.socket not in events or self.process.holds(name):
                continue
            if port.monitor:
                drain(port.socket, functools.partial(self.take_event, name, port))
            elif port.kinds:
                drain(port.socket, functools.partial(self.take_one, port),
                      until=functools.partial(self.process.holds, name))

    def take_event(self, name: str, port: Port) -> None:
        try:
            frames = port.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        self.process.on_socket_event(name, MONITOR_EVENT.unpack_from(frames[0])[0])

    def take_one(self, port: Port) -> None:
        peer, msg, sender = recv_from(port.socket, self.process.rejects, routed=port.routed)
        if msg is None:
            return
        if not isinstance(msg, port.kinds):
            self.process.rejects.refuse(str(sender), p.ProtocolError("unexpected kind",
                                                                     msg.KIND.name))
            return
        self.process.deliver(peer or b"", msg, sender=sender)
