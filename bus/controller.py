"""The controller: who is alive, the run's identity, reset barriers and the shutdown broadcast.

One ROUTER takes heartbeats (which register) and commands; one PUB broadcasts. Every heartbeat
is answered with the run state, so a process that missed a broadcast catches up within one beat.
"""

from __future__ import annotations

import collections
import os
import socket as pysocket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from stepbus.bus import node, wiring
from stepbus.bus import protocol as p


@dataclass
class Config:
    controller: str = wiring.endpoint("controller", "ROUTER endpoint to bind")
    broadcast: str = wiring.endpoint("broadcast", "PUB endpoint to bind")
    barrier_timeout_s: float = field(default=10.0, metadata={
        "help": "a reset barrier the broker has not completed by then fails with an error"})
    shutdown_grace_s: float = field(default=3.0, metadata={
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


@dataclass
class PendingReset:
    requester: bytes
    epoch: int
    deadline: float


Handler = Callable[[bytes, Any, float], None]


@dataclass
class PendingSwap:
    requester: bytes
    slot: bytes
    deadline: float


SWAP_TIMEOUT_S = 30.0  # a slot stops its learner (<= 4 s) and watches the new one (3 s)


def run(cfg: Config) -> int:
    log = node.setup_logging("controller")
    stop = node.StopFlag()
    ctx = wiring.context(cfg.security)
    # Control messages carry no arrays: a peer may not make us hold more than this for it.
    router = wiring.socket(ctx, zmq.ROUTER, bind=cfg.controller, max_message_bytes=1 << 20)
    pub = wiring.socket(ctx, zmq.PUB, bind=cfg.broadcast)
    rejects = node.RejectLog(log)
    run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    peers: dict[bytes, Peer] = {}
    epoch, options = 0, {}
    shutting_down_since: float | None = None
    pending_reset: PendingReset | None = None
    pending_swap: PendingSwap | None = None
    versions = VersionHistory()
    host, pid, started = pysocket.gethostname(), os.getpid(), time.monotonic()
    log.info("run %s: controller on %s, broadcasts on %s", run_id, cfg.controller, cfg.broadcast)

    def state() -> p.RunState:
        endpoints = {"controller": cfg.controller, "broadcast": cfg.broadcast}
        for peer in peers.values():
            endpoints.update(peer.binds)
        return p.RunState(run_id=run_id, epoch=epoch, options=options,
                          shutting_down=shutting_down_since is not None, endpoints=endpoints)

    def begin_shutdown(reason: str) -> None:
        nonlocal shutting_down_since
        if shutting_down_since is None:
            shutting_down_since = time.monotonic()
            log.info("shutdown: %s", reason)
        node.send(pub, p.Shutdown(reason=reason), block=False)

    def on_heartbeat(sender: bytes, msg: p.Heartbeat, now: float) -> None:
        nonlocal epoch
        peer = peers.get(sender)
        if msg.leaving:
            if peer is not None:
                del peers[sender]
                log.info("%s %s left", msg.role, msg.name)
            return
        if peer is None:
            peer = peers[sender] = Peer(msg.role, msg.name, msg.host, msg.pid, now, now)
            log.info("%s %s joined (host %s, pid %d)", msg.role, msg.name, msg.host, msg.pid)
        peer.last_seen, peer.figures_at = now, now
        peer.figures = _scalar_figures(msg.figures)
        if msg.binds:
            peer.binds = {name: address for name, address in msg.binds.items()
                          if name in wiring.ENDPOINTS and len(address) <= 256
                          and address.startswith(("tcp://", "ipc://"))}
        peer.rate.add(now, peer.figures.get("env_steps"))
        versions.add(now, peer.figures)
        broker_epoch = peer.figures.get("epoch") if msg.role == "broker" else None
        if isinstance(broker_epoch, int) and broker_epoch > epoch:
            epoch = broker_epoch  # this controller restarted: continue the run's epochs
        node.send(router, state(), to=sender, block=False)

    def on_status(sender: bytes, msg: p.StatusRequest, now: float) -> None:
        rows = [_status_row(q, now, versions) for q in peers.values()]
        rows.insert(0, {"role": "controller", "name": "controller", "host": host, "pid": pid,
                        "uptime_s": round(now - started, 1), "last_heartbeat_s": 0.0,
                        "processes": len(peers), **rejects.figures()})
        node.send(router, p.StatusReply(run_id=run_id, epoch=epoch, processes=rows), to=sender,
                  block=False)

    def on_reset(sender: bytes, msg: p.ResetRequest, now: float) -> None:
        nonlocal epoch, options, pending_reset
        if not any(q.role == "broker" for q in peers.values()):
            node.send(router, p.Reply(ok=False, detail="no broker is registered"), to=sender)
            return
        if pending_reset is not None:
            node.send(router, p.Reply(ok=False, detail="a reset barrier is already running"),
                      to=sender)
            return
        epoch, options = epoch + 1, msg.options
        pending_reset = PendingReset(sender, epoch, now + cfg.barrier_timeout_s)
        log.info("reset barrier: epoch %d, options %s", epoch, options)
        node.send(pub, p.Barrier(epoch=epoch, options=options), block=False)

    def on_barrier_done(sender: bytes, msg: p.BarrierDone, now: float) -> None:
        nonlocal pending_reset
        if pending_reset is not None and msg.epoch == pending_reset.epoch:
            detail = f"epoch {msg.epoch}: {msg.workers_reset} workers reset"
            if msg.workers_lost:
                detail += f", {msg.workers_lost} lost during the barrier"
            ok = msg.workers_reset > 0 and not msg.errors
            if msg.errors:
                detail += "; environments raised on reset (reset again without the options):\n"
                detail += "\n".join(msg.errors)
            log.info("reset barrier %s, %s", "complete" if ok else "failed", detail)
            node.send(router, p.Reply(ok=ok, detail=detail), to=pending_reset.requester)
            pending_reset = None

    def on_shutdown(sender: bytes, msg: p.ShutdownRequest, now: float) -> None:
        begin_shutdown(msg.reason)
        node.send(router, p.Reply(ok=True, detail="shutting down"), to=sender, block=False)

    def on_trainer_swap(sender: bytes, msg: p.TrainerSwap, now: float) -> None:
        nonlocal pending_swap
        slots = {ident: q for ident, q in peers.items()
                 if q.role == "slot" and msg.slot in ("", q.name)}
        names = ", ".join(sorted(q.name for q in peers.values() if q.role == "slot"))
        problem = ("a swap is already under way" if pending_swap is not None else
                   f"no trainer slot named {msg.slot!r} (slots: {names or 'none'})"
                   if msg.slot and not slots else
                   "no trainer slot is registered (start one with `stepbus trainer`)"
                   if not slots else
                   f"{len(slots)} trainer slots ({names}): name one with --slot"
                   if len(slots) > 1 else "")
        if problem:
            node.send(router, p.Reply(ok=False, detail=problem), to=sender, block=False)
            return
        (ident,) = slots
        pending_swap = PendingSwap(sender, ident, now + SWAP_TIMEOUT_S)
        log.info("trainer swap in slot %s: %s", peers[ident].name, " ".join(msg.args))
        node.send(router, msg, to=ident, block=False)

    def on_reply(sender: bytes, msg: p.Reply, now: float) -> None:
        nonlocal pending_swap
        if pending_swap is None or sender != pending_swap.slot:
            who = peers[sender].name if sender in peers else sender.hex()
            rejects.refuse(who, p.ProtocolError("unexpected kind", "REPLY"))
            return
        node.send(router, msg, to=pending_swap.requester, block=False)
        pending_swap = None

    def on_remote_error(sender: bytes, msg: p.RemoteError, now: float) -> None:
        log.error("error in %s: %s: %s %s\n%s", msg.origin, msg.error_type, msg.message,
                  msg.context, msg.traceback)

    def alive(handler: Handler) -> Handler:
        """Any message from a registered process counts as its heartbeat."""
        def handle(sender: bytes, msg: Any, now: float) -> None:
            if sender in peers:
                peers[sender].last_seen = now
            handler(sender, msg, now)
        return handle

    handlers = {
        p.Heartbeat: on_heartbeat,
        p.StatusRequest: on_status,
        p.ResetRequest: on_reset,
        p.BarrierDone: on_barrier_done,
        p.ShutdownRequest: on_shutdown,
        p.RemoteError: on_remote_error,
        p.TrainerSwap: on_trainer_swap,
        p.Reply: on_reply,
    }
    handlers = {kind: alive(handler) for kind, handler in handlers.items()}

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    next_rebroadcast = 0.0
    try:
        while True:
            if stop:
                begin_shutdown(f"controller received {stop.reason}")
            if dict(poller.poll(node.MAX_POLL_MS)).get(router):
                node.serve(router, rejects, handlers)
            now = time.monotonic()
            expiry = node.HEARTBEAT_INTERVAL_S * node.LIVENESS_INTERVALS
            for ident, peer in list(peers.items()):
                if now - peer.last_seen > expiry:
                    log.warning("%s %s expired (silent %.1fs)", peer.role, peer.name,
                                now - peer.last_seen)
                    del peers[ident]
            if pending_reset is not None and now > pending_reset.deadline:
                node.send(router, p.Reply(ok=False, detail=(
                    f"reset barrier epoch {pending_reset.epoch} not completed within "
                    f"{cfg.barrier_timeout_s}s")), to=pending_reset.requester, block=False)
                pending_reset = None
            if pending_swap is not None and now > pending_swap.deadline:
                node.send(router, p.Reply(ok=False, detail=(
                    f"the trainer slot did not answer within {SWAP_TIMEOUT_S:g}s")),
                    to=pending_swap.requester, block=False)
                pending_swap = None
            if shutting_down_since is not None:
                if now >= next_rebroadcast:  # late subscribers still hear it
                    node.send(pub, p.Shutdown(reason="shutdown"), block=False)
                    next_rebroadcast = now + 0.2
                gone = not any(q.role != "cli" for q in peers.values())
                if gone or now - shutting_down_since > cfg.shutdown_grace_s:
                    log.info("all processes left; controller exiting" if gone else
                             "shutdown grace over; controller exiting")
                    return 0
    finally:
        wiring.destroy(ctx, wiring.LINGER_MS)


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


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scalar_figures(figures: dict) -> dict:
    """Figures as a status row can show them: at most 64 scalar values, short strings."""
    out = {}
    for key, value in list(figures.items())[:64]:
        if isinstance(value, str):
            out[key[:64]] = value[:200]
        elif value is None or isinstance(value, (bool, int, float)):
            out[key[:64]] = value
    return out
