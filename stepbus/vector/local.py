"""The relay (bus/relay.py) in the vector env's own process, on its thread: what `make` uses.

`make` starts the workers (and a controller) itself, so no other process needs to reach the
relay: it runs here, turned while the env waits for an answer. The env's RESET and STEP reach it
as calls and its answers come back as the objects it made, so a step crosses one socket each
way (env to worker and back) instead of two, and nothing is encoded twice. `connect` attaches
to a relay process (`stepbus broker --external`) for workers started elsewhere, through `Link`;
both give the env the same `send`/`recv`.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket as pysocket
import time

import zmq

from stepbus.bus import node, relay, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.topology import AnyPort, PortName, Role
from stepbus.vector.link import BrokerLost

LOG = logging.getLogger("stepbus.vector.relay")
CLIENT = b"in-process"  # the routing id the relay knows this env by


class InboxPorts(node.SocketPorts):
    """The relay's sockets, except that what it sends the vector client is kept in `inbox`."""

    def __init__(self, sockets: dict[str, zmq.Socket],
                 inbox: collections.deque[p.Message]) -> None:
        super().__init__(sockets)
        self.inbox = inbox

    def send(self, port: AnyPort, msg: p.Message, *, to: bytes | None = None,
             block: bool = False) -> bool:
        if port == PortName.VECTOR:
            self.inbox.append(msg)
            return True
        return super().send(port, msg, to=to, block=block)

    def writable(self, port: str) -> bool:
        return port == PortName.VECTOR or super().writable(port)


class LocalRelay:
    """A `Link` whose relay is in this process: `send` hands it a request, `recv` turns its
    loop (the workers' socket, its liveness timers) until it has an answer for the env.
    Nothing runs between calls: the time the caller spent elsewhere (a PPO update between
    steps) is the relay's stall, not its workers' silence, and what they sent meanwhile is read
    before the relay is asked anything. It does not register with the controller `make`
    started: nothing asks it there, and between calls it could not answer."""

    def __init__(self, steps: str) -> None:
        """`steps`: the endpoint to bind, which the workers were told."""
        self.name = f"vector-{pysocket.gethostname()}-{os.getpid()}"
        self.heard_at = time.monotonic()  # as a `Link`'s; this relay is never silent to us
        self.inbox: collections.deque[p.Message] = collections.deque()
        self.ctx = wiring.context(None)
        try:
            self.sockets = topology.open_role(self.ctx, Role.RELAY, {"steps": steps},
                                              skip=(PortName.VECTOR,))
        except BaseException:
            wiring.destroy(self.ctx)
            raise
        self.relay = relay.Relay(InboxPorts(self.sockets, self.inbox), LOG)
        self.relay.cancel("client_beat")  # we hear it by calling it
        self.relay.stall_log_level = logging.DEBUG  # the caller's own work between calls
        self.loop = node.Loop(self.relay, relay.relay_ports(self.sockets), None,
                              node.StopFlag(()))  # the caller's signals stay the caller's
        self.turned_at = time.monotonic()

    def send(self, msg: p.Message) -> None:
        """Hand the relay a request, once it has read what its workers sent meanwhile (idle
        workers' hellos, hours of them if the caller left the env alone that long: their queue
        must never fill, or a reply would find no room)."""
        self.catch_up()
        while node.readable(self.sockets[PortName.STEPS]):
            self.turn(0.0)
        self.relay.deliver(CLIENT, msg)

    def recv(self, timeout_s: float = math.inf) -> p.Message | None:
        """The relay's next message for the env other than a heartbeat; None after
        `timeout_s`.

        Raises:
            BrokerLost: the relay stopped (it has no reason to: a bug).
        """
        deadline = time.monotonic() + timeout_s
        self.catch_up()
        while True:
            while self.inbox:
                msg = self.inbox.popleft()
                if not isinstance(msg, p.Heartbeat):
                    self.heard_at = time.monotonic()
                    return msg
            wait_s = deadline - time.monotonic()
            if wait_s <= 0:
                return None
            self.turn(wait_s)

    def turn(self, wait_s: float) -> None:
        """One pass of the relay's loop, its poll at most `wait_s`."""
        if self.loop.stage is node.Stage.DONE:
            raise BrokerLost(f"the vector env's relay stopped ({self.relay.stop_reason})")
        timeout_ms = self.loop.prepare()  # at most node.MAX_POLL_MS
        if wait_s < timeout_ms / 1000:
            timeout_ms = math.ceil(wait_s * 1000)
        self.loop.advance(dict(self.loop.poller.poll(timeout_ms)), timeout_ms)
        self.turned_at = time.monotonic()

    def catch_up(self) -> None:
        """After time spent outside the relay, its workers' heartbeats wait unread: they get
        a new liveness allowance rather than being taken for lost."""
        now = time.monotonic()
        if now - self.turned_at > node.HEARTBEAT_INTERVAL_S:
            self.relay.on_stalled(now - self.turned_at)
            self.turned_at = now

    def close(self) -> None:
        try:
            for sock in self.sockets.values():
                sock.close(0)
        finally:
            wiring.destroy(self.ctx)
