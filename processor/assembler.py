"""The trajectory assembler: one experience buffer per global agent id, cut into trajectories.

An EXPERIENCE message carries a worker's step result (reward and done flags for the previous
action, the next observation) plus the action the policy chose on that observation. Pairing them
per agent gives transitions; a trajectory is emitted when the episode ends (terminated or
truncated, with the final observation as bootstrap) or `horizon` steps accumulate (bootstrap
from the next observation). A worker's new incarnation, a reset, or shutdown closes open
trajectories as truncated, bootstrapping from the last observation seen. Nothing is emitted twice.

Every trajectory is numbered and kept until a trainer's RECEIPT names it: ZeroMQ silently drops
what was queued toward a trainer that died, so when a new trainer incarnation starts receipting,
whatever was sent before its first trajectory and never receipted went down with the old one and
is sent again (renumbered). Kept plus unsent trajectories are bounded by `max_buffered`; at the
bound the assembler stops taking experience in, the broker's experience queue fills, and stepping
pauses. Nothing is dropped silently.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import zmq
from stepbus.bus import checks, node, wiring
from stepbus.bus import protocol as p

SHUTDOWN_FLUSH_S = 1.0  # how long shutdown waits for a trainer to take the last trajectories


@dataclass
class Config:
    experience: str = wiring.endpoint("experience", "PULL endpoint to bind for the broker")
    trajectories: str = wiring.endpoint("trajectories", "PUSH endpoint to bind for trainers")
    receipts: str = wiring.endpoint("receipts", "PULL endpoint to bind for trainers' receipts")
    controller: str = wiring.endpoint("controller", "controller endpoint to connect")
    broadcast: str = wiring.endpoint("broadcast", "controller broadcast endpoint to connect")
    horizon: int = field(default=32, metadata={"help": "longest trajectory, in steps"})
    max_buffered: int = field(default=10_000, metadata={
        "help": "trajectories kept until a trainer receipts them (or unsent while no trainer "
                "is connected); at this bound, intake and so stepping pause"})


class AgentBuffer:
    """One agent's steps since its last trajectory. Arrays are allocated anew after each
    trajectory, so what was handed to ZeroMQ is never overwritten."""

    def __init__(self, agent: str, horizon: int) -> None:
        self.agent, self.horizon = agent, horizon
        self.n = 0
        self.pending = False  # obs/action at row n chosen, reward not yet seen
        self.arrays: dict[str, np.ndarray] = {}
        self.episode_return, self.episode_length = 0.0, 0
        self.stats_valid = True  # False when we joined mid-episode (assembler restart)

    def choose(self, obs: np.ndarray, action: np.ndarray, logp: float, value: float,
               version: int) -> None:
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
                policy_versions=a["policy_versions"][:n], bootstrap_obs=bootstrap,
                assembler="", seq=-1)  # numbered when sent
            self.arrays = {}
        self.n, self.pending = 0, False
        if episode_end or truncated:
            self.episode_return, self.episode_length, self.stats_valid = 0.0, 0, True
        return traj


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
    stop = node.StopFlag()
    ctx = zmq.Context()
    link = node.ControllerLink(ctx, role="assembler", name="assembler",
                               controller=cfg.controller, broadcast=cfg.broadcast, log=log)
    intake = wiring.socket(ctx, zmq.PULL, bind=cfg.experience)
    outlet = wiring.socket(ctx, zmq.PUSH, bind=cfg.trajectories)
    outlet.setsockopt(zmq.SNDHWM, 64)  # beyond this, trajectories wait in `held` (counted)
    receipts = wiring.socket(ctx, zmq.PULL, bind=cfg.receipts, max_message_bytes=16 << 20)
    rejects = node.RejectLog(log)
    incarnation = uuid.uuid4().hex[:8]
    tracks: dict[str, WorkerTrack] = {}
    held: collections.deque[p.Trajectory] = collections.deque()  # not yet handed to ZeroMQ
    unreceipted: collections.OrderedDict[int, p.Trajectory] = collections.OrderedDict()
    trainers: dict[str, int] = {}  # trainer incarnation -> the first seq it receipted
    swap = {"trainer": "", "last_receipt": 0.0}
    counts = {"steps": 0, "trajectories": 0, "episodes": 0, "closed_truncated": 0, "gaps": 0,
              "resent": 0, "trainer_swaps": 0, "joined_mid_episode": 0, "steps_lost": 0}
    tracks_seen: set[str] = set()  # workers this assembler has had a track for
    last_swap_gap_s: float | None = None
    next_seq = 0
    log.info("assembler: experience on %s, trajectories on %s, receipts on %s, horizon %d",
             cfg.experience, cfg.trajectories, cfg.receipts, cfg.horizon)

    def emit(traj: p.Trajectory | None) -> None:
        if traj is None:
            return
        counts["trajectories"] += 1
        counts["episodes"] += traj.episode_return is not None
        send(traj)

    def send(traj: p.Trajectory) -> None:
        nonlocal next_seq
        traj = dataclasses.replace(traj, assembler=incarnation, seq=next_seq)
        next_seq += 1
        if held or not node.send(outlet, traj, block=False):
            held.append(traj)
        else:
            unreceipted[traj.seq] = traj

    def close(name: str, why: str) -> None:
        track = tracks.pop(name)
        if why != "shutdown":  # actions whose results will never come: those steps are lost
            counts["steps_lost"] += sum(agent.pending for agent in track.agents)
        for i, agent in enumerate(track.agents):
            if agent.n:
                counts["closed_truncated"] += 1
            emit(agent.take(track.epoch, track.last_obs[i], truncated=True))
        log.debug("closed %s's trajectories: %s", name, why)

    def on_experience(m: p.Experience) -> None:
        problem = checks.experience_problem(m)
        if problem:
            rejects.refuse(m.worker, p.ProtocolError("bad experience", problem))
            if m.worker in tracks:
                close(m.worker, "bad experience")
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
            agents = [AgentBuffer(f"{m.worker}/{i}", cfg.horizon) for i in range(k)]
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
                elif agent.n >= cfg.horizon:
                    emit(agent.take(m.epoch, m.obs[i]))
        track.last_obs, track.epoch, track.seq = m.obs, m.epoch, m.seq
        if m.action is not None and m.logp is not None and m.value is not None:
            if track.action_shape is None:
                track.action_shape = (m.action.shape, m.action.dtype)
            elif track.action_shape != (m.action.shape, m.action.dtype):
                rejects.refuse(m.worker, p.ProtocolError("bad experience", "actions changed shape"))
                close(m.worker, "actions changed shape")
                return
            for i, agent in enumerate(track.agents):
                agent.choose(m.obs[i], m.action[i], m.logp[i], m.value[i], m.policy_version)
        else:
            for agent in track.agents:
                agent.pending = False

    def take_one() -> None:
        _, msg = node.recv(intake, rejects)
        if isinstance(msg, p.Experience):
            on_experience(msg)
        elif isinstance(msg, p.WorkerLost):
            track = tracks.get(msg.worker)
            if track is not None and track.incarnation == msg.incarnation:
                close(msg.worker, f"worker lost: {msg.reason}")
        elif msg is not None:
            rejects.refuse("broker", p.ProtocolError("unexpected kind", msg.KIND.name))

    def flush_held() -> None:
        while held and node.send(outlet, held[0], block=False):
            traj = held.popleft()
            unreceipted[traj.seq] = traj

    def on_receipt(m: p.Receipt) -> None:
        nonlocal last_swap_gap_s
        if (m.assembler != incarnation or m.seqs.dtype.kind not in "iu" or m.seqs.ndim != 1
                or not m.seqs.size):
            return  # meant for the assembler this one replaced, or empty: nothing to free
        now = time.monotonic()
        if m.incarnation not in trainers:
            if len(trainers) > 1000:
                trainers.clear()  # only the current trainer's first seq matters
            trainers[m.incarnation] = int(m.seqs.min())
            if swap["trainer"]:
                counts["trainer_swaps"] += 1
                last_swap_gap_s = round(now - swap["last_receipt"], 3)
                log.info("trainer %s (incarnation %s) took over; %.2fs without a trainer "
                         "taking trajectories", m.trainer, m.incarnation, last_swap_gap_s)
            else:
                log.info("trainer %s (incarnation %s) taking trajectories", m.trainer,
                         m.incarnation)
            swap["trainer"] = m.incarnation
        swap["last_receipt"] = now
        for seq in m.seqs.tolist():
            unreceipted.pop(seq, None)
        # Sent before this trainer's first one and never receipted: lost with an earlier trainer.
        first = trainers[m.incarnation]
        lost = []
        while unreceipted:
            seq = next(iter(unreceipted))
            if seq >= first:
                break
            lost.append(unreceipted.pop(seq))
        if lost:
            counts["resent"] += len(lost)
            log.info("resending %d trajectories a previous trainer never receipted", len(lost))
            for traj in lost:
                send(traj)

    def take_receipts() -> None:
        _, msg = node.recv(receipts, rejects)
        if isinstance(msg, p.Receipt):
            on_receipt(msg)
        elif msg is not None:
            rejects.refuse("trainer", p.ProtocolError("unexpected kind", msg.KIND.name))

    def kept() -> int:
        return len(held) + len(unreceipted)

    def figures() -> dict:
        return {**counts, "held": len(held), "unreceipted": len(unreceipted),
                "last_swap_gap_s": last_swap_gap_s, **rejects.figures(),
                "open_agents": sum(len(t.agents) for t in tracks.values())}

    poller = zmq.Poller()
    for sock in (*link.sockets(), receipts):
        poller.register(sock, zmq.POLLIN)
    try:
        while not stop and not link.shutdown_reason:
            now = time.monotonic()
            next_beat = link.beat(now, figures)
            # Backpressure: while too much is kept, stop taking experience in.
            poller.register(intake, zmq.POLLIN if kept() < cfg.max_buffered else 0)
            poller.register(outlet, zmq.POLLOUT if held else 0)
            events = dict(poller.poll(max(0, min((next_beat - now) * 1000, node.MAX_POLL_MS))))
            link.poll(events)
            if receipts in events:
                node.drain(receipts, take_receipts)
            if outlet in events:
                flush_held()
            if intake in events:
                node.drain(intake, take_one)
        node.drain(intake, take_one)  # what the broker already sent is not lost
        for name in list(tracks):
            close(name, "shutdown")
        # The trainer keeps taking trajectories for a moment after the shutdown broadcast.
        deadline = time.monotonic() + SHUTDOWN_FLUSH_S
        while kept() and time.monotonic() < deadline:
            flush_held()
            if receipts.poll(50, zmq.POLLIN):
                node.drain(receipts, take_receipts)
        log.info("assembler stopping (%s): %d trajectories, %d episodes, %d resent, %d never "
                 "receipted by a trainer, %d messages refused",
                 link.shutdown_reason or stop.reason, counts["trajectories"], counts["episodes"],
                 counts["resent"], kept(), rejects.total)
        return 0
    finally:
        link.close()
        ctx.destroy(linger=wiring.LINGER_MS)
