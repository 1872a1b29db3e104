"""Where every socket lives: endpoints, their environment variables, socket types and options.

Long-lived processes bind (controller, broker, assembler); processes that come and go connect
(workers, trainer, the CLI). Every endpoint has one flag and one `STEPBUS_*` variable (honcho
reads `.env`), defaulting to loopback so nothing listens on a network unless told to.
"""

from __future__ import annotations

import os
import socket as pysocket
from dataclasses import dataclass, field
from typing import Any

import zmq


@dataclass(frozen=True)
class EndpointSpec:
    name: str
    env_var: str
    default: str
    help: str

    def resolve(self) -> str:
        return os.environ.get(self.env_var) or self.default


ENDPOINTS: dict[str, EndpointSpec] = {
    spec.name: spec
    for spec in (
        EndpointSpec("controller", "STEPBUS_CONTROLLER", "tcp://127.0.0.1:7340",
                     "controller ROUTER: heartbeats and commands"),
        EndpointSpec("broadcast", "STEPBUS_BROADCAST", "tcp://127.0.0.1:7341",
                     "controller PUB: barrier and shutdown broadcasts"),
        EndpointSpec("steps", "STEPBUS_STEPS", "tcp://127.0.0.1:7342",
                     "broker ROUTER facing worker DEALERs"),
        EndpointSpec("policy", "STEPBUS_POLICY", "tcp://127.0.0.1:7343",
                     "broker ROUTER receiving trainer weights"),
        EndpointSpec("experience", "STEPBUS_EXPERIENCE", "tcp://127.0.0.1:7344",
                     "assembler PULL receiving experience from the broker"),
        EndpointSpec("trajectories", "STEPBUS_TRAJECTORIES", "tcp://127.0.0.1:7345",
                     "assembler PUSH sending trajectories to the trainer"),
        EndpointSpec("receipts", "STEPBUS_RECEIPTS", "tcp://127.0.0.1:7346",
                     "assembler PULL receiving the trainer's receipts for trajectories"),
    )
}

def endpoint(name: str, help: str) -> Any:
    """A Config field for endpoint `name`: its default comes from STEPBUS_* at construction."""
    return field(default_factory=ENDPOINTS[name].resolve, metadata={"help": help})


def free_tcp_ports(n: int) -> list[int]:
    """n ports free on loopback right now (for tests and benchmarks)."""
    socks = [pysocket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# Socket options. LINGER is bounded everywhere so no process can hang in ctx.term().
LINGER_MS = 500
MAX_MESSAGE_BYTES = 256 << 20  # bound sockets refuse a peer declaring a larger frame
HWM = 10_000
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 2_000  # reconnect backoff ceiling
TCP_HEARTBEAT_IVL_MS = 1_000
TCP_HEARTBEAT_TIMEOUT_MS = 3_000
# With a ZAP domain set libzmq refuses ZMTP 1.0 and 2.0 peers, whose framing any TCP client
# can produce without a handshake, so raw bytes never become messages. ZMTP 3.0 peers still
# pass (no ZAP handler runs): they are ZeroMQ peers, and the decoder refuses what they send.
ZAP_DOMAIN = b"stepbus"


def socket(ctx: zmq.Context, kind: int, *, bind: str | None = None, connect: str | None = None,
           identity: bytes | None = None, immediate: bool = False,
           max_message_bytes: int = MAX_MESSAGE_BYTES, sndhwm: int = HWM,
           rcvhwm: int = HWM) -> zmq.Socket:
    """One socket with the project's options; exactly one of bind/connect.

    immediate: queue outgoing messages only on completed connections, so a socket with no
    live peer is not writable (and a send with NOBLOCK fails) instead of queueing into the void.
    max_message_bytes: the largest frame a peer may declare to a bound socket; libzmq
    allocates a declared frame before its bytes arrive, so one that carries no arrays (the
    controller's) can be bound much lower than the default.
    sndhwm, rcvhwm: messages queued per peer; set here because libzmq reads them when a
    connection's queue is made, which may be at bind/connect time.
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.HEARTBEAT_IVL, TCP_HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, TCP_HEARTBEAT_TIMEOUT_MS)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer with the same name is served
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise SystemExit(f"cannot bind {bind}: {exc}") from None
    elif connect is not None:
        sock.connect(connect)
    return sock
