"""The trajectory assembler's state machine in-process: decoded EXPERIENCE, WORKER_LOST and
RECEIPT messages in, TRAJECTORIES sends read back from an outbox, time from an explicit clock.
The wiring (sockets, decoding, signals, the shutdown flush) is in test_assembler; faults of
real processes in test_worker_faults, test_broker_faults and test_trainer_slot."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import pytest
import zmq

from stepbus.bus import node
from stepbus.bus import protocol as p
from stepbus.processor import assembler, buffers, outlets

T0 = 1000.0


class Script:
    """Builds EXPERIENCE messages for one worker; obs rows are [env, t] so tests can check them.
    With `agents`, rows are agents (env-major) and `alive` says which act."""

    def __init__(self, worker: str = "w", k: int = 1, incarnation: str = "i1",
                 agents: list[str] | None = None, epoch: int = 0) -> None:
        self.worker, self.k, self.incarnation = worker, k, incarnation
        self.agents, self.epoch = agents or [], epoch
        self.seq, self.t = 0, np.zeros(k)

    def obs(self) -> np.ndarray:
        return np.stack([np.arange(self.k, dtype=np.float32), self.t.astype(np.float32)], 1)

    def first(self) -> p.Experience:
        self.seq, self.t = 0, np.zeros(self.k)
        return self._msg(first=True, reward=np.zeros(self.k, np.float32))

    def step(self, reward: float | list[float] = 1.0, *, terminated: Sequence[int] = (),
             truncated: Sequence[int] = (), act: bool = True, alive: list[bool] | None = None
             ) -> p.Experience:
        self.seq += 1
        self.t += 1
        term = np.isin(np.arange(self.k), terminated)
        trunc = np.isin(np.arange(self.k), truncated)
        final = self.obs()[term | trunc]
        final[:, 1] += 1000  # a final obs is distinguishable from the autoreset obs
        self.t[term | trunc] = 0  # autoreset
        return self._msg(reward=np.broadcast_to(np.asarray(reward, np.float32), (self.k,)).copy(),
                         terminated=term, truncated=trunc, final_obs=final, act=act,
                         alive=alive)

    def _msg(self, *, first: bool = False, reward: np.ndarray, terminated: np.ndarray | None = None,
             truncated: np.ndarray | None = None, final_obs: np.ndarray | None = None,
             act: bool = True, alive: list[bool] | None = None) -> p.Experience:
        k = self.k
        return p.Experience(
            worker=self.worker, incarnation=self.incarnation, epoch=self.epoch, seq=self.seq,
            first=first, policy_version=7 if act else -1, obs=self.obs(), reward=reward,
            terminated=terminated if terminated is not None else np.zeros(k, bool),
            truncated=truncated if truncated is not None else np.zeros(k, bool),
            final_obs=final_obs if final_obs is not None else np.zeros((0, 2), np.float32),
            action=np.arange(k, dtype=np.int64) if act else None,
            logp=np.full(k, -0.5, np.float32) if act else None,
            value=np.full(k, 0.25, np.float32) if act else None,
            alive=np.array(alive, bool) if alive is not None else None, agents=self.agents)


class Bench:
    """One assembler object on an outbox, the test playing its broker and learners."""

    def __init__(self, *, horizon: int = 4, blocked: set[str] | None = None,
                 **cfg: object) -> None:
        self.t = T0
        self.out = node.Outbox(blocked)
        config = assembler.Config(horizon=horizon, **cfg)  # type: ignore[arg-type]
        self.asm = assembler.Assembler(
            config, self.out, logging.getLogger("test.assembler"),
            outlet_endpoints=outlets.endpoints(config.trajectories, config.policy_endpoints),
            incarnation="a1", clock=lambda: self.t)

    def feed(self, *messages: p.Message) -> None:
        """Each message as one pass of the loop takes it in: delivered, then what it emitted
        sent."""
        for msg in messages:
            self.asm.deliver(b"", msg, now=self.t)
            self.asm.tick(self.t)

    def messages(self, port: str = "trajectories") -> list[p.Trajectories]:
        return self.out.take(p.Trajectories, port)

    def trajectories(self, port: str = "trajectories") -> list[p.Trajectory]:
        """Every trajectory sent since the last look, in order."""
        return [t for msg in self.messages(port) for t in msg.split()]

    def receipt(self, taken: Sequence[int] = (), learned: Sequence[int] = (), *,
                incarnation: str = "L1", assembler_incarnation: str = "a1",
                max_policy_lag: int = -1) -> p.Receipt:
        return p.Receipt(trainer="learner", incarnation=incarnation,
                         assembler=assembler_incarnation, taken=np.array(taken, np.int64),
                         learned=np.array(learned, np.int64), max_policy_lag=max_policy_lag)


@pytest.fixture
def bench() -> Bench:
    return Bench()


# -- cutting


def test_a_running_episode_is_cut_at_the_horizon_and_bootstraps_from_the_next_obs(bench):
    s = Script()
    bench.feed(s.first(), *[s.step(reward=1.0) for _ in range(9)])
    got = bench.trajectories()
    for start, traj in zip((0, 4), got, strict=True):
        assert isinstance(traj, p.Trajectory)
        assert traj.agent == "w/0"
        assert not traj.terminated and not traj.truncated
        assert isinstance(traj.obs, np.ndarray) and isinstance(traj.bootstrap_obs, np.ndarray)
        assert traj.obs[:, 1].tolist() == [start, start + 1, start + 2, start + 3]
        assert traj.bootstrap_obs.tolist() == [0, start + 4]
        assert traj.rewards.tolist() == [1, 1, 1, 1]
        assert traj.policy_versions.tolist() == [7] * 4
        assert traj.episode_return is None and traj.episode_length is None
    assert len(got) == 2, "the 9th step must wait for the horizon or the episode end"


def test_a_slow_rows_trajectory_is_cut_once_the_policy_moved_on_half_the_learners_bound():
    """Versions move on while a slow env's row collects its horizon: its trajectory is cut
    (bootstrapping from the next observation) before a step would make it span half the
    lag bound its learner's receipts state, so the learner does not drop it as stale."""
    bench, s = Bench(horizon=32), Script(k=2)

    def acted(version: int, msg: p.Experience) -> p.Experience:
        return dataclasses.replace(msg, policy_version=version)

    bench.feed(acted(10, s.first()), acted(10, s.step()), acted(12, s.step()),
               acted(14, s.step()))
    assert bench.trajectories() == [], "no learner has stated its bound: the horizon only"
    bench.feed(bench.receipt(max_policy_lag=2**53))
    assert bench.asm.figures()["rejected"] == 1, "a bound out of range is refused"
    bench.feed(bench.receipt(max_policy_lag=8))  # a span of 4
    bench.feed(acted(15, s.step()))
    got = bench.trajectories()
    assert [t.policy_versions.tolist() for t in got] == [[10, 10, 12, 14]] * 2
    assert [t.bootstrap_obs.tolist() for t in got
            if isinstance(t.bootstrap_obs, np.ndarray)] == [[0, 4], [1, 4]]
    assert not any(t.terminated or t.truncated for t in got)
    assert bench.asm.counts.spanned == 2
    bench.feed(*[acted(18, s.step()) for _ in range(3)])
    assert bench.trajectories() == [], "from 15 on: a span of 3 so far"
    bench.feed(acted(19, s.step()))
    assert [len(t.rewards) for t in bench.trajectories()] == [4, 4]


def test_a_silent_workers_completed_steps_are_cut_while_the_others_move_the_policy_on():
    """A worker stops answering (stopped, starved) while another's actions show the policy
    moving on: once every other worker has answered BEHIND_ROUNDS times meanwhile and its
    trajectories span half the learner's bound, their completed steps go out, bootstrapping
    from the observation its pending action was chosen on; that action begins the next
    trajectory, in the same episode, when the worker answers at last. Silence is counted in
    messages: however long the wall clock says it was, nothing is cut while no other worker
    answered (a batch released after a wait must not cut a worker whose message is queued)."""
    bench, a, b = Bench(horizon=32), Script("a", k=2), Script("b")

    def acted(version: int, msg: p.Experience) -> p.Experience:
        return dataclasses.replace(msg, policy_version=version)

    def looked(*messages: p.Message) -> list[p.Trajectory]:
        bench.t += 1.0
        bench.feed(*messages)
        bench.asm.run_timers(bench.t)
        bench.asm.tick(bench.t)
        return bench.trajectories()

    bench.feed(bench.receipt(max_policy_lag=8))  # a span of 4
    bench.feed(acted(10, a.first()), acted(10, a.step()), acted(11, a.step()))
    assert looked(acted(14, b.first())) == [], "a: silent for seconds, but b answered once"
    rounds = assembler.BEHIND_ROUNDS * 2  # two workers
    for _ in range(rounds - 2):
        assert looked(acted(14, b.step())) == [], "a: b has not answered enough yet"
    got = looked(acted(14, b.step()))
    assert [t.agent for t in got] == ["a/0", "a/1"]
    assert [t.policy_versions.tolist() for t in got] == [[10, 10]] * 2
    assert [t.obs[:, 1].tolist() for t in got if isinstance(t.obs, np.ndarray)] == [[0, 1]] * 2
    assert [t.bootstrap_obs.tolist() for t in got
            if isinstance(t.bootstrap_obs, np.ndarray)] == [[0, 2], [1, 2]], "pending obs"
    assert not any(t.terminated or t.truncated or t.bootstrap_from_last for t in got)
    assert bench.asm.counts.cut_behind == 2 and bench.asm.counts.steps_lost == 0
    assert looked(acted(15, b.step())) == [], "what is pending is not cut again"
    got = looked(acted(16, a.step(terminated=[1])))
    assert [t.agent for t in got] == ["a/0", "a/1"], "a/0: the span rule, a/1: its episode end"
    assert [t.policy_versions.tolist() for t in got] == [[11]] * 2
    assert [t.obs[:, 1].tolist() for t in got
            if isinstance(t.obs, np.ndarray)] == [[2]] * 2, "the pending step began them"
    assert got[1].terminated and got[1].episode_length == 3 and got[1].episode_return == 3.0
    assert [t.episode_step for t in got] == [2, 2], "the same episodes went on"


def test_a_worker_behind_others_whose_policy_did_not_move_on_is_left_alone():
    bench, a, b = Bench(horizon=4), Script("a"), Script("b")
    bench.feed(bench.receipt(max_policy_lag=8))
    bench.feed(a.first(), a.step(), b.first(), *[b.step() for _ in range(20)])
    bench.asm.run_timers(bench.t + 1.0)
    bench.asm.tick(bench.t + 1.0)
    assert [t.agent for t in bench.trajectories()] == ["b/0"] * 5, "b's horizons only"
    assert bench.asm.counts.cut_behind == 0, "every action acted by version 7"


def test_the_newest_versions_are_per_policy_and_a_recurrent_trajectory_is_not_cut_early():
    msg = dataclasses.replace(Script(k=4).first(), agent_policies=["red", "blue"],
                              policy_versions=np.array([5, 9, 6, 8]))
    assert buffers.newest_versions(msg) == {"red": 6, "blue": 9}
    assert buffers.newest_versions(dataclasses.replace(msg, action=None)) == {}
    agent = buffers.AgentBuffer("w/0", horizon=8)
    state = {"h": np.zeros(3, np.float32)}
    agent.choose(np.zeros(2, np.float32), np.int64(0), -0.5, 0.2, 3, state=lambda: state)
    agent.complete(1.0)
    agent.choose(np.ones(2, np.float32), np.int64(1), -0.5, 0.2, 4)
    assert agent.take_completed(0) is None, "the pending step's state is not kept"
    assert agent.n == 1 and agent.pending


def test_a_lone_worker_is_never_behind_itself():
    """With one worker the versions that act are its own: a slow step is cut by its next
    action, as ever, not by the timer."""
    bench, a = Bench(horizon=32), Script("a")
    bench.feed(bench.receipt(max_policy_lag=8))
    bench.feed(a.first(), a.step(), a.step())
    bench.t += 10.0
    bench.asm.run_timers(bench.t)
    bench.asm.tick(bench.t)
    assert bench.trajectories() == [] and bench.asm.counts.cut_behind == 0


def test_truncation_keeps_the_final_observation_for_bootstrapping(bench):
    s = Script()
    bench.feed(s.first(), s.step(), s.step(), s.step(reward=2.0, truncated=[0]))
    [traj] = bench.trajectories()
    assert traj.truncated and not traj.terminated
    assert traj.obs[:, 1].tolist() == [0, 1, 2]
    assert traj.bootstrap_obs.tolist() == [0, 1003], "the final obs, not the autoreset obs"
    assert traj.episode_return == 4.0 and traj.episode_length == 3


def test_termination_is_kept_apart_from_truncation(bench):
    s = Script()
    bench.feed(s.first(), s.step(), s.step(terminated=[0]), s.step(), s.step(terminated=[0]))
    first, second = bench.trajectories()
    assert first.terminated and not first.truncated
    assert first.obs[:, 1].tolist() == [0, 1] and first.episode_length == 2
    assert second.terminated and second.obs[:, 1].tolist() == [0, 1], "a new episode from t=0"


def test_episode_statistics_span_horizon_cuts(bench):
    s = Script()
    bench.feed(s.first(), *[s.step(reward=0.5) for _ in range(5)],
               s.step(reward=0.5, terminated=[0]))
    cut, end = bench.trajectories()
    assert cut.episode_return is None and len(cut.rewards) == 4
    assert end.terminated and len(end.rewards) == 2
    assert end.episode_return == 3.0 and end.episode_length == 6
    assert bench.asm.figures()["episodes"] == 1 and bench.asm.figures()["trajectories"] == 2


def test_agents_of_one_worker_have_their_own_trajectories(bench):
    s = Script(k=3)
    bench.feed(s.first(), s.step(terminated=[1]), s.step(truncated=[2]), s.step(), s.step())
    got = bench.trajectories()
    assert len(got) == 3
    by_agent = {t.agent: t for t in got}
    assert set(by_agent) == {"w/0", "w/1", "w/2"}
    assert by_agent["w/1"].terminated and len(by_agent["w/1"].rewards) == 1
    assert by_agent["w/2"].truncated and len(by_agent["w/2"].rewards) == 2
    assert by_agent["w/0"].obs[:, 0].tolist() == [0, 0, 0, 0], "rows never mix agents"
    assert not by_agent["w/0"].terminated and len(by_agent["w/0"].rewards) == 4


def test_a_vanished_agent_is_closed_as_truncated_not_dropped_and_starts_afresh_if_it_returns(
        bench):
    s = Script(k=2, agents=["a", "b"])
    bench.feed(s.first(), s.step(alive=[True, True]), s.step(alive=[True, True]))
    assert bench.trajectories() == []
    bench.feed(s.step(alive=[True, False]))  # b leaves without a done flag
    [gone] = bench.trajectories()
    assert gone.agent == "w/0/b" and gone.truncated and not gone.terminated
    assert gone.obs[:, 1].tolist() == [0, 1, 2]
    assert gone.bootstrap_obs.tolist() == [1, 2], "the last observation we have of it"
    assert gone.episode_return is None, "no episode end: no statistic"
    assert bench.asm.figures()["agents_vanished"] == 1
    bench.feed(s.step(alive=[True, False]))  # still gone: nothing of it
    [a] = bench.trajectories()
    assert a.agent == "w/0/a" and len(a.rewards) == 4 and not a.truncated
    bench.feed(*[s.step(alive=[True, True]) for _ in range(5)])
    back = [t for t in bench.trajectories() if t.agent == "w/0/b"]
    assert [t.obs[:, 1].tolist() for t in back] == [[5, 6, 7, 8]], "afresh from its return"
    assert bench.asm.figures()["agents_vanished"] == 1


def test_a_vanished_agent_says_it_bootstraps_from_its_last_step_and_no_other_cut_does(bench):
    """A vanished agent's last observation is its last step's own (no next one came): the
    trajectory says so, so a recurrent learner does not feed it twice. Episode ends (either
    flag) and horizon cuts have an observation after their last step and do not say so."""
    s = Script(k=3, agents=["a", "b", "c"])
    bench.feed(s.first(), s.step(alive=[True] * 3))
    bench.feed(s.step(terminated=[0], truncated=[1], alive=[True] * 3))
    ended = {t.agent: t for t in bench.trajectories()}
    assert ended["w/0/a"].terminated and ended["w/0/b"].truncated
    assert not any(t.bootstrap_from_last for t in ended.values()), "episode ends have finals"
    bench.feed(s.step(alive=[True, True, False]))  # c leaves without a done flag
    [gone] = bench.trajectories()
    assert gone.agent == "w/0/c" and gone.truncated and gone.bootstrap_from_last
    assert gone.bootstrap_obs.tolist() == gone.obs[-1].tolist() == [2, 2]
    bench.feed(*[s.step(alive=[True, True, False]) for _ in range(3)])
    cuts = bench.trajectories()
    assert sorted(t.agent for t in cuts) == ["w/0/a", "w/0/b"] and all(
        not (t.terminated or t.truncated) for t in cuts), "horizon cuts"
    assert not any(t.bootstrap_from_last for t in cuts)
    for t in cuts:
        assert t.bootstrap_obs[1] == t.obs[-1, 1] + 1, "the next observation"


def test_an_end_the_worker_saw_no_observation_after_bootstraps_from_its_last_step(bench):
    """The worker marks rows that ended with no observation after their last action (an
    agent that left without one, an env that raised): a truncated one says
    `bootstrap_from_last`; a terminated one needs no bootstrap; marks on rows that did not end
    are refused."""
    s = Script(k=3, agents=["a", "b", "c"])
    bench.feed(s.first(), s.step(alive=[True] * 3))
    marks = np.array([True, True, False])
    bench.feed(dataclasses.replace(s.step(terminated=[0], truncated=[1, 2], alive=[False] * 3),
                                   no_final_obs=marks))
    ended = {t.agent: t for t in bench.trajectories()}
    assert ended["w/0/a"].terminated and not ended["w/0/a"].bootstrap_from_last
    assert ended["w/0/b"].truncated and ended["w/0/b"].bootstrap_from_last
    assert ended["w/0/c"].truncated and not ended["w/0/c"].bootstrap_from_last
    assert bench.asm.figures()["rejected"] == 0
    bench.feed(dataclasses.replace(s.step(alive=[True] * 3), no_final_obs=marks))
    assert bench.asm.figures()["rejected"] == 1, "marks on rows that went on"


@pytest.mark.parametrize("how", ("worker lost", "new incarnation", "reset", "barrier",
                                 "shutdown"))
def test_closed_trajectories_bootstrap_from_the_observation_after_their_last_step(
        bench, how):
    """Closing a worker's trajectories keeps the observation that followed each one's last
    completed step (the action chosen on it is dropped): a real next observation, so the
    trajectory does not say `bootstrap_from_last`."""
    s = Script(k=2)
    bench.feed(s.first(), s.step(), s.step())
    if how == "worker lost":
        bench.feed(p.WorkerLost(worker="w", incarnation="i1", reason="silent"))
    elif how == "new incarnation":
        bench.feed(Script(incarnation="i2").first())
    elif how == "reset":
        bench.feed(s.first())
    elif how == "barrier":
        bench.feed(s.step(act=False), dataclasses.replace(s.first(), epoch=1))
    else:
        bench.asm.on_drained()
        bench.asm.tick(bench.t)
    closed = bench.trajectories()
    assert len(closed) == 2 and all(t.truncated for t in closed)
    for t in closed:
        assert not t.bootstrap_from_last
        assert t.bootstrap_obs[1] == t.obs[-1, 1] + 1, "the observation after the last step"


def test_trajectories_cut_together_go_out_in_one_message_and_each_keeps_its_fields(bench):
    """Batching is what makes small-observation envs fast; nothing may blur in it."""
    s = Script(k=3)
    bench.feed(s.first(), s.step(), s.step(), s.step(reward=[1.0, 2.0, 3.0], terminated=[1]))
    [msg] = bench.messages()
    assert isinstance(msg, p.Trajectories), "env 1's end alone: or all three at the horizon?"
    assert msg.agents == ["w/1"] and msg.lengths == [3] and msg.terminated == [True]
    assert msg.episode_returns == [4.0] and msg.episode_lengths == [3]
    bench.feed(s.step(reward=[5.0, 6.0, 7.0]))  # envs 0 and 2 reach the horizon
    [msg] = bench.messages()
    assert isinstance(msg, p.Trajectories) and msg.agents == ["w/0", "w/2"]
    first, second = msg.split()
    assert (first.seq, second.seq) == (1, 2) and msg.lengths == [4, 4]
    assert isinstance(first.obs, np.ndarray) and isinstance(second.obs, np.ndarray)
    assert isinstance(first.bootstrap_obs, np.ndarray)
    assert isinstance(second.bootstrap_obs, np.ndarray)
    assert first.obs[:, 0].tolist() == [0] * 4 and second.obs[:, 0].tolist() == [2] * 4
    assert first.rewards.tolist() == [1, 1, 1, 5] and second.rewards.tolist() == [1, 1, 3, 7]
    assert first.bootstrap_obs.tolist() == [0, 4] and second.bootstrap_obs.tolist() == [2, 4]
    assert not (first.terminated or first.truncated) and first.episode_return is None


def test_more_trajectories_than_one_message_takes_go_out_in_several():
    bench = Bench(horizon=1)
    s = Script(k=p.MAX_TRAJECTORIES_PER_MESSAGE + 1)
    bench.feed(s.first(), s.step())
    sizes = [len(m.agents) for m in bench.messages()]
    assert sizes == [p.MAX_TRAJECTORIES_PER_MESSAGE, 1]


# -- closing open trajectories


def test_a_new_worker_incarnation_closes_open_trajectories_as_truncated(bench):
    s = Script()
    bench.feed(s.first(), s.step(), s.step())
    restarted = Script(incarnation="i2")
    bench.feed(restarted.first(), restarted.step())
    [traj] = bench.trajectories()
    assert traj.truncated and not traj.terminated
    assert traj.obs[:, 1].tolist() == [0, 1]
    assert traj.bootstrap_obs.tolist() == [0, 2], "bootstrap from the last obs seen"
    assert traj.episode_return is None, "a cut episode is not an episode statistic"
    bench.asm.tick(bench.t)
    assert bench.trajectories() == [], "nothing is emitted twice"


def test_a_reset_closes_open_trajectories_and_drained_steps_complete_them(bench):
    s = Script()
    bench.feed(s.first(), s.step(), s.step(act=False), s.first(), s.step())
    [traj] = bench.trajectories()
    assert traj.truncated and traj.obs[:, 1].tolist() == [0, 1]
    assert traj.bootstrap_obs.tolist() == [0, 2]
    assert bench.trajectories() == []


def test_a_barrier_closes_open_trajectories_in_their_epoch_once(bench):
    """The broker forwards a worker's last pre-barrier step without an action, then its reset
    into the new epoch: the open trajectories end there, truncated, in the old epoch."""
    s = Script(k=2)
    bench.feed(s.first(), s.step(), s.step())
    bench.feed(p.Barrier(epoch=1, options={"level": 2}))  # heard, and nothing to do with it
    bench.feed(s.step(act=False))
    assert bench.trajectories() == []
    s.epoch = 1
    bench.feed(s.first())
    closed = bench.trajectories()
    assert sorted(t.agent for t in closed) == ["w/0", "w/1"]
    assert all(t.truncated and not t.terminated and t.epoch == 0 for t in closed)
    assert all(t.obs[:, 1].tolist() == [0, 1, 2] for t in closed), "drained step included"
    assert [t.bootstrap_obs.tolist() for t in closed] == [[0, 3], [1, 3]]
    bench.feed(s.step(), s.step(), s.step(), s.step())
    after = bench.trajectories()
    assert len(after) == 2 and all(t.epoch == 1 and t.obs[:, 1].tolist() == [0, 1, 2, 3]
                                   for t in after), "the new epoch's own, nothing again"
    assert bench.asm.figures()["closed_truncated"] == 2
    assert bench.asm.figures()["steps_lost"] == 0, "every action got its result"


def test_a_lost_worker_has_its_open_trajectories_closed_as_truncated(bench):
    s = Script(k=2)
    bench.feed(s.first(), s.step(), s.step(), s.step())
    bench.feed(p.WorkerLost(worker="w", incarnation="other", reason="not this one"))
    assert bench.trajectories() == [], "a lost message for another incarnation changes nothing"
    bench.feed(p.WorkerLost(worker="w", incarnation="i1", reason="silent"))
    got = sorted(bench.trajectories(), key=lambda t: t.agent)
    assert len(got) == 2
    assert all(t.truncated and len(t.rewards) == 3 for t in got)
    assert [t.bootstrap_obs.tolist() for t in got] == [[0, 3], [1, 3]]
    bench.feed(p.WorkerLost(worker="w", incarnation="i1", reason="silent"))
    assert bench.trajectories() == [], "nothing is emitted twice"
    assert bench.asm.figures()["steps_lost"] == 2, "the actions chosen last never got results"
    assert bench.asm.figures()["open_agents"] == 0


def test_a_lost_experience_message_closes_open_trajectories_instead_of_joining_episodes(bench):
    s = Script()
    bench.feed(s.first(), s.step(), s.step())
    s.step(terminated=[0])  # lost on the way: this step ended the episode
    bench.feed(s.step(), s.step(), s.step(), s.step(), s.step())
    cut, after = bench.trajectories()
    assert cut.truncated and cut.obs[:, 1].tolist() == [0, 1], "closed at the gap"
    assert after.obs[:, 1].tolist() == [1, 2, 3, 4], "a fresh trajectory after the gap"
    assert after.episode_return is None, "a partly seen episode is no statistic"
    assert bench.asm.figures()["gaps"] == 1


def test_an_assembler_that_joins_mid_episode_counts_it_and_keeps_no_statistic(bench):
    s = Script()
    s.first()
    bench.feed(*[s.step() for _ in range(3)], s.step(terminated=[0]))
    [traj] = bench.trajectories()
    assert traj.terminated and traj.episode_return is None and traj.episode_step == -1
    assert bench.asm.figures()["joined_mid_episode"] == 1


def test_well_formed_but_inconsistent_experience_is_refused_and_serving_goes_on(bench, caplog):
    s = Script(k=2)
    good = s.first()
    broken = [
        dataclasses.replace(good, obs=np.float32(1.0) * np.ones(())),
        dataclasses.replace(good, reward=np.zeros(1, np.float32)),
        dataclasses.replace(good, terminated=np.zeros(2, np.float32)),
        dataclasses.replace(good, action=np.zeros(1, np.int64)),
        dataclasses.replace(good, final_obs=np.zeros((1, 2), np.float32)),
        dataclasses.replace(good, logp=None),
        dataclasses.replace(good, obs=np.zeros((0, 2), np.float32)),
    ]
    bench.feed(*broken)
    bench.feed(s.first(), s.step(), s.step(), s.step(), s.step(terminated=[0, 1]))
    got = bench.trajectories()
    assert len(got) == 2 and all(t.terminated and len(t.rewards) == 4 for t in got)
    assert bench.asm.figures()["rejected"] == len(broken)
    bench.asm.stop("SIGTERM")
    with caplog.at_level(logging.INFO, "test.assembler"):
        bench.asm.finish()
    assert f"{len(broken)} messages refused" in caplog.text


def test_refused_experience_is_counted_against_the_broker_connection_naming_the_worker(
        bench, caplog):
    """The broker sends every worker's experience: a refusal names the connection it came on
    (as the loop's transport names it), and the worker only in the detail."""
    s = Script(worker="w7")
    broken = dataclasses.replace(s.first(), reward=np.zeros(3, np.float32))
    with caplog.at_level(logging.WARNING, "test.assembler"):
        bench.asm.deliver(b"", broken, now=bench.t, sender="10.0.0.9 on tcp://0.0.0.0:7344")
    assert bench.asm.figures()["rejected_from"] == "10.0.0.9 on tcp://0.0.0.0:7344:1"
    assert "from 10.0.0.9 on tcp://0.0.0.0:7344: bad experience: worker 'w7': " in caplog.text


def test_actions_that_change_shape_are_refused_and_cut_the_workers_trajectories(bench):
    s = Script()
    bench.feed(s.first(), s.step())
    changed = dataclasses.replace(s.step(), action=np.zeros((1, 3), np.int64))
    bench.feed(changed)
    [cut] = bench.trajectories()
    assert cut.truncated and len(cut.rewards) == 2
    assert bench.asm.figures()["rejected_bad_experience"] == 1


# -- learners: sends, receipts, back-pressure


def test_receipts_release_what_waits_and_intake_pauses_at_the_bound():
    bench = Bench(max_buffered=2)
    s = Script(k=2)
    bench.feed(s.first(), *[s.step() for _ in range(4)])
    assert [t.seq for t in bench.trajectories()] == [0, 1]
    figures = bench.asm.figures()
    assert (figures["untaken"], figures["unlearned"], figures["held"]) == (2, 2, 0)
    assert bench.asm.holds("experience"), "two sent, none taken in: no room"
    bench.feed(bench.receipt(taken=[0]))
    assert not bench.asm.holds("experience"), "one taken in: room for one more message"
    bench.asm.deliver(b"", s.step(), now=bench.t)
    assert bench.asm.holds("experience"), "no more than the room in one pass"
    bench.asm.tick(bench.t)
    bench.feed(bench.receipt(taken=[1], learned=[0, 1]))
    figures = bench.asm.figures()
    assert (figures["untaken"], figures["unlearned"]) == (0, 0)
    assert not bench.asm.holds("experience")


def test_a_receipt_for_another_assembler_or_of_bad_shape_releases_nothing(bench):
    s = Script()
    bench.feed(s.first(), *[s.step() for _ in range(4)])
    [traj] = bench.trajectories()
    bench.feed(bench.receipt(taken=[traj.seq], learned=[traj.seq], assembler_incarnation="old"))
    assert bench.asm.figures()["unlearned"] == 1, "meant for the assembler this one replaced"
    bad = dataclasses.replace(bench.receipt(), taken=np.zeros((1, 1), np.int64))
    bench.feed(bad)
    assert bench.asm.figures()["rejected_bad_receipt"] == 1
    assert bench.asm.figures()["unlearned"] == 1


def test_a_full_outlet_holds_trajectories_and_wakes_the_loop_when_writable():
    bench = Bench(blocked={"trajectories"})
    s = Script()
    bench.feed(s.first(), *[s.step() for _ in range(8)])
    assert bench.asm.figures()["held"] == 2
    assert bench.asm.wake_on_writable == {"trajectories"}
    bench.out.blocked.clear()
    bench.asm.tick(bench.t)
    assert [t.seq for t in bench.trajectories()] == [0, 1]
    assert bench.asm.figures()["held"] == 0 and bench.asm.wake_on_writable == set()


HANDSHAKE = zmq.EVENT_HANDSHAKE_SUCCEEDED


def after_grace(bench: Bench) -> None:
    """The moment a handshake's backlog goes (outlets.RESEND_GRACE_S after it)."""
    bench.t += outlets.RESEND_GRACE_S
    bench.asm.run_timers(bench.t)
    bench.asm.tick(bench.t)


def test_a_learner_connecting_gets_what_was_not_learned_from_again_with_the_same_numbers(
        bench):
    s = Script(k=3)
    bench.feed(s.first(), *[s.step() for _ in range(4)])
    assert [t.seq for t in bench.trajectories()] == [0, 1, 2]
    bench.feed(bench.receipt(taken=[0, 1, 2], learned=[1]))
    bench.asm.on_socket_event("trajectories events", HANDSHAKE)
    assert bench.trajectories() == [], "not at once: the old connection may not be dropped yet"
    after_grace(bench)
    again = bench.trajectories()
    assert [(t.seq, t.agent) for t in again] == [(0, "w/0"), (2, "w/2")]
    figures = bench.asm.figures()
    assert figures["resent"] == 2 and figures["untaken"] == 2
    assert figures["learner_handshakes"] == 1 and figures["backlog_resends"] == 1


def test_a_tcp_connection_that_never_completes_a_handshake_sends_nothing_again(bench):
    """Accepts, disconnects and failed handshakes are not learners coming or going (the
    assembler's monitor does not even ask for them; were they delivered, they are ignored)."""
    s = Script(k=3)
    bench.feed(s.first(), *[s.step() for _ in range(4)])
    assert len(bench.trajectories()) == 3
    for event in (zmq.EVENT_ACCEPTED, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                  zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                  zmq.EVENT_DISCONNECTED) * 500:
        bench.asm.on_socket_event("trajectories events", event)
    assert bench.trajectories() == []
    figures = bench.asm.figures()
    assert figures["resent"] == figures["learner_handshakes"] == 0
    assert figures["unlearned"] == 3


def test_handshakes_in_quick_succession_send_the_backlog_once_now_and_once_at_the_interval(
        bench, caplog):
    """A peer handshaking over and over cannot make the assembler send its backlog once per
    handshake: once at the first, once more when the interval ends, whatever came between."""
    s = Script(k=3)
    bench.feed(s.first(), *[s.step() for _ in range(4)])
    assert len(bench.trajectories()) == 3
    with caplog.at_level(logging.INFO, "test.assembler"):
        bench.asm.on_socket_event("trajectories events", HANDSHAKE)
        assert bench.trajectories() == [], "nothing goes during a handshake's grace"
        after_grace(bench)
        assert len(bench.trajectories()) == 3, "the first handshake: after the grace"
        for _ in range(200):  # 200 handshakes within the interval
            bench.t += (outlets.RESEND_INTERVAL_S - outlets.RESEND_GRACE_S - 0.01) / 200
            bench.asm.on_socket_event("trajectories events", HANDSHAKE)
            bench.asm.run_timers(bench.t)
            bench.asm.tick(bench.t)
        assert bench.trajectories() == [], "nothing more within the interval"
        bench.t = T0 + outlets.RESEND_INTERVAL_S + outlets.RESEND_GRACE_S  # the last one's grace
        bench.asm.run_timers(bench.t)
        bench.asm.tick(bench.t)
        assert [t.seq for t in bench.trajectories()] == [0, 1, 2], "once more at its end"
        for _ in range(20):  # long after: nothing pending
            bench.t += 1.0
            bench.asm.run_timers(bench.t)
            bench.asm.tick(bench.t)
        assert bench.trajectories() == []
    figures = bench.asm.figures()
    assert figures["learner_handshakes"] == 201 and figures["resends_deferred"] == 1
    assert figures["backlog_resends"] == 2 and figures["resent"] == 6
    assert caplog.text.count("a learner connected") == 2


def test_a_handshake_within_the_interval_gets_what_was_unlearned_when_the_interval_ends(bench):
    """A peer that handshook just before a real learner took the immediate resend; the
    learner's own handshake, within the interval, still gets everything unlearned then."""
    bench.asm.on_socket_event("trajectories events", HANDSHAKE)  # nothing unlearned yet
    after_grace(bench)
    s = Script(k=2)
    bench.t += 0.2
    bench.feed(s.first(), *[s.step() for _ in range(4)])
    assert [t.seq for t in bench.trajectories()] == [0, 1]
    bench.asm.on_socket_event("trajectories events", HANDSHAKE)
    after_grace(bench)
    assert bench.trajectories() == []
    bench.t = T0 + outlets.RESEND_INTERVAL_S
    bench.asm.run_timers(bench.t)
    bench.asm.tick(bench.t)
    assert [t.seq for t in bench.trajectories()] == [0, 1]


def test_two_learners_taking_turns_are_warned_of_and_a_late_receipt_after_a_swap_is_not(
        bench, caplog):
    with caplog.at_level(logging.WARNING, "test.assembler"):
        # A swap whose old learner's last receipt is read after the new one's first.
        for incarnation in ("L1", "L2", "L1", "L2", "L2"):
            bench.t += 0.1
            bench.feed(bench.receipt(incarnation=incarnation))
        assert "two learners" not in caplog.text
        for incarnation in ("L1", "L2") * 10:  # two at once
            bench.t += 0.1
            bench.feed(bench.receipt(incarnation=incarnation))
    assert caplog.text.count("two learners take trajectories") == 1, "once a minute"
    assert bench.asm.figures()["learners_interleaved"] == 2 + 20


def test_a_new_learner_incarnation_is_a_swap_timed_from_the_last_receipt(bench):
    bench.feed(bench.receipt(incarnation="L1"))
    bench.t += 2.5
    bench.feed(bench.receipt(incarnation="L1"))
    bench.t += 1.25
    bench.feed(bench.receipt(incarnation="L2"))
    figures = bench.asm.figures()
    assert figures["trainer_swaps"] == 1 and figures["last_swap_gap_s"] == 1.25


def test_each_policy_has_its_own_outlet_and_an_unknown_policy_is_counted_not_sent():
    bench = Bench(policy_endpoints="red=ipc:///tmp/never-bound-red")
    s = Script(k=3, agents=["x", "y", "z"])
    first = dataclasses.replace(s.first(), agent_policies=["default", "red", "blue"])
    steps = [dataclasses.replace(s.step(), agent_policies=["default", "red", "blue"])
             for _ in range(4)]
    bench.feed(first, *steps)
    assert [t.agent for t in bench.trajectories("trajectories")] == ["w/0/x"]
    assert [t.agent for t in bench.trajectories("trajectories:red")] == ["w/0/y"]
    assert bench.asm.figures()["unrouted"] == 1


def test_shutdown_closes_open_trajectories_and_waits_for_the_learner_to_take_them(bench):
    s = Script(k=2)
    bench.feed(s.first(), s.step(), s.step(), s.step(terminated=[0]))
    [ended] = bench.trajectories()
    assert ended.agent == "w/0" and ended.terminated
    bench.feed(p.Shutdown(reason="controller shutdown"))
    assert bench.asm.stop_reason == "controller shutdown"
    assert bench.asm.drain_on_stop() == ("experience", assembler.SHUTDOWN_FLUSH_S)
    assert bench.asm.on_drained() == ("receipts", assembler.SHUTDOWN_FLUSH_S)
    bench.asm.tick(bench.t)
    [flushed] = bench.trajectories()
    assert flushed.agent == "w/1" and flushed.truncated and not flushed.terminated
    assert len(flushed.rewards) == 3 and flushed.bootstrap_obs.tolist() == [1, 3]
    assert bench.asm.figures()["steps_lost"] == 0, "shutdown loses no step"
    assert bench.asm.awaiting()
    bench.feed(bench.receipt(taken=[ended.seq, flushed.seq]))
    assert not bench.asm.awaiting()
