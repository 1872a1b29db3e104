"""The trajectory assembler: one experience buffer per global agent id, cut into trajectories.

An EXPERIENCE message carries a worker's step result (reward and done flags for the previous
action, the next observation) plus the action the policy chose on that observation. Pairing them
per agent gives transitions; a trajectory is emitted when the episode ends (terminated or
truncated, with the final observation as bootstrap) or `horizon` steps accumulate (bootstrap
from the next observation). A worker's new incarnation, a reset, or shutdown closes open
trajectories as truncated, bootstrapping from the last observation seen. Nothing is emitted twice.

Every trajectory is numbered and kept until a learner's RECEIPT says it was learned from:
ZeroMQ silently drops what was queued toward a learner that died, so whenever a learner
connects, every trajectory not yet learned from is sent again (same number; a learner ignores
numbers it has already taken in). Unsent plus sent-but-not-yet-taken-in trajectories are bounded
by `max_buffered`; at the bound the assembler stops taking experience in, the broker's
experience queue fills, and stepping pauses. Nothing is dropped silently.

With several policies (the broker's `--policy-map`), each trajectory goes out on the endpoint of
the policy that acted for its agent (`--policy-endpoints`; "default" uses `--trajectories`), to
that policy's learner.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import zmq
from stepbus.bus import checks, node, policies, shm, wiring
from stepbus.bus import protocol as p
from zmq.utils import monitor

SHUTDOWN_FLUSH_S = 1.0  # how long shutdown waits for a trainer to take the last trajectories
# Trajectories waiting for a learner go out together in one TRAJECTORIES message, up to this
# many, and while their observations stay under this many bytes (larger ones go alone,
# zero-copy: concatenating them would copy frames).
MAX_TRAJECTORIES_PER_MESSAGE = 256
MAX_BATCHED_OBS_BYTES = wiring.ZERO_COPY_FROM


@dataclass
class Config:
    experience: str = wiring.endpoint("experience", "PULL endpoint to bind for the broker")
    trajectories: str = wiring.endpoint("trajectories", "PUSH endpoint to bind for trainers")
    receipts: str = wiring.endpoint("receipts", "PULL endpoint to bind for trainers' receipts")
    controller: str = wiring.endpoint("controller", "controller endpoint to connect")
    broadcast: str = wiring.endpoint("broadcast", "controller broadcast endpoint to connect")
    horizon: int = field(default=32, metadata={"help": "longest trajectory, in steps"})
    max_buffered: int = field(default=10_000, metadata={
        "help": "trajectories no learner has taken in yet (unsent, or queued toward one); at "
                "this bound, intake and so stepping pause"})
    policy_endpoints: str = field(default="", metadata={
        "help": "PUSH endpoints to bind for policies other than 'default' (the broker's "
                "--policy-map), e.g. 'red=tcp://127.0.0.1:7350,blue=tcp://127.0.0.1:7351'"})
    security: wiring.Security = field(default_factory=wiring.Security)


class AgentBuffer:
    """One agent's steps since its last trajectory. Arrays are allocated anew after each
    trajectory, so what was handed to ZeroMQ is never overwritten."""

    def __init__(self, agent: str, horizon: int, policy: str = policies.DEFAULT) -> None:
        self.agent, self.horizon, self.policy = agent, horizon, policy
        self.n = 0
        self.pending = False  # obs/action at row n chosen, reward not yet seen
        self.arrays: dict[str, np.ndarray] = {}
        self.episode_return, self.episode_length = 0.0, 0
        self.stats_valid = True  # False when we joined mid-episode (assembler restart)
        self.origin = (-1, -1, -1)  # the trajectory's episode, episode seed, first episode step

    def choose(self, obs: np.ndarray, action: np.ndarray, logp: float, value: float,
               version: int, episode: int = -1, seed: int = -1) -> None:
        if self.n == 0:
            self.origin = (episode, seed, self.episode_length if self.stats_valid else -1)
        if not self.arrays:
            h = self.horizon
            self.arrays = {
                "obs": np.empty((h, *obs.shape), obs.dtype),
                "actions": np.empty((h, *action.shape), action.dtype),
                "logp": np.empty(h, np.float32), "values": np.empty(h, np.float32),
                "rewards": np.empty(h, np.float32), "policy_versions": np.empty(h, np.int64),
            }
        a, n = self.arrays, self.n
        a["obs"][n], a["actions"][n], a["logp"][n], a["values"][n] = obs, action, logp, value
        a["policy_versions"][n] = version
        self.pending = True

    def complete(self, reward: float) -> None:
        self.arrays["rewards"][self.n] = reward
        self.n += 1
        self.pending = False
        self.episode_return += float(reward)
        self.episode_length += 1

    def take(self, epoch: int, bootstrap: np.ndarray, *, terminated: bool = False,
             truncated: bool = False, episode_end: bool = False) -> p.Trajectory | None:
        """The trajectory so far (None if empty); the buffer starts afresh."""
        traj = None
        if self.n:
            a, n = self.arrays, self.n
            ended = episode_end and self.stats_valid
            traj = p.Trajectory(
                agent=self.agent, epoch=epoch, terminated=terminated, truncated=truncated,
                episode_return=self.episode_return if ended else None,
                episode_length=self.episode_length if ended else None,
                obs=a["obs"][:n], actions=a["actions"][:n], logp=a["logp"][:n],
                values=a["values"][:n], rewards=a["rewards"][:n],
                policy_versions=a["policy_versions"][:n],
                # A copy: a view would pin the whole received message (libzmq's 8 KiB
                # receive buffer, or the whole frame) for as long as this waits.
                bootstrap_obs=bootstrap.copy(),
                assembler="", seq=-1,  # numbered when sent
                episode=self.origin[0], episode_seed=self.origin[1], episode_step=self.origin[2],
                policy=self.policy)
            self.arrays = {}
        self.n, self.pending = 0, False
        if episode_end or truncated:
            self.episode_return, self.episode_length, self.stats_valid = 0.0, 0, True
        return traj


def next_batch(held: collections.deque[p.Trajectory]) -> list[p.Trajectory]:
    """The held trajectories that go out in the next message, oldest first: small ones
    together, within the bounds above; a large one alone."""
    first = held[0]
    batch, obs_bytes = [first], first.obs.nbytes
    for traj in itertools.islice(held, 1, MAX_TRAJECTORIES_PER_MESSAGE):
        obs_bytes += traj.obs.nbytes
        if (obs_bytes > MAX_BATCHED_OBS_BYTES or traj.obs.dtype != first.obs.dtype
                or traj.obs.shape[1:] != first.obs.shape[1:]
                or traj.actions.dtype != first.actions.dtype
                or traj.actions.shape[1:] != first.actions.shape[1:]):
            break
        batch.append(traj)
    return batch


def agent_ids(worker: str, agents: list[str], rows: int) -> list[str]:
    """Global agent ids, one per row: `worker/env` for single-agent envs and
    `worker/env/agent` for multi-agent ones (rows are env-major)."""
    if not agents or rows % len(agents):
        return [f"{worker}/{i}" for i in range(rows)]
    return [f"{worker}/{i // len(agents)}/{agents[i % len(agents)]}" for i in range(rows)]


@dataclass
class Outlet:
    """One policy's trajectories socket, and what waits to be handed to it."""

    policy: str
    endpoint: str
    sock: zmq.Socket
    events: zmq.Socket  # learners connecting (unlearned trajectories are sent again) and leaving
    held: collections.deque[p.Trajectory] = field(default_factory=collections.deque)
    connected: int = 0  # learners connected


@dataclass
class WorkerTrack:
    incarnation: str
    epoch: int
    agents: list[AgentBuffer]
    last_obs: np.ndarray
    seq: int = 0  # of the last message; the next must be seq + 1 or a reset
    action_shape: tuple | None = None


def run(cfg: Config) -> int:
    log = node.setup_logging("assembler")
    try:
        endpoints = {policies.DEFAULT: cfg.trajectories,
                     **policies.parse_endpoints(cfg.policy_endpoints)}
        if len(set(endpoints.values())) < len(endpoints):  # an ipc path bound twice is taken over
            raise ValueError(f"--policy-endpoints: each policy needs its own endpoint, not "
                             f"--trajectories' or another's: {cfg.policy_endpoints}")
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    stop = node.StopFlag()
    ctx = wiring.context(cfg.security)
    link = node.ControllerLink(ctx, role="assembler", name="assembler",
                               controller=cfg.controller, broadcast=cfg.broadcast, log=log,
                               binds={"experience": cfg.experience,
                                      "trajectories": cfg.trajectories,
                                      "receipts": cfg.receipts})
    # A short queue, so a paused intake soon pauses the broker.
    intake = wiring.socket(ctx, zmq.PULL, bind=cfg.experience, rcvhwm=1000)
    outlets: dict[str, Outlet] = {}
    for policy, endpoint in endpoints.items():
        # Beyond 64 queued, trajectories wait in `held` (counted).
        sock = wiring.socket(ctx, zmq.PUSH, bind=endpoint, sndhwm=64)
        events = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        outlets[policy] = Outlet(policy, endpoint, sock, events)
    receipts = wiring.socket(ctx, zmq.PULL, bind=cfg.receipts, max_message_bytes=16 << 20)
    rejects = node.RejectLog(log)
    incarnation = uuid.uuid4().hex[:8]
    tracks: dict[str, WorkerTrack] = {}
    unlearned: collections.OrderedDict[int, p.Trajectory] = collections.OrderedDict()  # sent
    untaken: set[int] = set()  # sent, and no learner has said it took them in
    # Per policy: learner incarnations that sent receipts, and when the last receipt came.
    learners: dict[str, set[str]] = {policy: set() for policy in outlets}
    last_receipt = dict.fromkeys(outlets, 0.0)
    counts = {"steps": 0, "trajectories": 0, "episodes": 0, "closed_truncated": 0, "gaps": 0,
              "resent": 0, "trainer_swaps": 0, "joined_mid_episode": 0, "steps_lost": 0,
              "agents_vanished": 0, "unrouted": 0, "shm_read": 0, "shm_unreadable": 0,
              "shm_mismatch": 0}
    segments: dict[str, shm.Reader] = {}  # worker -> its --shm-frames segment, mapped
    refused_segments: set[str] = set()  # names we could not map (each tried once)
    last_stamp = 0.0
    unrouted: set[str] = set()  # policies without an endpoint, logged once each
    tracks_seen: set[str] = set()  # workers this assembler has had a track for
    last_swap_gap_s: float | None = None
    next_seq = 0
    log.info("assembler: experience on %s, trajectories on %s, receipts on %s, horizon %d",
             cfg.experience, ", ".join(f"{o.endpoint} ({o.policy})" if len(outlets) > 1 else
                                       o.endpoint for o in outlets.values()),
             cfg.receipts, cfg.horizon)

    def emit(traj: p.Trajectory | None) -> None:
        if traj is None:
            return
        counts["trajectories"] += 1
        counts["episodes"] += traj.episode_return is not None
        send(traj)

    def send(traj: p.Trajectory) -> None:
        nonlocal next_seq
        outlet = outlets.get(traj.policy)
        if outlet is None:  # a broker --policy-map names a policy we have no endpoint for
            counts["unrouted"] += 1
            if traj.policy not in unrouted and len(unrouted) < policies.MAX_POLICIES:
                unrouted.add(traj.policy)
                log.error("policy %r has no trajectories endpoint here: its trajectories are "
                          "dropped (counted as unrouted). Start the assembler with "
                          "--policy-endpoints %s=ENDPOINT and that policy's trainer with "
                          "--policy-name %s --trajectories ENDPOINT", traj.policy,
                          traj.policy, traj.policy)
            return
        traj = dataclasses.replace(traj, assembler=incarnation, seq=next_seq)
        next_seq += 1
        outlet.held.append(traj)  # sent with the others held, after this intake round

    def close(name: str, why: str) -> None:
        track = tracks.pop(name)
        if why != "shutdown":  # actions whose results will never come: those steps are lost
            counts["steps_lost"] += sum(agent.pending for agent in track.agents)
        for i, agent in enumerate(track.agents):
            if agent.n:
                counts["closed_truncated"] += 1
            emit(agent.take(track.epoch, track.last_obs[i], truncated=True))
        log.debug("closed %s's trajectories: %s", name, why)

    def segment_of(m: p.Experience) -> shm.Reader | None:
        """The worker's segment, mapped on first sight (the broker names it in every message
        once it maps it), and stamped on every use, which tells the broker to send slot
        numbers (a long intake round must not let the stamp go stale)."""
        seg = segments.get(m.worker)
        if seg is None or seg.name != m.shm:
            segments.pop(m.worker, None)
            if m.shm in refused_segments:
                return None
            try:
                seg = shm.Reader(m.shm, m.shm_nonce)
            except shm.Refused as exc:
                if len(refused_segments) < 10_000:
                    refused_segments.add(m.shm)
                log.warning("worker %s: not mapping its shared-memory segment (%s); the broker "
                            "sends its observations on the socket", m.worker, exc)
                return None
            segments[m.worker] = seg
        seg.stamp()
        return seg

    def refuse(m: p.Experience, reason: str, detail: str, why: str) -> None:
        """Count and log a message we cannot use; the worker's open trajectories end there
        (truncated), since the steps in it are lost to them."""
        rejects.refuse(m.worker, p.ProtocolError(reason, detail))
        if m.worker in tracks:
            close(m.worker, why)

    def read_slot(m: p.Experience) -> p.Experience | None:
        """m with its observations copied out of the worker's segment, and the slot released;
        None (counted, the worker's trajectories cut) if they cannot be read intact."""
        seg = segment_of(m) if m.shm else None
        if seg is None:
            counts["shm_unreadable"] += 1
            refuse(m, "shm unreadable", f"slot {m.obs_slot} of a segment we do not map",
                   "observations we cannot read")
            return None
        s = m.obs_slot
        view = (seg.view(s, m.obs.dtype, m.obs.shape[1:])
                if m.obs.ndim >= 1 and m.obs.shape[0] == 0 else None)
        if view is None:
            refuse(m, "bad experience", f"obs_slot {s}", "bad obs_slot")
            return None
        intact = seg.holds(s, m.seq)
        obs = view.copy()
        if not (intact and seg.holds(s, m.seq)):  # rewritten before or while we copied
            counts["shm_mismatch"] += 1
            refuse(m, "shm mismatch", f"slot {s} no longer holds batch {m.seq}",
                   "shared-memory slot rewritten")
            return None
        seg.release(s, m.seq)
        counts["shm_read"] += 1
        return dataclasses.replace(m, obs=obs)

    def on_experience(m: p.Experience) -> None:
        if m.obs_slot != -1:
            read = read_slot(m)
            if read is None:
                return
            m = read
        elif m.shm:
            segment_of(m)  # map and stamp it: the broker sends slot numbers once we do
        problem = checks.experience_problem(m)
        if problem:
            refuse(m, "bad experience", problem, "bad experience")
            return
        k = m.obs.shape[0]
        track = tracks.get(m.worker)
        if track is not None:
            # Sequence numbers continue across resets and broker restarts, so a gap is a lost
            # message even when this one starts afresh.
            gap = track.incarnation == m.incarnation and m.seq != track.seq + 1
            counts["gaps"] += gap
            why = ("reset" if m.first else
                   "new incarnation" if track.incarnation != m.incarnation else
                   "other shapes" if track.last_obs.shape != m.obs.shape else
                   "sequence gap" if gap else "")
            if why:
                close(m.worker, why)
                track = None
        if track is None:  # rewards in m belong to actions we never saw: start from its obs
            if not m.first and m.worker not in tracks_seen:
                # Steps before this one went to an assembler that is gone (this one restarted).
                counts["joined_mid_episode"] += k
            tracks_seen.add(m.worker)
            names = m.agent_policies or [policies.DEFAULT]
            agents = [AgentBuffer(agent, cfg.horizon, names[i % len(names)])
                      for i, agent in enumerate(agent_ids(m.worker, m.agents, k))]
            for agent in agents:
                agent.stats_valid = m.first
            track = tracks[m.worker] = WorkerTrack(m.incarnation, m.epoch, agents, m.obs)
        else:
            done = m.terminated | m.truncated
            final_rows = np.cumsum(done) - 1
            for i, agent in enumerate(track.agents):
                if not agent.pending:
                    continue
                agent.complete(m.reward[i])
                counts["steps"] += 1
                if done[i]:
                    term = bool(m.terminated[i])
                    emit(agent.take(m.epoch, m.final_obs[final_rows[i]], terminated=term,
                                    truncated=not term, episode_end=True))
                elif m.alive is not None and not m.alive[i]:
                    # Vanished: neither done nor acting next. Closed, not dropped, and
                    # bootstrapped from the last observation we have of it.
                    counts["agents_vanished"] += 1
                    emit(agent.take(m.epoch, track.last_obs[i], truncated=True))
                elif agent.n >= cfg.horizon:
                    emit(agent.take(m.epoch, m.obs[i]))
        track.last_obs, track.epoch, track.seq = m.obs, m.epoch, m.seq
        if m.action is not None and m.logp is not None and m.value is not None:
            if track.action_shape is None:
                track.action_shape = (m.action.shape, m.action.dtype)
            elif track.action_shape != (m.action.shape, m.action.dtype):
                refuse(m, "bad experience", "actions changed shape", "actions changed shape")
                return
            episodes = (m.episode.tolist() if m.episode is not None else [-1] * k)
            seeds = (m.episode_seed.tolist() if m.episode_seed is not None else [-1] * k)
            versions = (m.policy_versions.tolist() if m.policy_versions is not None
                        else [m.policy_version] * k)
            for i, agent in enumerate(track.agents):
                if m.alive is None or m.alive[i]:  # an agent that appears starts here
                    agent.choose(m.obs[i], m.action[i], m.logp[i], m.value[i],
                                 versions[i], episodes[i], seeds[i])
                else:
                    agent.pending = False  # finished, vanished or not there yet
        else:
            for agent in track.agents:
                agent.pending = False

    def on_worker_lost(msg: p.WorkerLost) -> None:
        track = tracks.get(msg.worker)
        if track is not None and track.incarnation == msg.incarnation:
            close(msg.worker, f"worker lost: {msg.reason}")
        seg = segments.get(msg.worker)
        if seg is not None and seg.name == shm.segment_name(msg.worker, msg.incarnation):
            del segments[msg.worker]

    intake_handlers = {p.Experience: on_experience, p.WorkerLost: on_worker_lost}

    def take_one() -> None:
        node.handle(intake, rejects, intake_handlers, "broker")

    def flush_held(outlet: Outlet) -> None:
        while outlet.held and outlet.sock.get(zmq.EVENTS) & zmq.POLLOUT:
            batch = next_batch(outlet.held)
            if not node.send(outlet.sock, p.Trajectories.of(batch), block=False):
                return
            for traj in batch:
                outlet.held.popleft()
                unlearned[traj.seq] = traj
                untaken.add(traj.seq)

    def send_unlearned_again(outlet: Outlet) -> None:
        """A learner that disconnected took with it what was queued toward it and what it had
        not learned from. Sent again when a learner connects: by then libzmq has surely
        dropped the dead connection (sending at the disconnect itself can still land in it)."""
        again = [traj for traj in unlearned.values() if traj.policy == outlet.policy]
        if not again:
            return
        counts["resent"] += len(again)
        log.info("a learner connected to %s: sending %d trajectories not yet learned from "
                 "(again)", outlet.endpoint, len(again))
        for traj in again:
            del unlearned[traj.seq]
            untaken.discard(traj.seq)
        outlet.held.extendleft(reversed(again))
        flush_held(outlet)

    def on_outlet_event(outlet: Outlet) -> None:
        event = monitor.recv_monitor_message(outlet.events, zmq.NOBLOCK)["event"]
        if event == zmq.EVENT_ACCEPTED:
            outlet.connected += 1
            if outlet.connected == 2:
                log.warning("two learners connected to %s: each trajectory goes to one of "
                            "them; run one learner per trajectories endpoint", outlet.endpoint)
            send_unlearned_again(outlet)
        elif event == zmq.EVENT_DISCONNECTED:
            outlet.connected = max(0, outlet.connected - 1)

    def on_receipt(m: p.Receipt) -> None:
        nonlocal last_swap_gap_s
        if m.assembler != incarnation:
            return  # meant for the assembler this one replaced
        if m.policy not in outlets:
            rejects.refuse(m.trainer, p.ProtocolError("bad receipt", f"policy {m.policy[:64]!r}"))
            return
        for arr in (m.taken, m.learned):
            if arr.dtype.kind not in "iu" or arr.ndim != 1:
                rejects.refuse(m.trainer,
                               p.ProtocolError("bad receipt", f"{arr.dtype} {arr.shape}"))
                return
        now = time.monotonic()
        known = learners[m.policy]
        of = "" if len(outlets) == 1 else f" of policy {m.policy!r}"
        if m.incarnation not in known:
            if known:
                counts["trainer_swaps"] += 1
                last_swap_gap_s = round(now - last_receipt[m.policy], 3)
                log.info("learner %s (incarnation %s)%s took over; %.2fs without a learner "
                         "taking trajectories", m.trainer, m.incarnation, of, last_swap_gap_s)
            else:
                log.info("learner %s (incarnation %s)%s taking trajectories", m.trainer,
                         m.incarnation, of)
            if len(known) > 1000:  # a flood of fake incarnations cannot grow memory
                known.clear()
            known.add(m.incarnation)
        last_receipt[m.policy] = now
        untaken.difference_update(m.taken.tolist())
        for seq in m.learned.tolist():
            unlearned.pop(seq, None)
            untaken.discard(seq)

    def flush_all() -> None:
        for outlet in outlets.values():
            flush_held(outlet)

    def take_receipts() -> None:
        node.handle(receipts, rejects, {p.Receipt: on_receipt}, "trainer")

    def held() -> int:
        return sum(len(outlet.held) for outlet in outlets.values())

    def waiting() -> int:
        """Trajectories no learner has taken in yet: what the bound applies to."""
        return held() + len(untaken)

    def figures() -> dict:
        return {**counts, "held": held(), "untaken": len(untaken), "unlearned": len(unlearned),
                "last_swap_gap_s": last_swap_gap_s, **rejects.figures(),
                "open_agents": sum(len(t.agents) for t in tracks.values())}

    poller = zmq.Poller()
    for sock in (*link.sockets(), receipts, *(o.events for o in outlets.values())):
        poller.register(sock, zmq.POLLIN)
    try:
        while not stop and not link.shutdown_reason:
            now = time.monotonic()
            next_beat = link.beat(now, figures)
            if segments and now - last_stamp >= shm.READER_STAMP_S:
                last_stamp = now
                for seg in segments.values():
                    seg.stamp()  # idle or not, we still read these: slots, not bytes, please
            # Backpressure: while too much waits for a learner, stop taking experience in.
            room = cfg.max_buffered - waiting()
            poller.register(intake, zmq.POLLIN if room > 0 else 0)
            for outlet in outlets.values():
                poller.register(outlet.sock, zmq.POLLOUT if outlet.held else 0)
            events = dict(poller.poll(max(0, min((next_beat - now) * 1000, node.MAX_POLL_MS))))
            link.poll(events)
            for outlet in outlets.values():
                if outlet.events in events:
                    node.drain(outlet.events, lambda o=outlet: on_outlet_event(o))
            if receipts in events:
                node.drain(receipts, take_receipts)
            if intake in events:
                node.drain(intake, take_one, limit=min(1000, max(1, room)))
            flush_all()  # what this round emitted, and what waited for room
        deadline = time.monotonic() + SHUTDOWN_FLUSH_S  # what the broker sent is not lost
        while intake.poll(0, zmq.POLLIN) and time.monotonic() < deadline:
            node.drain(intake, take_one)
        for name in list(tracks):
            close(name, "shutdown")
        # The learner keeps taking trajectories in for a moment after the shutdown broadcast.
        deadline = time.monotonic() + SHUTDOWN_FLUSH_S
        while waiting() and time.monotonic() < deadline:
            flush_all()
            if receipts.poll(50, zmq.POLLIN):
                node.drain(receipts, take_receipts)
        log.info("assembler stopping (%s): %d trajectories, %d episodes, %d resent, %d never "
                 "taken in by a learner, %d taken in but not learned from (a learner's last "
                 "partial batch), %d messages refused%s", link.shutdown_reason or stop.reason,
                 counts["trajectories"], counts["episodes"], counts["resent"], waiting(),
                 len(unlearned) - len(untaken), rejects.total,
                 f"; {counts['shm_read']} observation batches read from shared memory"
                 if counts["shm_read"] else "")
        return 0
    finally:
        for outlet in outlets.values():
            outlet.sock.disable_monitor()
        link.close()
        wiring.destroy(ctx, wiring.LINGER_MS)
