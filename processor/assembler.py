"""The trajectory assembler: one experience buffer per global agent id (processor/buffers.py),
cut into trajectories and handed to the learner of each agent's policy (processor/outlets.py).

A worker's new incarnation, a reset, a lost message, its loss or shutdown closes its open
trajectories as truncated, bootstrapping from the last observation seen. Nothing is emitted
twice.

Unsent plus sent-but-not-yet-taken-in trajectories are bounded by `max_buffered`; at the bound
the assembler stops taking experience in, the broker's experience queue fills, and stepping
pauses. Nothing is dropped silently.

With several policies (the broker's `--policy-map`), each trajectory goes out on the endpoint of
the policy that acted for its agent (`--policy-endpoints`; "default" uses `--trajectories`), to
that policy's learner.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from stepbus.bus import checks, credit, node, policies, rows, shm, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.exits import SettingError
from stepbus.bus.topology import PortName, Role
from stepbus.processor.buffers import WorkerTrack, newest_versions
from stepbus.processor.outlets import (
    RESEND_GRACE_S,
    TWO_LEARNERS_TURNS,
    TWO_LEARNERS_WARNING_S,
    Ledger,
    Outlet,
    endpoints,
    next_batch,
    port_name,
)

# A worker silent while every other one answered this many times (on average) and the policy
# moved on has its rows' completed steps cut (processor/buffers.py). Counted in messages, not
# seconds, so a batch released at once after a wait (every worker waiting on the credit
# window, or on a --deterministic broker, which serves workers in lockstep) never makes a
# worker whose message is still queued look behind: what is cut never depends on timing.
BEHIND_ROUNDS = 3
BEHIND_CHECK_S = 0.05  # how often silent workers are looked for
SHUTDOWN_FLUSH_S = 1.0  # how long shutdown waits for a trainer to take the last trajectories


@dataclass
class Config:
    experience: str = wiring.endpoint("experience", "PULL endpoint to bind for the broker")
    trajectories: str = wiring.endpoint("trajectories", "PUSH endpoint to bind for trainers")
    receipts: str = wiring.endpoint("receipts", "PULL endpoint to bind for trainers' receipts")
    controller: str = wiring.endpoint("controller", "controller endpoint to connect")
    broadcast: str = wiring.endpoint("broadcast", "controller broadcast endpoint to connect")
    horizon: int = field(default=credit.DEFAULT_HORIZON, metadata={"min": 1,
        "help": "longest trajectory, in steps (the broker's credit window allows for it)"})
    max_buffered: int = field(default=10_000, metadata={"min": 1,
        "help": "trajectories no learner has taken in yet (unsent, or queued toward one); at "
                "this bound, intake and so stepping pause"})
    policy_endpoints: str = field(default="", metadata={
        "help": "PUSH endpoints to bind for policies other than 'default' (the broker's "
                "--policy-map), e.g. 'red=tcp://127.0.0.1:7350,blue=tcp://127.0.0.1:7351'"})
    security: wiring.Security = field(default_factory=wiring.Security)


@dataclass
class Counts:
    """The assembler's counters, as `stepbus status` shows them."""

    steps: int = 0  # transitions completed (an action and its reward)
    trajectories: int = 0
    episodes: int = 0  # trajectories that end an episode seen from its start
    closed_truncated: int = 0  # open trajectories closed by a reset, loss, gap or shutdown
    gaps: int = 0  # experience messages lost between broker and assembler
    resent: int = 0  # trajectories sent again to a learner that connected
    backlog_resends: int = 0  # times they were (at most once per outlets.RESEND_INTERVAL_S)
    learner_handshakes: int = 0  # ZeroMQ handshakes completed on a trajectories port
    resends_deferred: int = 0  # handshakes within the interval, served at its end
    learners_interleaved: int = 0  # receipts of a policy's learners taking turns (two at once)
    trainer_swaps: int = 0  # a new learner incarnation took over a policy
    joined_mid_episode: int = 0  # rows seen first mid-episode (this assembler restarted)
    steps_lost: int = 0  # actions whose results will never come
    agents_vanished: int = 0
    spanned: int = 0  # trajectories cut short: the policy moved on half the learner's lag bound
    cut_behind: int = 0  # ... and their worker fell silent, an action of theirs still pending
    unrouted: int = 0  # trajectories of a policy without an endpoint here (dropped)
    shm_read: int = 0  # observation batches copied out of shared memory
    shm_unreadable: int = 0
    shm_mismatch: int = 0  # a slot rewritten before or while we copied it


class Assembler(node.Process):
    """Experience in (EXPERIENCE, WORKER_LOST on "experience"), trajectories out (one PUSH port
    per policy, see `outlets.port_name`), receipts in ("receipts")."""

    role = "assembler"
    sockets = Role.ASSEMBLER

    def __init__(self, cfg: Config, ports: node.Ports, log: logging.Logger, *,
                 outlet_endpoints: dict[str, str], incarnation: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(ports, log, clock=clock)
        self.cfg = cfg
        self.outlets = {policy: Outlet(policy, endpoint)
                        for policy, endpoint in outlet_endpoints.items()}
        self.by_events = {outlet.events: outlet for outlet in self.outlets.values()}
        self.ledger = Ledger(incarnation or uuid.uuid4().hex[:8])
        self.counts = Counts()
        self.tracks: dict[str, WorkerTrack] = {}
        self.tracks_seen: set[str] = set()  # workers this assembler has had a track for
        self.segments: dict[str, shm.Reader] = {}  # worker -> its --shm-frames segment, mapped
        self.refused_segments: set[str] = set()  # names we could not map (each tried once)
        self.unrouted: set[str] = set()  # policies without an endpoint, logged once each
        self.last_swap_gap_s: float | None = None
        # Per policy, the versions a trajectory may span (processor/buffers.py): half its
        # learner's --max-policy-lag, as its receipts say; none until they do.
        self.version_spans: dict[str, int] = {}
        self.newest: dict[str, int] = {}  # per policy, the version of the latest actions
        self.heard = 0  # experience messages taken in: tracks' `heard_at` are counts of these
        # Experience messages the loop may still take in this pass: what waits for a learner
        # is bounded, so intake pauses (and then stepping) while too much waits.
        self.room = cfg.max_buffered
        self.every("stamp", shm.READER_STAMP_S, self.stamp_segments)
        self.every("behind", BEHIND_CHECK_S, self.cut_behind)

    # -- experience in
    def on_experience(self, peer: bytes, m: p.Experience) -> None:
        self.room -= 1
        read = self.observations_of(m)
        if read is None:
            return
        m = read
        problem = checks.experience_problem(m)
        if problem:
            self.reject(m, "bad experience", problem, "bad experience")
            return
        track = self.tracks.get(m.worker)
        if track is not None:
            why, gap = track.break_with(m)
            self.counts.gaps += gap
            if why:
                self.close(m.worker, why)
                track = None
        if track is None:
            track = self.start_track(m)
        else:
            done = track.complete(m, self.cfg.horizon, self.version_spans)
            self.counts.steps += done.steps
            self.counts.agents_vanished += done.vanished
            self.counts.spanned += done.spanned
            for traj in done.trajectories:
                self.emit(traj)
        track.last_obs, track.epoch, track.seq = m.obs, m.epoch, m.seq
        self.heard += 1
        track.heard_at = self.heard
        problem = track.choose(m)
        if problem:
            self.reject(m, "bad experience", problem, problem)
            return
        # The latest versions, not the highest: a new run's learner counts from 0 again.
        self.newest.update(newest_versions(m))

    def start_track(self, m: p.Experience) -> WorkerTrack:
        """A track for m's worker, from m's observations."""
        if not m.first and m.worker not in self.tracks_seen:
            # Steps before this one went to an assembler that is gone (this one restarted).
            self.counts.joined_mid_episode += rows.count(m.obs)
        self.tracks_seen.add(m.worker)
        track = self.tracks[m.worker] = WorkerTrack.start(m, self.cfg.horizon)
        return track

    def on_worker_lost(self, peer: bytes, msg: p.WorkerLost) -> None:
        self.room -= 1
        track = self.tracks.get(msg.worker)
        if track is not None and track.incarnation == msg.incarnation:
            self.close(msg.worker, f"worker lost: {msg.reason}")
        seg = self.segments.get(msg.worker)
        if seg is not None and seg.name == shm.segment_name(msg.worker, msg.incarnation):
            del self.segments[msg.worker]

    def close(self, worker: str, why: str) -> None:
        track = self.tracks.pop(worker)
        if why != "shutdown":  # actions whose results will never come: those steps are lost
            self.counts.steps_lost += track.pending()
        for traj in track.close():
            self.counts.closed_truncated += 1
            self.emit(traj)
        self.log.debug("closed %s's trajectories: %s", worker, why)

    def reject(self, m: p.Experience, reason: str, detail: str, why: str) -> None:
        """Count and log a message we cannot use; the worker's open trajectories end there
        (truncated), since the steps in it are lost to them."""
        self.refuse(reason, f"worker {m.worker[:64]!r}: {detail}")
        if m.worker in self.tracks:
            self.close(m.worker, why)

    # -- observations in shared memory
    def observations_of(self, m: p.Experience) -> p.Experience | None:
        """m with its observations in it (None: refused)."""
        if m.obs_slot != -1:
            return self.read_slot(m)
        if m.shm:
            self.segment_of(m)  # map and stamp it: the broker sends slot numbers once we do
        return m

    def segment_of(self, m: p.Experience) -> shm.Reader | None:
        """The worker's segment, mapped on first sight (the broker names it in every message
        once it maps it), and stamped on every use, which tells the broker to send slot
        numbers (a long intake round must not let the stamp go stale)."""
        seg = self.segments.get(m.worker)
        if seg is None or seg.name != m.shm:
            self.segments.pop(m.worker, None)
            if m.shm in self.refused_segments:
                return None
            try:
                seg = shm.Reader(m.shm, m.shm_nonce)
            except shm.Refused as exc:
                if len(self.refused_segments) < 10_000:
                    self.refused_segments.add(m.shm)
                self.log.warning("worker %s: not mapping its shared-memory segment (%s); the "
                                 "broker sends its observations on the socket", m.worker, exc)
                return None
            self.segments[m.worker] = seg
        seg.stamp()
        return seg

    def read_slot(self, m: p.Experience) -> p.Experience | None:
        """m with its observations copied out of the worker's segment, and the slot released;
        None (counted, the worker's trajectories cut) if they cannot be read intact."""
        seg = self.segment_of(m) if m.shm else None
        if seg is None:
            self.counts.shm_unreadable += 1
            self.reject(m, "shm unreadable", f"slot {m.obs_slot} of a segment we do not map",
                        "observations we cannot read")
            return None
        s = m.obs_slot
        view = seg.view(s, m.obs)
        if view is None:
            self.reject(m, "bad experience", f"obs_slot {s}", "bad obs_slot")
            return None
        intact = seg.holds(s, m.seq)
        obs = rows.copy(view)
        if not (intact and seg.holds(s, m.seq)):  # rewritten before or while we copied
            self.counts.shm_mismatch += 1
            self.reject(m, "shm mismatch", f"slot {s} no longer holds batch {m.seq}",
                        "shared-memory slot rewritten")
            return None
        seg.release(s, m.seq)
        self.counts.shm_read += 1
        return dataclasses.replace(m, obs=obs)

    def cut_behind(self, now: float) -> None:
        """The completed steps of workers silent for BEHIND_ROUNDS of the others' messages,
        where the policy moved on (processor/buffers.py), go to the learner while they are
        fresh enough to learn from."""
        if not self.version_spans:
            return
        silent = BEHIND_ROUNDS * len(self.tracks)
        for track in self.tracks.values():
            if self.heard - track.heard_at >= silent:
                for traj in track.cut_behind(self.newest, self.version_spans):
                    self.counts.cut_behind += 1
                    self.emit(traj)

    def stamp_segments(self, now: float) -> None:
        for seg in self.segments.values():
            seg.stamp()  # idle or not, we still read these: slots, not bytes, please

    # -- trajectories out
    def emit(self, traj: p.Trajectory) -> None:
        self.counts.trajectories += 1
        self.counts.episodes += traj.episode_return is not None
        outlet = self.outlets.get(traj.policy)
        if outlet is None:  # a broker --policy-map names a policy we have no endpoint for
            self.counts.unrouted += 1
            if traj.policy not in self.unrouted and len(self.unrouted) < policies.MAX_POLICIES:
                self.unrouted.add(traj.policy)
                self.log.error(
                    "policy %r has no trajectories endpoint here: its trajectories are dropped "
                    "(counted as unrouted). Start the assembler with --policy-endpoints "
                    "%s=ENDPOINT and that policy's trainer with --policy-name %s --trajectories "
                    "ENDPOINT", traj.policy, traj.policy, traj.policy)
            return
        outlet.held.append(self.ledger.number(traj))  # sent with the others, after this pass

    def flush(self, outlet: Outlet) -> None:
        """Hand what is held to the port, as far as it takes it; nothing while a handshake's
        grace lasts (libzmq may not yet have dropped the connection the new one replaces:
        round-robin would lose part of what went to it)."""
        if self.now < outlet.paused_until:
            return
        while outlet.held and self.ports.writable(outlet.port):
            batch = next_batch(outlet.held)
            if not self.send(outlet.port, p.Trajectories.of(batch)):
                return
            for traj in batch:
                outlet.held.popleft()
                self.ledger.sent(traj)

    def on_socket_event(self, port: str, event: int) -> None:
        """A peer of a trajectories port completed its ZeroMQ handshake (with CURVE: was
        authenticated): what was not learned from goes again (at once, or when the resend
        interval ends), and nothing goes to that port for RESEND_GRACE_S. A bare TCP connection
        never gets here: one that does not finish the handshake is no learner, so a port scan
        sends nothing again."""
        if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return
        self.now = self.clock()
        outlet = self.by_events[port]
        self.counts.learner_handshakes += 1
        outlet.paused_until = self.now + RESEND_GRACE_S
        self.at(outlet.pause_timer, outlet.paused_until,
                functools.partial(self.flush_later, outlet))
        if self.now >= outlet.next_resend:
            self.send_unlearned_again(outlet)
        elif outlet.resend_timer not in self.timers:  # handshakes within the interval: one
            self.counts.resends_deferred += 1
            self.at(outlet.resend_timer, outlet.next_resend,
                    functools.partial(self.resend_later, outlet))

    def flush_later(self, outlet: Outlet, now: float) -> None:
        self.now = now
        self.flush(outlet)

    def resend_later(self, outlet: Outlet, now: float) -> None:
        self.now = now
        self.send_unlearned_again(outlet)

    def send_unlearned_again(self, outlet: Outlet) -> None:
        """A learner that disconnected took with it what was queued toward it and what it had
        not learned from. Sent again when a learner has connected: by then libzmq has surely
        dropped the dead connection (sending at the disconnect itself can still land in it)."""
        outlet.last_resend = self.now
        again = self.ledger.take_back(outlet.policy)
        if not again:
            return
        self.counts.resent += len(again)
        self.counts.backlog_resends += 1
        self.log.info("a learner connected to %s: sending %d trajectories not yet learned from "
                      "(again)", outlet.endpoint, len(again))
        outlet.held.extendleft(reversed(again))
        self.flush(outlet)

    # -- receipts in
    def on_receipt(self, peer: bytes, m: p.Receipt) -> None:
        if m.assembler != self.ledger.incarnation:
            return  # meant for the assembler this one replaced
        outlet = self.outlets.get(m.policy)
        if outlet is None:
            self.refuse("bad receipt", f"policy {m.policy[:64]!r}", claims=m.trainer)
            return
        for arr in (m.taken, m.learned):
            if arr.dtype.kind not in "iu" or arr.ndim != 1:
                self.refuse("bad receipt", f"{arr.dtype} {arr.shape}", claims=m.trainer)
                return
        if not -1 <= m.max_policy_lag < 2**53:
            self.refuse("bad receipt", f"max_policy_lag {m.max_policy_lag}", claims=m.trainer)
            return
        if m.max_policy_lag >= 0:
            self.version_spans[m.policy] = max(1, (m.max_policy_lag + 1) // 2)
        if m.incarnation not in outlet.learners:
            self.new_learner(outlet, m)
        elif m.incarnation != outlet.last_learner:
            self.two_learners(outlet, m)
        outlet.last_receipt, outlet.last_learner = self.now, m.incarnation
        self.ledger.receipt(m.taken.tolist(), m.learned.tolist())

    def new_learner(self, outlet: Outlet, m: p.Receipt) -> None:
        of = "" if len(self.outlets) == 1 else f" of policy {m.policy!r}"
        if outlet.learners:
            self.counts.trainer_swaps += 1
            self.last_swap_gap_s = round(self.now - outlet.last_receipt, 3)
            self.log.info("learner %s (incarnation %s)%s took over; %.2fs without a learner "
                          "taking trajectories", m.trainer, m.incarnation, of,
                          self.last_swap_gap_s)
        else:
            self.log.info("learner %s (incarnation %s)%s taking trajectories", m.trainer,
                          m.incarnation, of)
        if len(outlet.learners) > 1000:  # a flood of fake incarnations cannot grow memory
            outlet.learners.clear()
        outlet.learners.add(m.incarnation)

    def two_learners(self, outlet: Outlet, m: p.Receipt) -> None:
        """Receipts from a learner that another one had taken over from: both are alive, each
        taking some of the policy's trajectories (a swap never goes back)."""
        self.counts.learners_interleaved += 1
        outlet.turns += 1
        if (outlet.turns >= TWO_LEARNERS_TURNS
                and self.now - outlet.two_learners_warned >= TWO_LEARNERS_WARNING_S):
            outlet.two_learners_warned = self.now
            self.log.warning("two learners take trajectories from %s (incarnations %s and %s "
                             "send receipts in turn): each gets only some of them; run one "
                             "learner per trajectories endpoint", outlet.endpoint,
                             outlet.last_learner, m.incarnation)

    # -- what the loop asks
    def held(self) -> int:
        return sum(len(outlet.held) for outlet in self.outlets.values())

    def waiting(self) -> int:
        """Trajectories no learner has taken in yet: what the bound applies to."""
        return self.held() + len(self.ledger.untaken)

    def tick(self, now: float) -> float:
        """Send what this pass emitted and what waited for room; then how much intake the next
        pass has room for."""
        for outlet in self.outlets.values():
            self.flush(outlet)
        self.wake_on_writable = {o.port for o in self.outlets.values() if o.held}
        self.room = self.cfg.max_buffered - self.waiting()
        return super().tick(now)

    def holds(self, port: str) -> bool:
        return port == "experience" and self.room <= 0

    def figures(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.counts), "horizon": self.cfg.horizon, "held": self.held(),
                "untaken": len(self.ledger.untaken), "unlearned": len(self.ledger.unlearned),
                "last_swap_gap_s": self.last_swap_gap_s, **self.rejects.figures(),
                "open_agents": sum(len(t.agents) for t in self.tracks.values())}

    # -- shutdown
    def drain_on_stop(self) -> tuple[str, float]:
        return "experience", SHUTDOWN_FLUSH_S  # what the broker sent is not lost

    def on_drained(self) -> tuple[str, float]:
        """Close every open trajectory; the learner keeps taking trajectories in for a moment
        after the shutdown broadcast, and its receipts say when it has them all."""
        for worker in list(self.tracks):
            self.close(worker, "shutdown")
        return "receipts", SHUTDOWN_FLUSH_S

    def awaiting(self) -> bool:
        return self.waiting() > 0

    def finish(self) -> None:
        shm_read = self.counts.shm_read
        self.log.info(
            "assembler stopping (%s): %d trajectories, %d episodes, %d resent, %d never taken "
            "in by a learner, %d taken in but not learned from (a learner's last partial "
            "batch), %d messages refused%s", self.stop_reason, self.counts.trajectories,
            self.counts.episodes, self.counts.resent, self.waiting(),
            len(self.ledger.unlearned) - len(self.ledger.untaken), self.rejects.total,
            f"; {shm_read} observation batches read from shared memory" if shm_read else "")


def run(cfg: Config) -> int:
    log = node.setup_logging("assembler")
    return node.run_role(lambda ctx: open_assembler(ctx, cfg, log), cfg.security,
                         node.StopFlag())


def open_assembler(ctx: zmq.Context, cfg: Config, log: logging.Logger) -> node.Opened:
    """Raises SettingError for a bad --policy-endpoints."""
    try:
        outlet_endpoints = endpoints(cfg.trajectories, cfg.policy_endpoints)
    except ValueError as exc:
        raise SettingError(str(exc)) from None
    link = node.ControllerLink(ctx, role="assembler", name="assembler",
                               controller=cfg.controller, broadcast=cfg.broadcast, log=log,
                               binds={"experience": cfg.experience,
                                      "trajectories": cfg.trajectories,
                                      "receipts": cfg.receipts})
    try:
        sockets = topology.open_role(ctx, Role.ASSEMBLER, topology.endpoints_of(cfg))
        pushes: dict[str, zmq.Socket] = {PortName.TRAJECTORIES: sockets[PortName.TRAJECTORIES]}
        pushes |= {port_name(policy): topology.open_outlet(ctx, endpoint)
                   for policy, endpoint in outlet_endpoints.items()
                   if policy != policies.DEFAULT}
    except BaseException:
        link.close()
        raise
    log.info("assembler: experience on %s, trajectories on %s, receipts on %s, horizon %d",
             cfg.experience, ", ".join(f"{endpoint} ({policy})" if len(pushes) > 1 else endpoint
                                       for policy, endpoint in outlet_endpoints.items()),
             cfg.receipts, cfg.horizon)
    assembler = Assembler(cfg, node.SocketPorts(pushes), log, outlet_endpoints=outlet_endpoints)
    # Completed handshakes only: a raw TCP connection adds no event (and the monitor's
    # queue, which blocks libzmq's I/O thread when full, stays empty under a port scan).
    events = {name + " events": node.Port(sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED), monitor=True) for name, sock in pushes.items()}
    ports = {**events,
             PortName.RECEIPTS: node.Port(sockets[PortName.RECEIPTS], (p.Receipt,)),
             PortName.EXPERIENCE: node.Port(sockets[PortName.EXPERIENCE],
                                            (p.Experience, p.WorkerLost)),
             **{name: node.Port(sock) for name, sock in pushes.items()}}
    return node.Opened(assembler, ports, link,
                       cleanup=functools.partial(_disable_monitors, list(pushes.values())))


def _disable_monitors(sockets: list[zmq.Socket]) -> None:
    for sock in sockets:
        sock.disable_monitor()
