"""Where trajectories go: one outlet per policy, and the ledger of what no learner has learned
from yet.

Every trajectory is numbered and kept until a learner's RECEIPT says it was learned from:
ZeroMQ silently drops what was queued toward a learner that died, so whenever a learner
completes its ZeroMQ handshake, every trajectory not yet learned from is sent again (same
number; a learner ignores numbers it has already taken in), at most once per
RESEND_INTERVAL_S.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from stepbus.bus import policies, rows, topology
from stepbus.bus import protocol as p

# Trajectories waiting for a learner go out together in one TRAJECTORIES message, up to
# p.MAX_TRAJECTORIES_PER_MESSAGE, and while their observations stay under this many bytes
# (larger ones go alone, zero-copy: concatenating them would copy frames).
MAX_BATCHED_OBS_BYTES = topology.ZERO_COPY_FROM

# At most one backlog resend per outlet within this many seconds: a peer that handshakes over
# and over (a crash-looping learner, or anyone who can complete a ZeroMQ handshake) makes the
# assembler send its backlog at most once per interval, never once per handshake. A handshake
# within the interval is not lost: the backlog goes once more when the interval ends. One second
# is shorter than a learner's restart (0.5 s back-off plus its start-up), so a swap waits for
# nothing but its own handshake.
RESEND_INTERVAL_S = 1.0
# After a handshake nothing goes to the port for this long: a learner that reconnects at once
# (its old connection closed a moment before its new one) could otherwise find part of what is
# sent, the backlog sent again included, spread into the old connection, which libzmq had not
# yet dropped, and lost with it.
RESEND_GRACE_S = 0.1
# Two learners taking one policy's trajectories (each gets some of them) show as receipts from
# incarnations taking turns. A departed learner's last receipt read after its successor's first
# makes two turns, so the warning needs a third; then it comes at most once per this many
# seconds.
TWO_LEARNERS_TURNS = 3
TWO_LEARNERS_WARNING_S = 60.0


def endpoints(trajectories: str, policy_endpoints: str) -> dict[str, str]:
    """Each policy's trajectories endpoint ("default": `trajectories`); ValueError if two
    share one (an ipc path bound twice is taken over)."""
    found = {policies.DEFAULT: trajectories, **policies.parse_endpoints(policy_endpoints)}
    if len(set(found.values())) < len(found):
        raise ValueError(f"--policy-endpoints: each policy needs its own endpoint, not "
                         f"--trajectories' or another's: {policy_endpoints}")
    return found


def port_name(policy: str) -> topology.AnyPort:
    """The name of a policy's PUSH port; its socket monitor's is this plus " events"."""
    return topology.outlet_port(policy, policies.DEFAULT)


@dataclass
class Outlet:
    """One policy's trajectories port, what waits to be handed to it, and its learners."""

    policy: str
    endpoint: str
    held: collections.deque[p.Trajectory] = field(default_factory=collections.deque)
    learners: set[str] = field(default_factory=set)  # incarnations that sent receipts
    last_receipt: float = 0.0  # when the last receipt came
    last_learner: str = ""  # the incarnation that sent it
    turns: int = 0  # receipts from an incarnation seen before, after another's
    last_resend: float = -math.inf  # when the backlog last went out again
    paused_until: float = -math.inf  # a handshake's grace: nothing is sent before then
    two_learners_warned: float = -math.inf

    @property
    def port(self) -> topology.AnyPort:
        return port_name(self.policy)

    @property
    def events(self) -> str:
        """The port of its socket monitor: completed handshakes (unlearned trajectories are
        sent again)."""
        return self.port + " events"

    @property
    def pause_timer(self) -> str:
        """The timer that ends a handshake's grace (RESEND_GRACE_S)."""
        return self.port + " grace"

    @property
    def resend_timer(self) -> str:
        """The timer of a resend put off to the end of RESEND_INTERVAL_S."""
        return self.port + " resend"

    @property
    def next_resend(self) -> float:
        """When the backlog may go out again (at once, if that is past)."""
        return self.last_resend + RESEND_INTERVAL_S


def state_layout(traj: p.Trajectory) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(key, value.dtype.str, value.shape) for key, value in traj.state.items()]


def next_batch(held: collections.deque[p.Trajectory]) -> list[p.Trajectory]:
    """The held trajectories that go out in the next message, oldest first: small ones
    together, within the bounds above; a large one alone."""
    first = held[0]
    batch, obs_bytes, layout = [first], rows.nbytes(first.obs), rows.layout(first.obs)
    for traj in itertools.islice(held, 1, p.MAX_TRAJECTORIES_PER_MESSAGE):
        obs_bytes += rows.nbytes(traj.obs)
        if (obs_bytes > MAX_BATCHED_OBS_BYTES or rows.layout(traj.obs) != layout
                or state_layout(traj) != state_layout(first)
                or traj.actions.dtype != first.actions.dtype
                or traj.actions.shape[1:] != first.actions.shape[1:]):
            break
        batch.append(traj)
    return batch


class Ledger:
    """Trajectory numbers, and the trajectories handed to a socket that no learner has learned
    from yet (kept to be sent again) or taken in yet (what the intake bound counts)."""

    def __init__(self, incarnation: str) -> None:
        self.incarnation = incarnation  # receipts name it: those for a predecessor are ignored
        self.next_seq = 0
        self.unlearned: collections.OrderedDict[int, p.Trajectory] = collections.OrderedDict()
        self.untaken: set[int] = set()

    def number(self, traj: p.Trajectory) -> p.Trajectory:
        traj = dataclasses.replace(traj, assembler=self.incarnation, seq=self.next_seq)
        self.next_seq += 1
        return traj

    def sent(self, traj: p.Trajectory) -> None:
        self.unlearned[traj.seq] = traj
        self.untaken.add(traj.seq)

    def take_back(self, policy: str) -> list[p.Trajectory]:
        """A policy's trajectories not learned from, oldest first, to be sent again."""
        again = [traj for traj in self.unlearned.values() if traj.policy == policy]
        for traj in again:
            del self.unlearned[traj.seq]
            self.untaken.discard(traj.seq)
        return again

    def receipt(self, taken: Iterable[int], learned: Iterable[int]) -> None:
        self.untaken.difference_update(taken)
        for seq in learned:
            self.unlearned.pop(seq, None)
            self.untaken.discard(seq)
