"""The broker's table of workers: who is connected, what each is doing, and what the broker
must remember of the ones it lost.

A worker joins with a hello and is known by its ROUTER identity; a hello with a new
incarnation under the same identity is a restart. A worker silent for the liveness timeout is
forgotten, and so is one the socket cannot reach. The sequence number last used with a
forgotten worker is remembered, so that its next incarnation is numbered above anything
either side used. Hellos that come before the controller has told a new broker the run's
epoch wait here. A worker's shared-memory segment (`--shm-frames`) is mapped while it is in
the table and unmapped (removed, if its worker is dead) when it leaves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from stepbus.bus import node, policies, shm
from stepbus.bus import protocol as p

LIVENESS_S = node.LIVENESS_S
MAX_DEFERRED_HELLOS = 1000  # hellos are untrusted: a flood of names cannot grow memory
MAX_REMEMBERED_WORKERS = 10_000  # lost workers whose last sequence number we keep


@dataclass
class Worker:
    ident: bytes
    name: str
    incarnation: str
    num_envs: int  # rows: envs, or envs x agents for multi-agent envs
    last_seen: float
    agents: list[str]  # a multi-agent env's possible agents ([] for Gymnasium envs)
    seq: int = 0  # the seq of the reply we expect next
    in_flight: bool = True  # a RESET or STEP was sent and its reply has not arrived
    stepping: bool = False  # ... and it was a STEP: steps acted for it are counted produced
    result: p.StepResult | None = None  # a reply waiting for inference
    ready_since: float = 0.0
    sent_at: float = 0.0  # when its current STEP was sent
    round_trip_s: float = 0.0  # moving average of STEP -> STEP_RESULT (0: not known yet)
    epoch: int = -1  # the epoch the worker has reset into
    agent_policies: list[str] = field(default_factory=list)  # per agent; [] without a map
    row_policy: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))  # per row
    segment: shm.Reader | None = None  # its --shm-frames segment, if we could map it
    shm_nonce: str = ""
    split_of: str = ""  # a double-buffered worker's split: the process's name (agent ids)
    first_env: int = 0  # ... and the index there of its first env
    # When a send to it first failed (None: it is reachable). Its connection may be being
    # replaced (a reconnect after a freeze, ROUTER_HANDOVER), so it is not lost yet.
    unreachable_since: float | None = None

    def expects(self, msg: p.StepResult) -> bool:
        """`msg` is the reply we wait for (not one from before a reset or a restart)."""
        return self.in_flight and msg.incarnation == self.incarnation and msg.seq == self.seq

    def took_result(self, msg: p.StepResult, now: float) -> None:
        self.epoch, self.result, self.ready_since = msg.epoch, msg, now
        if not msg.first:  # the reply to a STEP: how long this worker takes
            trip = now - self.sent_at
            self.round_trip_s = (trip if not self.round_trip_s
                                 else 0.8 * self.round_trip_s + 0.2 * trip)


class WorkerTable:
    """Workers by ROUTER identity, with the memory of lost ones and the deferred hellos.
    `rules` is the policy map (empty: every agent on the default policy) and `policy_names`
    every policy in order, so each worker row knows the index of the policy acting for it."""

    def __init__(self, rules: list[tuple[str, str]], policy_names: list[str]) -> None:
        self.rules, self.policy_names = rules, policy_names
        self.workers: dict[bytes, Worker] = {}
        self.highest_seq: dict[str, int] = {}  # lost worker name -> the last seq we used
        self.deferred: dict[bytes, p.WorkerHello] = {}  # the latest hello per sender

    def __len__(self) -> int:
        return len(self.workers)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self.workers.values()))

    def get(self, ident: bytes) -> Worker | None:
        return self.workers.get(ident)

    def known_as(self, name: str, incarnation: str) -> bool:
        """A worker of this name and incarnation is in (under any routing id)."""
        return any(w.name == name and w.incarnation == incarnation
                   for w in self.workers.values())

    def join(self, ident: bytes, msg: p.WorkerHello, now: float) -> tuple[Worker, Worker | None]:
        """Enter a worker (a new one, or a new incarnation under a known identity, whose old
        entry is returned so its segment can be let go)."""
        # Number above anything either side used, so no old message can pass for a new one.
        first_seq = (max(msg.seq, self.highest_seq.pop(msg.worker, 0)) if 0 <= msg.seq < 2**62
                     else 0)
        rows = msg.num_envs * max(1, len(msg.agents))
        agent_policies = self.agent_policies(msg.agents)
        old = self.workers.get(ident)
        w = self.workers[ident] = Worker(
            ident, msg.worker, msg.incarnation, rows, now, msg.agents, seq=first_seq,
            ready_since=now, agent_policies=agent_policies if self.rules else [],
            row_policy=np.tile([self.policy_names.index(name) for name in agent_policies],
                               msg.num_envs),
            split_of=msg.split_of, first_env=msg.first_env)
        return w, old

    def agent_policies(self, agents: list[str]) -> list[str]:
        """The policy of each agent (of the one unnamed agent of a Gymnasium env)."""
        return [policies.policy_of(agent, self.rules) for agent in agents or [""]]

    def forget(self, w: Worker) -> bool:
        """Take a worker out, remembering its sequence number; False if it was not in."""
        if self.workers.pop(w.ident, None) is None:
            return False
        if len(self.highest_seq) < MAX_REMEMBERED_WORKERS:
            self.highest_seq[w.name] = w.seq
        return True

    def heard_from_all(self, now: float) -> None:
        """After the broker itself stalled, nobody's silence can be told from its own."""
        for w in self.workers.values():
            w.last_seen = now
            if w.unreachable_since is not None:
                w.unreachable_since = now

    def silent(self, now: float) -> list[tuple[Worker, str]]:
        """Workers not heard from, or not reachable, for the liveness timeout, and why."""
        lost = []
        for w in self.workers.values():
            if now - w.last_seen > LIVENESS_S:
                lost.append((w, f"silent for {now - w.last_seen:.1f}s"))
            elif w.unreachable_since is not None and now - w.unreachable_since > LIVENESS_S:
                lost.append((w, f"unreachable for {now - w.unreachable_since:.1f}s"))
        return lost

    def rows_per_policy(self, count: int) -> list[int]:
        """Rows of live workers each of `count` policies acts for."""
        rows = [0] * count
        for w in self.workers.values():
            for k, n in enumerate(np.bincount(w.row_policy, minlength=count).tolist()):
                rows[k] += n
        return rows

    def ready(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.result is not None]

    def in_flight(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.in_flight]

    def epochs(self) -> list[int]:
        return [w.epoch for w in self.workers.values()]

    # -- hellos that wait for the run state
    def defer(self, ident: bytes, msg: p.WorkerHello) -> bool:
        """Keep a hello (the latest per sender, a bounded number of senders) until the run
        state is known; True for a sender not deferred before (worth a log line)."""
        new = ident not in self.deferred and len(self.deferred) < MAX_DEFERRED_HELLOS
        if new or ident in self.deferred:
            self.deferred[ident] = msg
        return new

    def take_deferred(self) -> list[tuple[bytes, p.WorkerHello]]:
        taken = list(self.deferred.items())
        self.deferred.clear()
        return taken

    # -- shared-memory segments
    @staticmethod
    def attach(w: Worker, msg: p.WorkerHello) -> str:
        """Map w's shared-memory segment if it has one we can read: same host, same uid, the
        hello's nonce. Otherwise its observations keep coming on the socket, and this says
        why (empty: mapped, or it has none)."""
        if not msg.shm:
            return ""
        try:
            w.segment, w.shm_nonce = shm.Reader(msg.shm, msg.shm_nonce), msg.shm_nonce
        except shm.Refused as exc:
            return (f"not mapping its shared-memory segment ({exc}); its observations come on "
                    "the socket")
        if w.segment.rows != w.num_envs:
            rows, w.segment = w.segment.rows, None
            return (f"its segment has {rows} rows per slot, not {w.num_envs}; observations come "
                    "on the socket")
        return ""

    @staticmethod
    def detach(w: Worker) -> int:
        """Drop our mapping of w's segment, and the segment itself if its worker is dead;
        how many segments were removed."""
        if w.segment is None:
            return 0
        removed = int(w.segment.remove_if_orphaned())
        w.segment = None
        return removed
