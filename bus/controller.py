"""The controller: who is alive, the run's identity, reset barriers and the shutdown broadcast.

One ROUTER takes heartbeats (which register) and commands; one PUB broadcasts. Every heartbeat
is answered with the run state, so a process that missed a broadcast catches up within one beat.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import os
import re
import socket as pysocket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import zmq

from stepbus.bus import node, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.topology import PortName, Role


@dataclass
class Config:
    controller: str = wiring.endpoint("controller", "ROUTER endpoint to bind")
    broadcast: str = wiring.endpoint("broadcast", "PUB endpoint to bind")
    barrier_timeout_s: float = field(default=10.0, metadata={"above": 0,
        "help": "a reset barrier the broker has not completed by then fails with an error"})
    shutdown_grace_s: float = field(default=3.0, metadata={"min": 0,
        "help": "after a shutdown broadcast, wait this long for processes to leave"})
    security: wiring.Security = field(default_factory=wiring.Security)


class StepRate:
    """Steps/s from a cumulative `env_steps` figure over the last few seconds of heartbeats, so
    processes that count steps but keep no rate of their own (workers, learners) get one in
    `stepbus status` without each timing itself."""

    WINDOW_S = 5.0
    MIN_SPAN_S = 0.9  # below this, two beats' counts say more about jitter than rate

    def __init__(self) -> None:
        self.samples: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, now: float, steps: Any) -> None:
        if not _is_number(steps):
            return
        if self.samples and steps < self.samples[-1][1]:
            self.samples.clear()  # the counter started again (a resumed count is never lower)
        self.samples.append((now, steps))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.WINDOW_S:
            self.samples.popleft()

    def per_s(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        return round((s1 - s0) / (t1 - t0), 1) if t1 - t0 >= self.MIN_SPAN_S else None


class VersionHistory:
    """Policy versions from every heartbeat of the last few seconds, for `policy_lag`: the
    newest version any process had reported by the time a process sent its figures, minus the
    version in them (the one it acts with, or the learner's newest). Comparing with the newest
    at that time, not now, keeps heartbeats' different ages (up to 0.5 s, many versions when
    updates are fast) out of the lag. Versions are compared within one `policy` figure when
    processes report one."""

    WINDOW_S = 5.0  # longer than any live row's figures are old (3 heartbeat intervals)

    def __init__(self) -> None:
        self.samples: collections.deque[tuple[float, object, int]] = collections.deque()

    @staticmethod
    def _version(figures: dict) -> int | None:
        v = figures.get("policy_version")
        return int(v) if _is_number(v) and v == int(v) and v >= 0 else None

    def add(self, now: float, figures: dict) -> None:
        if (v := self._version(figures)) is not None:
            self.samples.append((now, figures.get("policy", "default"), v))
        while self.samples and now - self.samples[0][0] > self.WINDOW_S:
            self.samples.popleft()

    def lag(self, figures: dict, at: float) -> int | None:
        if (v := self._version(figures)) is None:
            return None
        policy = figures.get("policy", "default")
        newest = max((sv for t, sp, sv in self.samples if t <= at and sp == policy), default=v)
        return max(newest - v, 0)


LIVENESS_S = node.LIVENESS_S
SWAP_TIMEOUT_S = 30.0  # a slot stops its learner (<= 4 s), watches the new one (3-20 s)
ADOPT_RUN_S = 5.0  # a restarted controller takes the run id its peers report this long after start
# A run id as one is taken from a peer: what `run_id` makes, or the name of a run directory a
# learner resumes; safe in a path either way (no separator, no leading dot).
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
REBROADCAST_S = 0.2  # while shutting down, Shutdown again this often for late subscribers
KINDS = (p.Heartbeat, p.StatusRequest, p.ResetRequest, p.BarrierDone, p.ShutdownRequest,
         p.RemoteError, p.TrainerSwap, p.Reply)  # what the ROUTER takes


@dataclass
class Peer:
    role: str
    name: str
    host: str
    pid: int
    first_seen: float
    last_seen: float
    figures: dict = field(default_factory=dict)
    binds: dict[str, str] = field(default_factory=dict)  # where it bound which endpoint
    figures_at: float = 0.0  # when the figures were sent (its last heartbeat)
    rate: StepRate = field(default_factory=StepRate)


class PeerTable:
    """Every registered process by its ROUTER identity. A heartbeat registers a process and a
    leaving one deregisters it; any message from it counts as a sign of life; one silent for
    more than LIVENESS_S is dead."""

    def __init__(self) -> None:
        self.by_id: dict[bytes, Peer] = {}

    def seen(self, ident: bytes, now: float) -> None:
        if (peer := self.by_id.get(ident)) is not None:
            peer.last_seen = now

    def expire(self, now: float) -> list[Peer]:
        """Remove and return the peers silent for more than LIVENESS_S."""
        dead = {ident: q for ident, q in self.by_id.items() if now - q.last_seen > LIVENESS_S}
        for ident in dead:
            del self.by_id[ident]
        return list(dead.values())

    def heard_from_all(self, now: float) -> None:
        """A new liveness allowance for everyone: the silence was ours."""
        for peer in self.by_id.values():
            peer.last_seen = now

    def next_expiry(self) -> float:
        """The earliest time a peer could be dead, if nothing is heard from it (inf: none)."""
        return min((q.last_seen for q in self.by_id.values()), default=math.inf) + LIVENESS_S

    def only_clients_left(self) -> bool:
        """Nobody a shutdown waits for is left. Supervisors leave only after their child, and
        this controller's own waits for it: waiting for them would hold every run's end."""
        return not any(q.role not in ("cli", "supervisor") for q in self.by_id.values())


class Phase(enum.Enum):
    """The controller's own life: a shutdown request or a signal moves it on, never back."""

    RUNNING = "running"
    SHUTTING_DOWN = "shutting down"  # Shutdown broadcast; ends when all left or grace is over


@dataclass
class PendingReset:
    """A reset barrier broadcast and not yet reported done; fails at `deadline`."""

    requester: bytes
    epoch: int
    deadline: float


@dataclass
class PendingSwap:
    """A trainer swap forwarded to `slot`, whose Reply goes to `requester`; fails at
    `deadline`."""

    requester: bytes
    slot: bytes
    deadline: float


class Controller(node.Process):
    """Heartbeats and commands on the ROUTER port "router", broadcasts on the PUB port "pub".
    Timers: "purge" (the next peer expiry), "barrier" and "swap" (the deadlines of what is
    pending), "rebroadcast" (while shutting down). `tick` ends the loop once every process
    left after a shutdown, or its grace is over."""

    role = "controller"
    sockets = Role.CONTROLLER

    def __init__(self, cfg: Config, ports: node.Ports, log: logging.Logger, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(ports, log, clock=clock)
        self.cfg = cfg
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self.adopted, self.adopted_from = False, ("", "")  # see `adopt_run`
        self.resumed_by = ""  # the trainer whose resumed run this is (`carry_on_resumed`)
        self.resume_refused: set[str] = set()  # trainers told they resume another run
        self.peers = PeerTable()
        self.epoch = 0
        self.options: dict[str, p.Json] = {}
        self.phase = Phase.RUNNING
        self.shutdown_started = math.inf
        self.pending_reset: PendingReset | None = None
        self.pending_swap: PendingSwap | None = None
        self.versions = VersionHistory()
        self.host, self.pid = pysocket.gethostname(), os.getpid()
        log.info("run %s: controller on %s, broadcasts on %s", self.run_id, cfg.controller,
                 cfg.broadcast)

    def deliver(self, peer: bytes, msg: p.Message, now: float | None = None, *,
                sender: node.Sender | str = "") -> None:
        """Any message from a registered process counts as its heartbeat."""
        now = self.clock() if now is None else now
        self.peers.seen(peer, now)
        super().deliver(peer, msg, now, sender=sender)

    def state(self) -> p.RunState:
        endpoints: dict[str, str] = {}
        for peer in self.peers.by_id.values():
            endpoints.update(peer.binds)
        # Last: a registered peer cannot advertise another controller or broadcast address.
        endpoints.update(controller=self.cfg.controller, broadcast=self.cfg.broadcast)
        return p.RunState(run_id=self.run_id, epoch=self.epoch, options=self.options,
                          shutting_down=self.phase is Phase.SHUTTING_DOWN, endpoints=endpoints,
                          horizon=self.horizon())

    def horizon(self) -> int:
        """The trajectory horizon a registered assembler reports (0: none has), so the broker's
        credit window allows for the run's real partial trajectories."""
        said = [peer.figures.get("horizon") for peer in self.peers.by_id.values()
                if peer.role == "assembler"]
        return max((h for h in said if isinstance(h, int) and 0 < h < 2**31), default=0)

    # -- liveness
    def on_heartbeat(self, peer: bytes, msg: p.Heartbeat) -> None:
        now, known = self.now, self.peers.by_id.get(peer)
        if msg.leaving:
            if known is not None:
                del self.peers.by_id[peer]
                self.log.info("%s %s left", msg.role, msg.name)
                self.fail_swap_of_gone_slot(f"trainer slot {msg.name} left")
            return
        if known is None:
            known = self.peers.by_id[peer] = Peer(msg.role, msg.name, msg.host, msg.pid, now, now)
            self.log.info("%s %s joined (host %s, pid %d)", msg.role, msg.name, msg.host, msg.pid)
            if "purge" not in self.timers:
                self.at("purge", self.peers.next_expiry(), self.purge)
        known.last_seen, known.figures_at = now, now
        known.figures = _scalar_figures(msg.figures)
        if msg.binds:
            known.binds = {name: address for name, address in msg.binds.items()
                           if name in wiring.ENDPOINTS and len(address) <= 256
                           and address.startswith(("tcp://", "ipc://"))}
        known.rate.add(now, known.figures.get("env_steps"))
        self.versions.add(now, known.figures)
        self.adopt_run(known)
        self.carry_on_resumed(known)
        broker_epoch = known.figures.get("epoch") if msg.role == "broker" else None
        if isinstance(broker_epoch, int) and broker_epoch > self.epoch:
            self.epoch = broker_epoch  # this controller restarted: continue the run's epochs
        self.send(PortName.ROUTER, self.state(), to=peer)

    def adopt_run(self, peer: Peer) -> None:
        """A controller restarted under a running pipeline hears the run's id in its first
        heartbeats: it carries that run on, so a learner started after it resumes the same run
        directory instead of starting a new run. Only once, only while young (later its own id
        has been handed out), and only from a process older than itself (which knew the run
        before this controller existed)."""
        said, age = peer.figures.get("run_id"), self.now - self.started
        if not (isinstance(said, str) and said != self.run_id and RUN_ID_PATTERN.fullmatch(said)):
            return
        uptime = peer.figures.get("uptime_s")
        if self.adopted or age >= ADOPT_RUN_S or not (
                isinstance(uptime, (int, float)) and uptime > age):
            if self.adopted and said != self.adopted_from[0]:
                self.log.warning("%s %s reports run %s, not %s: a process of another run?",
                                 peer.role, peer.name, said, self.run_id)
            return
        self.log.info("carrying on run %s (from %s %s's heartbeat) instead of %s",
                      said, peer.role, peer.name, self.run_id)
        self.run_id, self.adopted, self.adopted_from = said, True, (said, peer.name)

    def carry_on_resumed(self, peer: Peer) -> None:
        """A learner resuming a stopped run (`stepbus trainer --resume`) says which: this
        controller carries that run's id on instead of its own new one, so `stepbus status`,
        every process's heartbeats and a learner that joins later (RUNS_DIR/<run id>) agree
        with it. Only a run id of its own or adopted from a restart's peers is kept: a second
        resumed run in one pipeline is warned of, once per trainer."""
        said = peer.figures.get("resumes")
        if (peer.role != "trainer" or not isinstance(said, str) or said == self.run_id
                or not RUN_ID_PATTERN.fullmatch(said)):
            return
        if self.resumed_by or self.adopted:
            if peer.name not in self.resume_refused:
                self.resume_refused.add(peer.name)
                self.log.warning("trainer %s resumes run %s, while this pipeline carries run "
                                 "%s on: its learner writes in its own run directory",
                                 peer.name, said, self.run_id)
            return
        self.log.info("carrying on run %s (trainer %s resumes it) instead of %s", said,
                      peer.name, self.run_id)
        self.run_id, self.resumed_by = said, peer.name

    def purge(self, now: float) -> None:
        for peer in self.peers.expire(now):
            self.log.warning("%s %s expired (silent %.1fs)", peer.role, peer.name,
                             now - peer.last_seen)
            self.fail_swap_of_gone_slot(
                f"trainer slot {peer.name} went silent for {now - peer.last_seen:.1f}s")
        if self.peers.by_id:
            self.at("purge", self.peers.next_expiry(), self.purge)

    def on_status_request(self, peer: bytes, msg: p.StatusRequest) -> None:
        now = self.now
        rows = [_status_row(q, now, self.versions) for q in self.peers.by_id.values()]
        rows.insert(0, {"role": "controller", "name": "controller", "host": self.host,
                        "pid": self.pid, "uptime_s": round(now - self.started, 1),
                        "last_heartbeat_s": 0.0, "processes": len(self.peers.by_id),
                        **self.rejects.figures()})
        self.send(PortName.ROUTER, p.StatusReply(run_id=self.run_id, epoch=self.epoch,
                                                 processes=rows), to=peer)

    def on_remote_error(self, peer: bytes, msg: p.RemoteError) -> None:
        self.log.error("error in %s: %s: %s %s\n%s", msg.origin, msg.error_type, msg.message,
                       msg.context, msg.traceback)

    # -- reset barrier
    def on_reset_request(self, peer: bytes, msg: p.ResetRequest) -> None:
        if not any(q.role == "broker" for q in self.peers.by_id.values()):
            self.send(PortName.ROUTER, p.Reply(ok=False, detail="no broker is registered"), to=peer,
                      block=True)
            return
        if self.pending_reset is not None:
            self.send(PortName.ROUTER, p.Reply(ok=False,
                                               detail="a reset barrier is already running"),
                      to=peer, block=True)
            return
        self.epoch, self.options = self.epoch + 1, msg.options
        self.pending_reset = PendingReset(peer, self.epoch, self.now + self.cfg.barrier_timeout_s)
        self.at("barrier", self.pending_reset.deadline, self.barrier_timed_out)
        self.log.info("reset barrier: epoch %d, options %s", self.epoch, self.options)
        self.send(PortName.PUB, p.Barrier(epoch=self.epoch, options=self.options))

    def on_barrier_done(self, peer: bytes, msg: p.BarrierDone) -> None:
        pending = self.pending_reset
        if pending is None or msg.epoch != pending.epoch:
            return
        detail = f"epoch {msg.epoch}: {msg.workers_reset} workers reset"
        if msg.workers_lost:
            detail += f", {msg.workers_lost} lost during the barrier"
        ok = msg.workers_reset > 0 and not msg.errors
        if msg.errors:
            detail += "; environments raised on reset (reset again without the options):\n"
            detail += "\n".join(msg.errors)
        self.log.info("reset barrier %s, %s", "complete" if ok else "failed", detail)
        self.send(PortName.ROUTER, p.Reply(ok=ok, detail=detail), to=pending.requester, block=True)
        self.pending_reset = None
        self.cancel("barrier")

    def barrier_timed_out(self, now: float) -> None:
        if (pending := self.pending_reset) is None:
            return
        self.send(PortName.ROUTER, p.Reply(ok=False, detail=(
            f"reset barrier epoch {pending.epoch} not completed within "
            f"{self.cfg.barrier_timeout_s}s")), to=pending.requester)
        self.pending_reset = None

    # -- trainer swap
    def on_trainer_swap(self, peer: bytes, msg: p.TrainerSwap) -> None:
        slots = [ident for ident, q in self.peers.by_id.items()
                 if q.role == "slot" and msg.slot in ("", q.name)]
        if problem := self.swap_problem(msg.slot, len(slots)):
            self.send(PortName.ROUTER, p.Reply(ok=False, detail=problem), to=peer)
            return
        (ident,) = slots
        self.pending_swap = PendingSwap(peer, ident, self.now + SWAP_TIMEOUT_S)
        self.at("swap", self.pending_swap.deadline, self.swap_timed_out)
        self.log.info("trainer swap in slot %s: %s", self.peers.by_id[ident].name,
                      " ".join(msg.args))
        self.send(PortName.ROUTER, msg, to=ident)

    def swap_problem(self, slot: str, matching: int) -> str:
        """Why a swap for `slot` ("": the only one) cannot go ahead ("" if it can)."""
        names = ", ".join(sorted(q.name for q in self.peers.by_id.values() if q.role == "slot"))
        return ("a swap is already under way" if self.pending_swap is not None else
                f"no trainer slot named {slot!r} (slots: {names or 'none'})"
                if slot and not matching else
                "no trainer slot is registered (start one with `stepbus trainer`)"
                if not matching else
                f"{matching} trainer slots ({names}): name one with --slot"
                if matching > 1 else "")

    def on_reply(self, peer: bytes, msg: p.Reply) -> None:
        """Only the slot of the pending swap replies to the controller; it goes on to whoever
        asked for the swap."""
        if self.pending_swap is None or peer != self.pending_swap.slot:
            registered = self.peers.by_id.get(peer)
            self.refuse("unexpected kind", "REPLY",
                        claims=registered.name if registered is not None else "")
            return
        self.answer_swap(msg)

    def answer_swap(self, reply: p.Reply) -> None:
        """The pending swap's answer goes to whoever asked for it, and the swap is over."""
        assert self.pending_swap is not None
        self.send(PortName.ROUTER, reply, to=self.pending_swap.requester)
        self.pending_swap = None
        self.cancel("swap")

    def fail_swap_of_gone_slot(self, what: str) -> None:
        """A swap whose slot is gone fails now: no answer can come, and the CLI would wait
        out SWAP_TIMEOUT_S for nothing (a slot killed with SIGKILL says no goodbye)."""
        if self.pending_swap is not None and self.pending_swap.slot not in self.peers.by_id:
            self.answer_swap(p.Reply(ok=False, detail=f"{what} before answering the swap"))

    def swap_timed_out(self, now: float) -> None:
        if self.pending_swap is not None:
            self.answer_swap(p.Reply(ok=False, detail=(
                f"the trainer slot did not answer within {SWAP_TIMEOUT_S:g}s")))

    # -- shutdown
    def on_shutdown_request(self, peer: bytes, msg: p.ShutdownRequest) -> None:
        self.begin_shutdown(msg.reason, self.now)
        self.send(PortName.ROUTER, p.Reply(ok=True, detail="shutting down"), to=peer)

    def on_signal(self, reason: str) -> None:
        self.begin_shutdown(f"controller received {reason}", self.clock())

    def begin_shutdown(self, reason: str, now: float) -> None:
        """Broadcast Shutdown (again each time asked); the first time, enter SHUTTING_DOWN and
        repeat the broadcast for late subscribers until the loop ends."""
        if self.phase is Phase.RUNNING:
            self.phase, self.shutdown_started = Phase.SHUTTING_DOWN, now
            self.log.info("shutdown: %s", reason)
            self.every("rebroadcast", REBROADCAST_S, self.rebroadcast, first_due=now)
        self.send(PortName.PUB, p.Shutdown(reason=reason))

    def rebroadcast(self, now: float) -> None:
        self.send(PortName.PUB, p.Shutdown(reason="shutdown"))

    def on_stalled(self, seconds: float) -> None:
        """Not run for `seconds` (SIGSTOP, starved, or the serial runner busy elsewhere): what
        looks like everyone's silence is ours."""
        self.log.log(self.stall_log_level, "the controller itself did not run for %.1fs "
                     "(stopped, or starved of CPU): every process gets a new liveness allowance",
                     seconds)
        self.peers.heard_from_all(self.clock())

    def tick(self, now: float) -> float:
        if self.phase is Phase.SHUTTING_DOWN:
            gone = self.peers.only_clients_left()
            if gone or now - self.shutdown_started > self.cfg.shutdown_grace_s:
                self.log.info("all processes left; controller exiting" if gone else
                              "shutdown grace over; controller exiting")
                self.stop("all processes left" if gone else "shutdown grace over")
        return math.inf


def run(cfg: Config) -> int:
    log = node.setup_logging("controller")
    return node.run_role(lambda ctx: open_controller(ctx, cfg, log), cfg.security,
                         node.StopFlag())


def open_controller(ctx: zmq.Context, cfg: Config, log: logging.Logger) -> node.Opened:
    sockets = topology.open_role(ctx, Role.CONTROLLER, topology.endpoints_of(cfg))
    return node.Opened(Controller(cfg, node.SocketPorts(sockets), log),
                       {PortName.ROUTER: node.Port(sockets[PortName.ROUTER], KINDS, routed=True)},
                       None)


def _status_row(q: Peer, now: float, versions: VersionHistory) -> dict:
    """A process's status row: who it is, how long it has run (its own count, which survives
    a controller restart; else since first seen), its figures, a steps/s rate from its step
    count when it reports none itself, and its policy lag."""
    since_beat = now - q.last_seen
    uptime = q.figures.get("uptime_s")
    uptime = uptime + since_beat if _is_number(uptime) else now - q.first_seen
    row = {"role": q.role, "name": q.name, "host": q.host, "pid": q.pid, **q.figures,
           "uptime_s": round(uptime, 1), "last_heartbeat_s": round(since_beat, 2)}
    if "steps_per_s" not in row and (rate := q.rate.per_s()) is not None:
        row["steps_per_s"] = rate
    if (lag := versions.lag(q.figures, q.figures_at)) is not None:
        row["policy_lag"] = lag
    return row


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scalar_figures(figures: dict) -> dict:
    """Figures as a status row can show them: at most 64 scalar values, short strings."""
    out: dict[str, str | int | float | bool | None] = {}
    for key, value in list(figures.items())[:64]:
        if isinstance(value, str):
            out[key[:64]] = value[:200]
        elif value is None or isinstance(value, (bool, int, float)):
            out[key[:64]] = value
    return out
