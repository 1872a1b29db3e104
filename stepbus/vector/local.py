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
from collections.abc import Callable

import zmq

from stepbus.bus import lane, node, relay, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.topology import AnyPort, PortName, Role
from stepbus.vector.link import BrokerLost

LOG = logging.getLogger("stepbus.vector.relay")
CLIENT = b"in-process"  # the routing id the relay knows this env by
LANES_ONLY_S = 0.02  # the relay's whole loop (timers, liveness, hellos) turns this often
LANE_KINDS = (p.StepResult, p.EnvCallResult, p.RemoteError)  # what a worker answers


class InboxPorts(node.SocketPorts):
    """The relay's sockets, except that what it sends the vector client is kept in `inbox`,
    and what it asks a worker with a lane goes down that lane."""

    def __init__(self, sockets: dict[str, zmq.Socket],
                 inbox: collections.deque[p.Message]) -> None:
        super().__init__(sockets)
        self.inbox = inbox
        self.lane_of: Callable[[bytes], lane.Lane | None] = lambda peer: None

    def send(self, port: AnyPort, msg: p.Message, *, to: bytes | None = None,
             block: bool = False) -> bool:
        if port == PortName.VECTOR:
            self.inbox.append(msg)
            return True
        its_lane = self.lane_of(to) if to is not None and port == PortName.STEPS else None
        if its_lane is None:
            return super().send(port, msg, to=to, block=block)
        try:
            its_lane.send(msg)
        except lane.LaneError:
            return False
        return True

    def writable(self, port: str) -> bool:
        return port == PortName.VECTOR or super().writable(port)


class LocalRelay:
    """A `Link` whose relay is in this process: `send` hands it a request, `recv` turns its
    loop (the workers' socket, its liveness timers) until it has an answer for the env.
    Nothing runs between calls: the time the caller spent elsewhere (a PPO update between
    steps) is the relay's stall, not its workers' silence, and what they sent meanwhile is read
    before the relay is asked anything. It does not register with the controller `make`
    started: nothing asks it there, and between calls it could not answer."""

    def __init__(self, steps: str, lanes: dict[str, lane.Lane] | None = None) -> None:
        """`steps`: the endpoint to bind, which the workers were told; `lanes`: by worker
        name, those of the workers that have one (`stepbus/vector/launch.py` made them)."""
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
        ports = InboxPorts(self.sockets, self.inbox)
        self.relay = relay.Relay(ports, LOG)
        self.lanes = dict(lanes or {})
        self.relay.answered_elsewhere = self.lanes  # a lane ended is one no longer
        ports.lane_of = self.lane_of
        self.relay.cancel("client_beat")  # we hear it by calling it
        self.relay.stall_log_level = logging.DEBUG  # the caller's own work between calls
        self.loop = node.Loop(self.relay, relay.relay_ports(self.sockets), None,
                              node.StopFlag(()))  # the caller's signals stay the caller's
        for each in self.lanes.values():
            self.loop.poller.register(each.read_fd, zmq.POLLIN)
        self.lane_fds = {each.read_fd for each in self.lanes.values()}
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
        """One pass of the relay's loop, its poll at most `wait_s`; between full passes, at
        most LANES_ONLY_S apart, a wait that only lanes end reads them and nothing else."""
        left = self.turned_at + LANES_ONLY_S - time.monotonic()
        if self.lanes and left > 0:
            timeout_ms = max(0, math.ceil(min(wait_s, left) * 1000))  # never -1: for ever
            events = dict(self.loop.poller.poll(timeout_ms))
            if not events or self.lane_fds.issuperset(events):
                self.read_lanes()
                return
        self.full_turn(wait_s)

    def full_turn(self, wait_s: float) -> None:
        if self.loop.stage is node.Stage.DONE:
            raise BrokerLost(f"the vector env's relay stopped ({self.relay.stop_reason})")
        timeout_ms = self.loop.prepare()  # at most node.MAX_POLL_MS
        if wait_s < timeout_ms / 1000:
            timeout_ms = math.ceil(wait_s * 1000)
        self.loop.advance(dict(self.loop.poller.poll(timeout_ms)), timeout_ms)
        self.read_lanes()
        self.turned_at = time.monotonic()

    def lane_of(self, peer: bytes) -> lane.Lane | None:
        w = self.relay.table.get(peer)
        return None if w is None else self.lanes.get(w.name)

    def read_lanes(self) -> None:
        """The workers' answers that came down their lanes, to the relay as from their
        sockets; a lane whose worker's process ended loses that worker at once."""
        for name, each in list(self.lanes.items()):
            w = self.relay.by_name(name)
            try:
                if w is not None:
                    lane.deliver_all(each, self.relay, w.ident, LANE_KINDS, f"the lane of {name}")
                else:  # an answer to a worker forgotten since: nobody waits for it
                    for _ in each.receive():
                        self.relay.counts.stale_dropped += 1
            except lane.LaneError as exc:
                each.ended = True
                LOG.warning("worker %s: %s", name, exc)
            if each.ended:
                self.loop.poller.unregister(each.read_fd)
                self.lane_fds.discard(each.read_fd)
                del self.lanes[name]
                if w is not None:
                    self.relay.forget(w, "ended (its lane closed)")

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
            wiring.destroy(self.ctx)  # the lanes are `make`'s, which closes them
