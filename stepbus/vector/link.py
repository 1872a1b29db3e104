"""A vector env's end of the bus: one DEALER to the relaying broker's "vector" endpoint, the
errors a vector env raises, and finding that endpoint through the controller.

Nothing here waits without a bound: the relay sends a HEARTBEAT every half second, so a
broker that died, froze or restarted (another pid) is noticed as `BrokerLost` within
`silence_s`, and a worker the relay lost comes as WORKER_LOST, raised as `WorkerLost`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket as pysocket
import time
from typing import Protocol

from stepbus.bus import node, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.topology import PortName, Role

LOG = logging.getLogger("stepbus.vector")
# A relay silent this long is gone: its liveness timeout for workers, twice over, plus margin.
BROKER_SILENCE_S = 2 * node.LIVENESS_S + 1.0


class BusError(RuntimeError):
    """The bus failed a vector env's call: raised by reset, step, recv and the attribute
    calls, never a hang. The env keeps its sockets: `close()` works, and `reset()` attaches
    again (waiting for workers to cover every env id), so a run can go on after one."""


class WorkerLost(BusError):
    """A worker stopped answering (killed, frozen past the liveness timeout) or restarted: its
    envs' episodes are gone. `worker` names it."""

    def __init__(self, worker: str, reason: str) -> None:
        super().__init__(f"worker {worker} lost: {reason}")
        self.worker, self.reason = worker, reason


class BrokerLost(BusError):
    """The broker went silent (killed, frozen) or restarted (another process answers)."""


class EnvLink(Protocol):
    """What a vector env needs of its way to the relay: a `Link` to a relay process, or a
    relay in its own process (`stepbus.vector.local.LocalRelay`)."""

    name: str
    heard_at: float

    def send(self, msg: p.Message) -> None: ...

    def recv(self, timeout_s: float = math.inf) -> p.Message | None: ...

    def close(self) -> None: ...


class Link:
    """The DEALER to the relay, and what it heard of the relay's liveness."""

    def __init__(self, endpoint: str, security: wiring.Security | None = None,
                 silence_s: float = BROKER_SILENCE_S) -> None:
        self.endpoint, self.silence_s = endpoint, silence_s
        self.ctx = wiring.context(security)
        self.dealer = topology.open_role(self.ctx, Role.VECTOR_CLIENT, {"vector": endpoint})[
            PortName.VECTOR]
        self.name = f"vector-{pysocket.gethostname()}-{os.getpid()}"
        self.broker_pid = 0  # the relay's pid as its heartbeats say (0: not heard yet)
        self.heard_at = time.monotonic()
        self.rejects = node.RejectLog(LOG)

    def send(self, msg: p.Message) -> None:
        node.send(self.dealer, msg, block=False)

    def recv(self, timeout_s: float = math.inf) -> p.Message | None:
        """The next message other than a heartbeat, None after `timeout_s`.

        Raises:
            BrokerLost: the relay was silent for `silence_s`, or another one answers.
        """
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            now = time.monotonic()
            # Silence counts only while we wait: time the caller spent elsewhere (a PPO
            # update between steps) left the relay's heartbeats queued, unread, not missing.
            silent_until = max(self.heard_at, started) + self.silence_s
            if now > silent_until:
                silent_s = now - max(self.heard_at, started)
                raise BrokerLost(f"the broker at {self.endpoint} has been silent for "
                                 f"{silent_s:.1f}s (killed, frozen or gone)")
            wait = min(deadline, silent_until) - now
            if wait <= 0:
                return None
            if not self.dealer.poll(max(1, math.ceil(min(wait, 0.2) * 1000))):
                continue
            _, msg = node.recv(self.dealer, self.rejects)
            if msg is None:
                continue
            self.heard_at = time.monotonic()
            if isinstance(msg, p.Heartbeat):
                self.check_pid(msg.pid)
                continue
            return msg

    def check_pid(self, pid: int) -> None:
        if self.broker_pid and pid != self.broker_pid:
            old, self.broker_pid = self.broker_pid, pid
            raise BrokerLost(f"the broker at {self.endpoint} restarted (pid {old} -> {pid}): "
                             "what was in flight is gone")
        self.broker_pid = pid

    def close(self) -> None:
        self.dealer.close(0)
        wiring.destroy(self.ctx)


def discover(controller: str, timeout_s: float, security: wiring.Security | None = None) -> str:
    """Where the controller at `controller` says the relay's vector endpoint is bound.

    Raises:
        BrokerLost: no controller answered, or no broker --external registered, in time.
    """
    ctx = wiring.context(security)
    dealer = topology.open_role(ctx, Role.CLIENT, {"controller": controller})[
        PortName.CONTROLLER]
    rejects = node.RejectLog(LOG)
    beat = p.Heartbeat(role="cli", name=f"vector-{os.getpid()}", host=pysocket.gethostname(),
                       pid=os.getpid(), leaving=False, figures={})
    deadline, address = time.monotonic() + timeout_s, ""
    try:
        while not address and time.monotonic() < deadline:
            node.send(dealer, beat, block=False)
            if dealer.poll(250):
                _, msg = node.recv(dealer, rejects)
                if isinstance(msg, p.RunState):
                    address = wiring.reachable(msg.endpoints.get("vector", ""), via=controller)
        node.send(dealer, dataclasses.replace(beat, leaving=True), block=False)
    finally:
        dealer.close(0)
        wiring.destroy(ctx)
    if not address:
        raise BrokerLost(f"the controller at {controller} named no vector endpoint within "
                         f"{timeout_s:.0f}s: is a `stepbus broker --external` running there?")
    return address

