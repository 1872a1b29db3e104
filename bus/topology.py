"""Every socket of every role, declared once: its port name, type, bind or connect, endpoint and
options. Processes, the CLI, the vector env, tests and benchmarks all build their sockets here,
so a socket's options cannot differ between two places that make "the same" socket, and a port
a role does not have is refused before anything is sent (`check_port`).

Endpoints are checked where they are parsed (`parse_endpoint`): scheme, host and port, or an
`ipc://` path that fits a Unix socket address, so a bad one is one line naming the flag or the
variable, and exit 2 (`exits.SettingError`).
"""

from __future__ import annotations

import enum
import ipaddress
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NewType

import zmq

from stepbus.bus import wiring
from stepbus.bus.exits import SettingError

# Socket options. LINGER is bounded everywhere so no process can hang in ctx.term().
LINGER_MS = 500
ZERO_COPY_FROM = 1 << 16  # bytes: smaller frames are sent by copy (pyzmq's own threshold)
MAX_MESSAGE_BYTES = 256 << 20  # bound sockets refuse a peer declaring a larger frame
HWM = 10_000
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 2_000  # reconnect backoff ceiling
# A TCP peer that vanished (its host down, the network cut) is found by the kernel's
# keepalive probes: after 1 s idle, one a second, 3 unanswered. Not by ZeroMQ's own heartbeats
# (ZMQ_HEARTBEAT_IVL): libzmq 4.3.5 aborts the whole process when a heartbeat timer fires on a
# connection whose input was stopped (a full receive queue, or a socket being closed) and whose
# peer then hung up (`!_io_error` in stream_engine_base.cpp): a broker shutting down while
# workers still send meets exactly that, and tests/test_wiring.py makes it happen.
TCP_KEEPALIVE_IDLE_S = 1
TCP_KEEPALIVE_INTERVAL_S = 1
TCP_KEEPALIVE_PROBES = 3
# Keepalives probe only an idle connection. One with data unacknowledged (a worker's hellos to a
# broker whose host vanished or was cut off by the network) is left to retransmission, which
# backs off for about 15 minutes (tcp_retries2) before the kernel gives up: until then ZeroMQ
# neither drops the connection nor reconnects, and once the network heals the next
# retransmission may be tens of seconds away. TCP_USER_TIMEOUT (ZMQ_TCP_MAXRT) ends a connection
# whose data has gone unacknowledged this long, and ZeroMQ reconnects. 5 s: over 3x the 1.5 s
# liveness bound, so the application has declared the peer lost first, and far beyond what 2%
# loss on a 100 ms round trip delays an acknowledgement. The kernel (5.x and later; checked on
# 6.18) also ends a connection whose peer has advertised a zero window that long, so it is set
# only where the reader never holds data back on purpose (steps and control: a peer's ZeroMQ I/O
# thread reads them whatever the process does, short of a SIGSTOP), never on the experience
# path, where an assembler whose intake is paused, or a learner in a long update, hold back by
# design and must keep their connections however long that lasts.
DEAD_PEER_MS = 5_000
# A connect that the network leaves unanswered is given up after this long and made again after
# the reconnect interval, instead of waiting out the kernel's SYN retransmissions (1, 2, 4, ...
# s apart, 127 s in all): a link comes back within about 1 + 2 s of a partition healing. A link
# whose round trip is longer than this cannot connect.
CONNECT_TIMEOUT_MS = 1_000
IPC_PATH_MAX = 107  # bytes: sockaddr_un's sun_path, less its terminating NUL
SCHEMES = ("tcp", "ipc", "inproc")


class PortName(str, enum.Enum):
    """What a process calls a socket it sends or receives on."""

    ROUTER = "router"  # the controller's, facing every process's link and the CLI
    PUB = "pub"  # the controller's broadcasts
    CONTROLLER = "controller"  # a process's DEALER to the controller
    BROADCAST = "broadcast"  # a process's SUB to the controller's broadcasts
    STEPS = "steps"  # broker/relay ROUTER facing workers; a worker's DEALER to it
    POLICY = "policy"  # broker ROUTER facing learners; a learner's DEALER to it
    EXPERIENCE = "experience"  # broker PUSH to the assembler; the assembler's PULL
    TRAJECTORIES = "trajectories"  # the default policy's: assembler PUSH, learner PULL
    RECEIPTS = "receipts"  # learner PUSH to the assembler; the assembler's PULL
    VECTOR = "vector"  # relay ROUTER facing a vector env client; the client's DEALER
    EVALUATION = "evaluation"  # evaluator ROUTER facing learners; a learner's DEALER to it

    def __str__(self) -> str:
        return self.value


# A policy's trajectories port on the assembler besides the default one (`outlet_port`).
OutletPort = NewType("OutletPort", str)
AnyPort = PortName | OutletPort
OUTLET_PREFIX = "trajectories:"


def outlet_port(policy: str, default: str) -> PortName | OutletPort:
    """The assembler's PUSH port for `policy` (`default`: the default policy's name)."""
    return PortName.TRAJECTORIES if policy == default else OutletPort(OUTLET_PREFIX + policy)


class Role(str, enum.Enum):
    CONTROLLER = "controller"
    BROKER = "broker"
    RELAY = "relay"  # `stepbus broker --external`, between workers and a vector env client
    WORKER = "worker"
    ASSEMBLER = "assembler"
    LEARNER = "learner"
    EVALUATOR = "evaluator"  # plays a policy version's greedy episodes, beside the training path
    LINK = "link"  # every process's link to the controller (and the trainer slot's only one)
    CLIENT = "client"  # the CLI's commands, the vector env's discovery
    VECTOR_CLIENT = "vector-client"  # stepbus.vector's DEALER to the relay


@dataclass(frozen=True)
class SocketSpec:
    """One socket of a role. `endpoint` names an entry of `wiring.ENDPOINTS`; bound sockets
    are CURVE servers and connecting ones CURVE clients when the run has keys."""

    port: PortName
    kind: int
    bind: bool
    endpoint: str
    sndhwm: int = HWM
    rcvhwm: int = HWM
    # Queue outgoing messages only on completed connections, so a socket with no live peer is
    # not writable (a NOBLOCK send fails) instead of queueing into the void.
    immediate: bool = False
    router_mandatory: bool = False  # a departed peer is an error, not a silent drop
    # The largest frame a peer may declare to a bound socket: libzmq allocates a declared frame
    # before its bytes arrive, so one that carries no arrays can be bound much lower.
    max_message_bytes: int = MAX_MESSAGE_BYTES
    named: bool = False  # the socket's identity is the process's name (a worker's DEALER)
    # TCP_USER_TIMEOUT of DEAD_PEER_MS: only where the reader never holds data back on purpose.
    dead_peer_timeout: bool = False


_LINK = (SocketSpec(PortName.CONTROLLER, zmq.DEALER, False, "controller", sndhwm=10,
                    dead_peer_timeout=True),
         SocketSpec(PortName.BROADCAST, zmq.SUB, False, "broadcast", dead_peer_timeout=True))

ROLES: dict[Role, tuple[SocketSpec, ...]] = {
    # Control messages carry no arrays: a peer may not make the controller hold more for it.
    Role.CONTROLLER: (SocketSpec(PortName.ROUTER, zmq.ROUTER, True, "controller",
                                 max_message_bytes=1 << 20, dead_peer_timeout=True),
                      SocketSpec(PortName.PUB, zmq.PUB, True, "broadcast",
                                 dead_peer_timeout=True)),
    Role.BROKER: (SocketSpec(PortName.STEPS, zmq.ROUTER, True, "steps", router_mandatory=True,
                             dead_peer_timeout=True),
                  SocketSpec(PortName.POLICY, zmq.ROUTER, True, "policy"),
                  # No assembler: not writable, so dispatch holds instead of queueing; a short
                  # queue, so an assembler that stops taking experience in soon stops stepping.
                  SocketSpec(PortName.EXPERIENCE, zmq.PUSH, False, "experience",
                             immediate=True, sndhwm=1000)),
    Role.RELAY: (SocketSpec(PortName.STEPS, zmq.ROUTER, True, "steps", router_mandatory=True,
                            dead_peer_timeout=True),
                 SocketSpec(PortName.VECTOR, zmq.ROUTER, True, "vector")),
    # While no broker is connected, hellos are dropped rather than queued to flood it later.
    Role.WORKER: (SocketSpec(PortName.STEPS, zmq.DEALER, False, "steps", immediate=True,
                             named=True, dead_peer_timeout=True),),
    # A short intake queue, so a paused intake soon pauses the broker; beyond 64 queued,
    # trajectories wait in the outlet's `held` (counted).
    Role.ASSEMBLER: (SocketSpec(PortName.EXPERIENCE, zmq.PULL, True, "experience",
                                rcvhwm=1000),
                     SocketSpec(PortName.TRAJECTORIES, zmq.PUSH, True, "trajectories",
                                sndhwm=64),
                     SocketSpec(PortName.RECEIPTS, zmq.PULL, True, "receipts",
                                max_message_bytes=16 << 20)),
    # Weights are only worth sending fresh; what a killed learner had queued is sent again.
    Role.LEARNER: (SocketSpec(PortName.POLICY, zmq.DEALER, False, "policy", sndhwm=4),
                   SocketSpec(PortName.TRAJECTORIES, zmq.PULL, False, "trajectories",
                              rcvhwm=64),
                   SocketSpec(PortName.RECEIPTS, zmq.PUSH, False, "receipts", immediate=True),
                   # Weights for an evaluator, if one listens: none connected or its short
                   # queue full, a send fails at once and the version goes unevaluated.
                   SocketSpec(PortName.EVALUATION, zmq.DEALER, False, "evaluation",
                              immediate=True, sndhwm=2, rcvhwm=16)),
    # A learner's newest weights only: older ones queued behind them are of no use.
    Role.EVALUATOR: (SocketSpec(PortName.EVALUATION, zmq.ROUTER, True, "evaluation",
                                rcvhwm=4),),
    Role.LINK: _LINK,
    Role.CLIENT: (SocketSpec(PortName.CONTROLLER, zmq.DEALER, False, "controller",
                             dead_peer_timeout=True),),
    Role.VECTOR_CLIENT: (SocketSpec(PortName.VECTOR, zmq.DEALER, False, "vector"),),
}
# Ports a role sends on through its controller link as well as its own.
LINKED = {Role.BROKER, Role.RELAY, Role.WORKER, Role.ASSEMBLER, Role.LEARNER, Role.EVALUATOR,
          Role.LINK}


def ports_of(role: Role) -> frozenset[str]:
    """Every port name a process of `role` may send on."""
    names = {spec.port.value for spec in ROLES[role]}
    if role in LINKED:
        names |= {spec.port.value for spec in _LINK}
    return frozenset(names)


def check_port(role: Role, port: str) -> None:
    """ValueError for a port `role` does not have (a misspelt name fails here, in-process
    tests included, not only on real sockets)."""
    if port in ports_of(role) or (role is Role.ASSEMBLER and port.startswith(OUTLET_PREFIX)):
        return
    raise ValueError(f"the {role.value} has no port {str(port)!r}; it has "
                     f"{', '.join(sorted(ports_of(role)))}")


def spec_of(role: Role, port: PortName) -> SocketSpec:
    for spec in ROLES[role]:
        if spec.port is port:
            return spec
    raise ValueError(f"the {role.value} has no socket {port.value!r}")


def endpoints_of(config: object) -> dict[str, str]:
    """The endpoints a process's Config names, by ENDPOINTS name (its fields of those names)."""
    return {name: getattr(config, name) for name in wiring.ENDPOINTS if hasattr(config, name)}


def open_role(ctx: zmq.Context, role: Role, endpoints: Mapping[str, str], *,
              name: str = "", skip: tuple[PortName, ...] = ()) -> dict[str, zmq.Socket]:
    """The sockets of `role`, bound or connected to `endpoints` (by ENDPOINTS name; an empty
    one leaves a connecting socket unconnected, for discovery). All or none: a socket that
    fails closes the ones made before it."""
    made: dict[str, zmq.Socket] = {}  # by PortName, a str
    try:
        for spec in ROLES[role]:
            if spec.port not in skip:
                made[spec.port] = open_spec(ctx, spec, endpoints.get(spec.endpoint, ""),
                                            name=name)
    except BaseException:
        for sock in made.values():
            sock.close(0)
        raise
    return made


def open_spec(ctx: zmq.Context, spec: SocketSpec, endpoint: str, *,
              name: str = "") -> zmq.Socket:
    """One declared socket on `endpoint`."""
    if spec.bind and not endpoint:
        raise SettingError(f"the {spec.port.value} socket has no endpoint to bind")
    sock = socket(ctx, spec.kind, bind=endpoint if spec.bind else None,
                  connect=endpoint if not spec.bind and endpoint else None,
                  identity=name.encode() if spec.named and name else None,
                  immediate=spec.immediate, max_message_bytes=spec.max_message_bytes,
                  sndhwm=spec.sndhwm, rcvhwm=spec.rcvhwm,
                  dead_peer_ms=DEAD_PEER_MS if spec.dead_peer_timeout else 0)
    if spec.router_mandatory:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def open_outlet(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """The assembler's PUSH for one more policy: the default outlet's options elsewhere."""
    return open_spec(ctx, spec_of(Role.ASSEMBLER, PortName.TRAJECTORIES), endpoint)


def socket(ctx: zmq.Context, kind: int, *, bind: str | None = None, connect: str | None = None,
           identity: bytes | None = None, immediate: bool = False,
           max_message_bytes: int = MAX_MESSAGE_BYTES, sndhwm: int = HWM,
           rcvhwm: int = HWM, dead_peer_ms: int = 0) -> zmq.Socket:
    """One socket with the project's options; at most one of bind/connect (neither: connect
    later). sndhwm, rcvhwm are set here because libzmq reads them when a connection's queue is
    made, which may be at bind/connect time. `dead_peer_ms`: TCP_USER_TIMEOUT (0: none)."""
    sock = ctx.socket(kind)
    for option, value in ((zmq.LINGER, LINGER_MS), (zmq.SNDHWM, sndhwm), (zmq.RCVHWM, rcvhwm),
                          (zmq.RECONNECT_IVL, RECONNECT_IVL_MS),
                          (zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS),
                          (zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS),
                          (zmq.TCP_MAXRT, dead_peer_ms),
                          # TCP links only; ipc peers' deaths close the socket
                          (zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S),
                          (zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTERVAL_S),
                          (zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_PROBES)):
        sock.setsockopt(option, value)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer with the same name is served
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        wiring.secure(ctx, sock, bind)
        if bind is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            sock.setsockopt(zmq.ZAP_DOMAIN, wiring.ZAP_DOMAIN)  # see wiring
            _bind(sock, bind)
        elif connect is not None:
            sock.connect(connect)
    except BaseException:
        sock.close(0)
        raise
    return sock


def _bind(sock: zmq.Socket, endpoint: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise SettingError(f"cannot bind {endpoint}: {exc}") from None


def stand_in(kind: int, endpoint: str | None = None, *, bind: bool = False,
             ctx: zmq.Context | None = None) -> zmq.Socket:
    """A socket with none of the project's options, for a test or tool standing in for a peer
    (a stranger, a hostile one, a trainer played by hand): LINGER 0, SUB subscribed to all."""
    sock: zmq.Socket = (ctx or zmq.Context.instance()).socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if endpoint is not None:
        (sock.bind if bind else sock.connect)(endpoint)
    return sock


# ----------------------------------------------------------------------------- endpoints


def parse_endpoint(text: str, *, allow_empty: bool = False) -> str:
    """`text` if it is an endpoint ZeroMQ can bind or connect; ValueError saying why not."""
    if not text:
        if allow_empty:
            return text
        raise ValueError("an endpoint is needed, e.g. tcp://127.0.0.1:7340 or ipc:///tmp/x")
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise ValueError(f"{text!r} is not an endpoint: it needs a scheme, e.g. "
                         f"tcp://{text}" if ":" in text else
                         f"{text!r} is not an endpoint: expected tcp://HOST:PORT, ipc://PATH "
                         f"or inproc://NAME")
    if scheme not in SCHEMES:
        raise ValueError(f"{text!r}: unknown scheme {scheme!r} (tcp, ipc or inproc)")
    if scheme == "tcp":
        _check_tcp(text, rest)
    elif scheme == "ipc":
        if not rest or len(os.fsencode(rest)) > IPC_PATH_MAX:
            raise ValueError(f"{text!r}: an ipc path must be 1 to {IPC_PATH_MAX} bytes long")
    elif not rest:
        raise ValueError(f"{text!r}: an inproc endpoint needs a name")
    return text


def _check_tcp(text: str, rest: str) -> None:
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r}: expected tcp://HOST:PORT")
    if port != "*" and not (port.isdigit() and 0 <= int(port) <= 65535):
        raise ValueError(f"{text!r}: the port must be 0 to 65535 or *, not {port!r}")
    host = host.split(";")[-1]  # "iface;host": ZeroMQ's source address for connect
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"{text!r}: an IPv6 host needs its closing ]")
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{text!r}: {host} is not an IPv6 address") from None
    elif not all(c.isalnum() or c in "-._*" for c in host):
        raise ValueError(f"{text!r}: {host!r} is not a host name or address")
    urllib.parse.urlsplit(text)  # what wiring.reachable reads later must parse too


def checked_endpoint(text: str, source: str, *, allow_empty: bool = False) -> str:
    """`parse_endpoint` for a value from `source` (a flag or variable): SettingError naming
    it."""
    try:
        return parse_endpoint(text, allow_empty=allow_empty)
    except ValueError as exc:
        raise SettingError(f"{source}: {exc}") from None
