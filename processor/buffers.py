"""Experience buffers: one per global agent id, cut into trajectories.

An EXPERIENCE message carries a worker's step result (reward and done flags for the previous
action, the next observation) plus the action the policy chose on that observation. Pairing them
per agent gives transitions; a trajectory is cut when the episode ends (terminated or truncated,
with the final observation as bootstrap), when the worker reports the agent neither alive nor
done (vanished: truncated, bootstrapping from its last observation), when `horizon` steps
accumulate (bootstrap from the next observation), or when the policy acting next is its
policy's span (`AgentBuffer.spans`) or more versions newer than the trajectory's first step
(bootstrap from the next observation too). A learner drops trajectories acted more than its
`--max-policy-lag` versions before its own, and a row whose env steps slowly (starved of CPU,
or just slow) would otherwise collect a horizon of steps over that many versions; half the
learner's bound is the span, leaving the other half for what stepping may run ahead of the
learner (the broker's credit window). A worker that stops answering (stopped, starved of CPU)
cannot bring the next action that would show the span reached, while other workers' actions
show the policy moving on: once they have answered a few times each meanwhile, its rows'
completed steps are cut (`WorkerTrack.cut_behind`), bootstrapping from the observation the
pending action was chosen on, and that action begins the next trajectory, so only the step
the worker was in can come too late to learn from. A vanished agent, and a truncated row the
worker marks in
`no_final_obs` (an agent that left without an observation, an env that raised), has no
observation after its last step: its bootstrap observation is that step's own, and the
trajectory says `bootstrap_from_last`. Closing a worker's trajectories (`WorkerTrack.close`)
bootstraps from the observation that followed each one's last completed step: the last seen.
Nothing here touches a socket or a counter: the assembler numbers, counts and sends what comes
out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from stepbus.bus import policies, rows
from stepbus.bus import protocol as p
from stepbus.bus.rows import Obs


class AgentBuffer:
    """One agent's steps since its last trajectory. Arrays are allocated anew after each
    trajectory, so what was handed to ZeroMQ is never overwritten."""

    def __init__(self, agent: str, horizon: int, policy: str = policies.DEFAULT) -> None:
        self.agent, self.horizon, self.policy = agent, horizon, policy
        self.n = 0
        self.pending = False  # obs/action at row n chosen, reward not yet seen
        self.arrays: dict[str, np.ndarray] = {}
        self.obs: Obs = {}  # the observations' rows, in the form they travel (bus/rows.py)
        self.episode_return, self.episode_length = 0.0, 0
        self.stats_valid = True  # False when we joined mid-episode (assembler restart)
        self.origin = (-1, -1, -1)  # the trajectory's episode, episode seed, first episode step
        self.state: dict[str, np.ndarray] = {}  # a recurrent model's state before the first step
        self.first_version = 0  # the policy version of the trajectory's first step

    def choose(self, obs: Obs, action: np.ndarray, logp: float, value: float,
               version: int, episode: int = -1, seed: int = -1,
               state: Callable[[], dict[str, np.ndarray]] | None = None) -> None:
        """`state`: the recurrent state the action was chosen from (called only at the
        trajectory's first step, the one state a trajectory keeps)."""
        if self.n == 0:
            self.first_version = version
            self.origin = (episode, seed, self.episode_length if self.stats_valid else -1)
            self.state = state() if state is not None else {}
        if not self.arrays:
            h = self.horizon
            self.obs = rows.empty(obs, h)
            self.arrays = {
                "actions": np.empty((h, *action.shape), action.dtype),
                "logp": np.empty(h, np.float32), "values": np.empty(h, np.float32),
                "rewards": np.empty(h, np.float32), "policy_versions": np.empty(h, np.int64),
            }
        a, n = self.arrays, self.n
        if isinstance(self.obs, np.ndarray):
            self.obs[n] = obs
        else:
            rows.put(self.obs, n, obs)
        a["actions"][n], a["logp"][n], a["values"][n] = action, logp, value
        a["policy_versions"][n] = version
        self.pending = True

    def spans(self, next_version: int, span: int) -> bool:
        """A step acted `next_version` would make this trajectory span `span` versions or
        more (span 0: never)."""
        return self.n > 0 and 0 < span <= next_version - self.first_version

    def complete(self, reward: float) -> None:
        self.arrays["rewards"][self.n] = reward
        self.n += 1
        self.pending = False
        self.episode_return += float(reward)
        self.episode_length += 1

    def take_completed(self, epoch: int) -> p.Trajectory | None:
        """The completed steps as a trajectory (None: none, or no action pending, or a
        recurrent model's, whose next trajectory would need the state the pending action was
        chosen from), bootstrapping from the observation the pending action was chosen on:
        that action begins the next trajectory, in the same episode."""
        if not (self.pending and self.n) or self.state:
            return None
        a, n = self.arrays, self.n
        obs = rows.take(self.obs, n)  # views: `take` leaves these arrays to the trajectory
        action, logp, value = a["actions"][n], float(a["logp"][n]), float(a["values"][n])
        version = int(a["policy_versions"][n])
        episode, seed, _ = self.origin
        traj = self.take(epoch, obs)
        self.choose(obs, action, logp, value, version, episode, seed)
        return traj

    def take(self, epoch: int, bootstrap: Obs, *, terminated: bool = False,
             truncated: bool = False, episode_end: bool = False,
             bootstrap_from_last: bool = False) -> p.Trajectory | None:
        """The trajectory so far (None if empty); the buffer starts afresh.
        `bootstrap_from_last`: `bootstrap` is the last step's own observation (none follows)."""
        traj = None
        if self.n:
            a, n = self.arrays, self.n
            ended = episode_end and self.stats_valid
            traj = p.Trajectory(
                agent=self.agent, epoch=epoch, terminated=terminated, truncated=truncated,
                episode_return=self.episode_return if ended else None,
                episode_length=self.episode_length if ended else None,
                obs=rows.take(self.obs, slice(0, n)), actions=a["actions"][:n],
                logp=a["logp"][:n],
                values=a["values"][:n], rewards=a["rewards"][:n],
                policy_versions=a["policy_versions"][:n],
                # A copy: a view would pin the whole received message (libzmq's 8 KiB
                # receive buffer, or the whole frame) for as long as this waits.
                bootstrap_obs=rows.copy(bootstrap),
                assembler="", seq=-1,  # numbered when sent
                episode=self.origin[0], episode_seed=self.origin[1], episode_step=self.origin[2],
                policy=self.policy, state=self.state, bootstrap_from_last=bootstrap_from_last)
            self.arrays, self.obs = {}, {}
        self.n, self.pending = 0, False
        if episode_end or truncated:
            self.episode_return, self.episode_length, self.stats_valid = 0.0, 0, True
        return traj


def newest_versions(m: p.Experience) -> dict[str, int]:
    """Per policy, the newest version that chose one of m's actions (empty: none chosen)."""
    if m.action is None:
        return {}
    names = m.agent_policies or [policies.DEFAULT]
    if m.policy_versions is None:
        return dict.fromkeys(names, m.policy_version)
    out: dict[str, int] = {}
    for i, version in enumerate(m.policy_versions.tolist()):
        name = names[i % len(names)]
        if version > out.get(name, -1):
            out[name] = version
    return out


def state_row(state: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Row i of each state array, copied: a view would pin the whole received message."""
    return {key: value[i].copy() for key, value in state.items()}


def agent_ids(worker: str, agents: list[str], rows: int, first_env: int = 0) -> list[str]:
    """Global agent ids, one per row: `worker/env` for single-agent envs and
    `worker/env/agent` for multi-agent ones (rows are env-major). A split of a worker names
    its agents as the whole worker does (`worker` its process, `first_env` its offset)."""
    if not agents or rows % len(agents):
        return [f"{worker}/{first_env + i}" for i in range(rows)]
    return [f"{worker}/{first_env + i // len(agents)}/{agents[i % len(agents)]}"
            for i in range(rows)]


@dataclass
class Completed:
    """What one message's rewards completed: steps, agents that vanished, trajectories cut."""

    steps: int = 0
    vanished: int = 0
    spanned: int = 0  # cut because the policy moved on its span of versions
    trajectories: list[p.Trajectory] = field(default_factory=list)


@dataclass
class WorkerTrack:
    """One worker incarnation's agents, from its first message until a reset, a gap, its loss
    or shutdown closes them."""

    incarnation: str
    epoch: int
    agents: list[AgentBuffer]
    last_obs: Obs
    seq: int = 0  # of the last message; the next must be seq + 1 or a reset
    action_shape: tuple | None = None
    heard_at: int = 0  # the assembler's count of messages at its last one

    @classmethod
    def start(cls, m: p.Experience, horizon: int) -> WorkerTrack:
        """A track from m's observations: its rewards belong to actions we never saw."""
        names = m.agent_policies or [policies.DEFAULT]
        ids = agent_ids(m.split_of or m.worker, m.agents, rows.count(m.obs), m.first_env)
        agents = [AgentBuffer(agent, horizon, names[i % len(names)])
                  for i, agent in enumerate(ids)]
        for agent in agents:
            agent.stats_valid = m.first
        return cls(m.incarnation, m.epoch, agents, m.obs)

    def break_with(self, m: p.Experience) -> tuple[str, bool]:
        """Why m cannot continue this track ("" if it can), and whether a message was lost.
        Sequence numbers continue across resets and broker restarts, so a gap is a lost message
        even when m starts afresh."""
        gap = self.incarnation == m.incarnation and m.seq != self.seq + 1
        why = ("reset" if m.first else
               "new incarnation" if self.incarnation != m.incarnation else
               "other shapes" if (rows.layout(self.last_obs) != rows.layout(m.obs)
                                  or rows.count(self.last_obs) != rows.count(m.obs)) else
               "sequence gap" if gap else "")
        return why, gap

    def complete(self, m: p.Experience, horizon: int,
                 spans: dict[str, int] | None = None) -> Completed:
        """Pair m's rewards with the actions chosen last time; cut what ends, is full, or
        spans too many versions (`spans`: the version span per policy; none: no such cut)."""
        done = m.terminated | m.truncated
        spans = spans or {}
        floor = self.span_floor(m, spans)
        final_rows = (np.cumsum(done) - 1).tolist()
        # Python lists: indexing a numpy array row by row costs more than converting it once.
        ended, terminated, rewards = done.tolist(), m.terminated.tolist(), m.reward.tolist()
        alive = None if m.alive is None else m.alive.tolist()
        unobserved = [False] * len(ended) if m.no_final_obs is None else m.no_final_obs.tolist()
        out = Completed()
        for i, agent in enumerate(self.agents):
            if not agent.pending:
                continue
            agent.complete(rewards[i])
            out.steps += 1
            if ended[i]:
                term = bool(terminated[i])
                traj = agent.take(m.epoch, rows.take(m.final_obs, final_rows[i]), terminated=term,
                                  truncated=not term, episode_end=True,
                                  bootstrap_from_last=unobserved[i] and not term)
            elif alive is not None and not alive[i]:
                # Vanished: neither done nor acting next. Closed, not dropped; the last
                # observation we have of it is its last step's own (no next one came).
                out.vanished += 1
                traj = agent.take(m.epoch, rows.take(self.last_obs, i), truncated=True,
                                  bootstrap_from_last=True)
            elif agent.n >= horizon:
                traj = agent.take(m.epoch, rows.take(m.obs, i))
            elif (floor is not None and agent.first_version <= floor
                  and agent.spans(self.version_of(m, i), spans.get(agent.policy, 0))):
                out.spanned += 1
                traj = agent.take(m.epoch, rows.take(m.obs, i))
            else:
                continue
            if traj is not None:
                out.trajectories.append(traj)
        return out

    @staticmethod
    def span_floor(m: p.Experience, spans: dict[str, int]) -> int | None:
        """No trajectory whose first step is newer than this can reach its span on m's
        actions (None: none can), so most rows cost one compare, not a version lookup."""
        if not spans or m.action is None:
            return None
        versions = m.policy_versions
        newest = int(versions.max()) if versions is not None and versions.size else m.policy_version
        return newest - min(spans.values())

    @staticmethod
    def version_of(m: p.Experience, i: int) -> int:
        """The version acting on m's observation `i`."""
        return int(m.policy_versions[i]) if m.policy_versions is not None else m.policy_version

    @staticmethod
    def next_versions(m: p.Experience) -> list[int] | None:
        """The version acting on each of m's observations (None: m carries no actions)."""
        if m.action is None:
            return None
        if m.policy_versions is not None:
            return m.policy_versions.tolist()
        return [m.policy_version] * rows.count(m.obs)

    def choose(self, m: p.Experience) -> str:
        """Record the actions m carries on its observations; why not ("" if recorded)."""
        if m.action is None or m.logp is None or m.value is None:
            for agent in self.agents:
                agent.pending = False
            return ""
        if self.action_shape is None:
            self.action_shape = (m.action.shape, m.action.dtype)
        elif self.action_shape != (m.action.shape, m.action.dtype):
            return "actions changed shape"
        k = rows.count(m.obs)
        episodes = m.episode.tolist() if m.episode is not None else [-1] * k
        seeds = m.episode_seed.tolist() if m.episode_seed is not None else [-1] * k
        versions = self.next_versions(m) or []
        alive = None if m.alive is None else m.alive.tolist()
        logps, values = m.logp.tolist(), m.value.tolist()
        for i, agent in enumerate(self.agents):
            if alive is None or alive[i]:  # an agent that appears starts here
                agent.choose(rows.take(m.obs, i), m.action[i], logps[i], values[i],
                             versions[i], episodes[i], seeds[i],
                             functools.partial(state_row, m.state, i) if m.state else None)
            else:
                agent.pending = False  # finished, vanished or not there yet
        return ""

    def cut_behind(self, newest: dict[str, int], spans: dict[str, int]) -> list[p.Trajectory]:
        """Every agent's completed steps whose trajectory spans its policy's span counted up
        to `newest` (per policy, the newest version that acted anywhere), while its action
        waits for a result: this worker is behind the others, and the steps it completed are
        learned before they grow stale (module docstring)."""
        out: list[p.Trajectory] = []
        for agent in self.agents:
            span = spans.get(agent.policy, 0)
            if span and newest.get(agent.policy, -1) - agent.first_version >= span:
                traj = agent.take_completed(self.epoch)
                if traj is not None:
                    out.append(traj)
        return out

    def pending(self) -> int:
        """Actions whose results have not come yet."""
        return sum(agent.pending for agent in self.agents)

    def close(self) -> list[p.Trajectory]:
        """Every open trajectory, truncated, bootstrapping from the last observation seen:
        the one that followed its last completed step (an action still awaiting its result is
        dropped with its observation, which then bootstraps)."""
        taken = (agent.take(self.epoch, rows.take(self.last_obs, i), truncated=True)
                 for i, agent in enumerate(self.agents))
        return [traj for traj in taken if traj is not None]
