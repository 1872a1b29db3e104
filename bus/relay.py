"""The broker's external mode (`stepbus broker --external`): the policy lives in a vector env
client (`stepbus.vector`), so the broker only relays.

Workers connect on "steps" as they always do; one vector client connects on "vector". The
relay tells the client the spaces and the workers (VECTOR_SPEC, again whenever one joins,
restarts or is lost), passes the client's RESET and STEP on to the worker each names, and each
worker's STEP_RESULT back with the worker's name. No model, no credit window, no assembler and
no trainer: nothing is learned here and nothing is forwarded anywhere else.

Liveness both ways: a worker silent for the liveness timeout (killed, frozen) or restarted
(a new incarnation) is reported to the client as WORKER_LOST, and the relay sends the client a
HEARTBEAT every interval, so a client hears a dead or restarted broker as silence (or another
pid) and never waits forever.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket as pysocket
import time
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

import zmq

from stepbus.bus import checks, node, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.topology import PortName, Role
from stepbus.bus.worker_table import Worker, WorkerTable

CLIENT_BEAT_S = node.HEARTBEAT_INTERVAL_S


@dataclass
class RelayCounts:
    """What the relay dropped or lost; figures of `stepbus status`."""

    stale_dropped: int = 0  # replies nobody waits for (from before a restart, or unasked)
    workers_lost: int = 0
    steps_relayed: int = 0  # worker steps (batches) passed to the client
    client_refused: int = 0  # client requests for an unknown or busy worker


class Relay(node.Process):
    """Workers on "steps", the vector client on "vector", run state from "controller"."""

    role = "broker"
    sockets = Role.RELAY

    def __init__(self, ports: node.Ports, log: logging.Logger, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(ports, log, clock=clock)
        self.table = WorkerTable([], ["default"])
        self.counts = RelayCounts()
        self.env_id = ""
        self.spec: p.SpaceSpec | None = None
        self.client: bytes | None = None  # the vector client's routing id (the latest to speak)
        self.epoch = 0
        self.host, self.pid = pysocket.gethostname(), os.getpid()
        # Names of the workers whose answers take a lane (stepbus/vector/local.py's lanes).
        self.answered_elsewhere: Container[str] = ()
        self.every("client_beat", CLIENT_BEAT_S, self.beat_client)

    # -- workers
    def on_worker_hello(self, peer: bytes, msg: p.WorkerHello) -> None:
        w = self.table.get(peer)
        if w is not None and w.incarnation == msg.incarnation:
            w.last_seen = self.now
            # Idle, having answered: the answer was lost. Not so for a worker whose answers
            # take a lane (stepbus/vector/local.py): its hello, on the socket, may overtake an
            # answer still in the lane, which loses nothing (its end shows as end of file).
            if w.in_flight and msg.seq >= w.seq and w.name not in self.answered_elsewhere:
                self.forget(w, f"its answer to request {w.seq} was lost")
            return
        if w is None and self.table.known_as(msg.worker, msg.incarnation):
            return  # queued on a connection it has since replaced
        if not self.accepts(msg):
            return
        w, old = self.table.join(peer, msg, self.now)
        w.in_flight = False  # nothing asked of it: the client resets it first
        if old is not None:
            self.log.info("worker %s restarted (incarnation %s)", msg.worker, msg.incarnation)
            self.tell_lost(old, "restarted: its envs and episodes are new")
        else:
            self.log.info("worker %s joined: %d x %s", msg.worker, msg.num_envs, msg.env_id)
        self.tell_spec()

    def accepts(self, msg: p.WorkerHello) -> bool:
        """Its rows in range, usable spaces, the same as the run's (the first sets them)."""
        problem = checks.hello_rows_problem(msg)
        if not problem and msg.split_of:  # a vector env's env ids are whole workers' envs
            problem = "a vector env takes whole workers: start this one with --splits 1"
        if not problem and self.spec is None:
            problem = checks.spec_problem(msg.spec)
            if not problem:
                self.env_id, self.spec = msg.env_id, msg.spec
        elif not problem and msg.spec != self.spec:
            problem = f"{msg.env_id} has other spaces than {self.env_id}"
        if problem:
            self.refuse("bad hello", problem[:300], claims=msg.worker)
        return not problem

    def on_step_result(self, peer: bytes, msg: p.StepResult) -> None:
        w = self.table.get(peer)
        if w is None or not w.expects(msg) or msg.obs_slot != -1:
            self.counts.stale_dropped += 1
            return
        w.last_seen, w.in_flight = self.now, False
        problem = checks.result_problem(msg, w.num_envs, self.spec)
        if problem:
            self.refuse("bad step result", problem, claims=w.name)
            self.forget(w, f"sent a result we cannot use ({problem[:80]})")
            return
        self.counts.steps_relayed += 1
        self.to_client(p.renumbered(msg, worker=w.name))

    def on_heartbeat(self, peer: bytes, msg: p.Heartbeat) -> None:
        w = self.table.get(peer)
        if w is not None:
            w.last_seen = self.now

    def on_remote_error(self, peer: bytes, msg: p.RemoteError) -> None:
        """An env raised: the worker recreated it and reported the episode truncated."""

    def on_env_call_result(self, peer: bytes, msg: p.EnvCallResult) -> None:
        w = self.table.get(peer)
        if w is not None:
            w.last_seen = self.now
            self.to_client(dataclasses.replace(msg, worker=w.name))

    # -- the vector client
    def on_vector_hello(self, peer: bytes, msg: p.VectorHello) -> None:
        self.client = peer
        self.log.info("vector client %s attached", msg.client[:64])
        self.tell_spec()

    def on_reset(self, peer: bytes, msg: p.Reset) -> None:
        w = self.asked(peer, msg.worker)
        if w is not None:
            w.seq, w.epoch = w.seq + 1, self.epoch  # its steps go in the epoch it reset into
            self.ask(w, p.renumbered(msg, epoch=w.epoch, seq=w.seq, worker=""))

    def on_step(self, peer: bytes, msg: p.Step) -> None:
        w = self.asked(peer, msg.worker)
        if w is not None:
            w.seq += 1
            self.ask(w, p.renumbered(msg, epoch=w.epoch, seq=w.seq, worker=""))

    def on_env_call(self, peer: bytes, msg: p.EnvCall) -> None:
        self.client = peer
        w = self.by_name(msg.worker)
        if w is None:
            self.to_client(p.WorkerLost(worker=msg.worker, incarnation="",
                                        reason="not connected to this broker"))
        else:
            self.send(PortName.STEPS, msg, to=w.ident)

    def asked(self, peer: bytes, name: str) -> Worker | None:
        """The worker a client request names, if it can take one now; else the client hears
        why (it waits on that worker's reply, so it must not be left to wait)."""
        self.client = peer
        w = self.by_name(name)
        if w is None or w.in_flight:
            self.counts.client_refused += 1
            self.to_client(p.WorkerLost(worker=name, incarnation=w.incarnation if w else "",
                                        reason="busy with an earlier request" if w else
                                        "not connected to this broker"))
            return None
        return w

    def ask(self, w: Worker, msg: p.Message) -> None:
        w.in_flight, w.sent_at = True, self.now
        if not self.send(PortName.STEPS, msg, to=w.ident):
            self.forget(w, "unreachable")

    def by_name(self, name: str) -> Worker | None:
        return next((w for w in self.table if w.name == name), None)

    def to_client(self, msg: p.Message) -> None:
        if self.client is not None:
            self.send(PortName.VECTOR, msg, to=self.client)

    def tell_spec(self) -> None:
        if self.spec is None:
            return  # no worker yet: the first to join sends it
        members = [p.Member(name=w.name, incarnation=w.incarnation, rows=w.num_envs,
                            agents=len(w.agents)) for w in sorted(self.table, key=_name)]
        self.to_client(p.VectorSpec(env_id=self.env_id, spec=self.spec, workers=members))

    def tell_lost(self, w: Worker, why: str) -> None:
        self.to_client(p.WorkerLost(worker=w.name, incarnation=w.incarnation, reason=why))

    def beat_client(self, now: float) -> None:
        self.to_client(p.Heartbeat(role="broker", name="broker", host=self.host, pid=self.pid,
                                   leaving=False, figures={}))

    # -- timekeeping
    def forget(self, w: Worker, why: str) -> None:
        if not self.table.forget(w):
            return
        self.counts.workers_lost += 1
        self.log.warning("worker %s %s", w.name, why)
        self.tell_lost(w, why)
        self.tell_spec()

    def on_stalled(self, seconds: float) -> None:
        self.log.log(self.stall_log_level, "the relay itself did not run for %.1fs: every "
                     "worker gets a new liveness allowance", seconds)
        self.table.heard_from_all(self.clock())

    def on_run_state(self, peer: bytes, msg: p.RunState) -> None:
        super().on_run_state(peer, msg)
        self.epoch = msg.epoch

    def tick(self, now: float) -> float:
        self.now = now
        for w, why in self.table.silent(now):
            self.forget(w, why)
        return super().tick(now)

    def figures(self) -> dict[str, Any]:
        return {"workers": len(self.table), "mode": "external", "epoch": self.epoch,
                "client": self.client is not None, **dataclasses.asdict(self.counts),
                **self.rejects.figures()}

    def finish(self) -> None:
        self.log.info("relay stopping (%s) after %d steps relayed", self.stop_reason,
                      self.counts.steps_relayed)


def _name(w: Worker) -> str:
    return w.name


def run(steps: str, vector: str, controller: str, broadcast: str,
        security: wiring.Security) -> int:
    """The relay on its sockets until a signal or the controller's shutdown."""
    log = node.setup_logging("broker")
    stop = node.StopFlag()
    ctx = wiring.context(security)
    link = node.ControllerLink(ctx, role="broker", name="broker", controller=controller,
                               broadcast=broadcast, log=log,
                               binds={"steps": steps, "vector": vector})
    try:
        sockets = topology.open_role(ctx, Role.RELAY, {"steps": steps, "vector": vector})
        relay = Relay(node.SocketPorts({**sockets, PortName.CONTROLLER: link.dealer}), log)
        log.info("broker (external): workers on %s, the vector client on %s", steps, vector)
        return node.Loop(relay, relay_ports(sockets), link, stop).run()
    finally:
        wiring.destroy(ctx, topology.LINGER_MS)


RECEIVES: dict[str, tuple[type, ...]] = {  # by port: the kinds the relay takes there
    PortName.STEPS: (p.WorkerHello, p.StepResult, p.Heartbeat, p.RemoteError, p.EnvCallResult),
    PortName.VECTOR: (p.VectorHello, p.Reset, p.Step, p.EnvCall)}


def relay_ports(sockets: dict[str, zmq.Socket]) -> dict[str, node.Port]:
    """What the relay receives on each of `sockets` (the vector port's may be absent: a client
    in the relay's own process calls it instead, `stepbus/vector/local.py`)."""
    return {port: node.Port(sockets[port], kinds, routed=True)
            for port, kinds in RECEIVES.items() if port in sockets}
