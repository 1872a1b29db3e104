"""The trajectory assembler as a real process, fed scripted step sequences over its sockets."""

from __future__ import annotations

import dataclasses
import signal

import numpy as np
import pytest
import zmq
from conftest import Cluster, TrajectoryInbox, recv_message, send_message
from stepbus.bus import protocol as p


class Script:
    """Builds EXPERIENCE messages for one worker; obs rows are [env, t] so tests can check them."""

    def __init__(self, worker: str = "w", k: int = 1, incarnation: str = "i1") -> None:
        self.worker, self.k, self.incarnation = worker, k, incarnation
        self.seq, self.t = 0, np.zeros(k)

    def obs(self) -> np.ndarray:
        return np.stack([np.arange(self.k, dtype=np.float32), self.t.astype(np.float32)], 1)

    def first(self) -> p.Experience:
        self.seq, self.t = 0, np.zeros(self.k)
        return self._msg(first=True, reward=np.zeros(self.k, np.float32))

    def step(self, reward: float | list[float] = 1.0, *, terminated: list[int] = (),
             truncated: list[int] = (), act: bool = True) -> p.Experience:
        self.seq += 1
        self.t += 1
        term = np.isin(np.arange(self.k), terminated)
        trunc = np.isin(np.arange(self.k), truncated)
        final = self.obs()[term | trunc]
        final[:, 1] += 1000  # a final obs is distinguishable from the autoreset obs
        self.t[term | trunc] = 0  # autoreset
        return self._msg(reward=np.broadcast_to(np.float32(reward), (self.k,)).copy(),
                         terminated=term, truncated=trunc, final_obs=final, act=act)

    def _msg(self, *, first: bool = False, reward: np.ndarray, terminated: np.ndarray | None = None,
             truncated: np.ndarray | None = None, final_obs: np.ndarray | None = None,
             act: bool = True) -> p.Experience:
        k = self.k
        return p.Experience(
            worker=self.worker, incarnation=self.incarnation, epoch=0, seq=self.seq, first=first,
            policy_version=7 if act else -1, obs=self.obs(), reward=reward,
            terminated=terminated if terminated is not None else np.zeros(k, bool),
            truncated=truncated if truncated is not None else np.zeros(k, bool),
            final_obs=final_obs if final_obs is not None else np.zeros((0, 2), np.float32),
            action=np.arange(k, dtype=np.int64) if act else None,
            logp=np.full(k, -0.5, np.float32) if act else None,
            value=np.full(k, 0.25, np.float32) if act else None)


@pytest.fixture
def assembler(cluster: Cluster):
    proc = cluster.start("assembler", "--horizon", "4")
    push = cluster.socket(zmq.PUSH, cluster.endpoints["experience"])
    pull = TrajectoryInbox(cluster.socket(zmq.PULL, cluster.endpoints["trajectories"]))
    yield proc, push, pull
    push.close()
    pull.close()


def feed(push: zmq.Socket, *messages: p.Experience) -> None:
    for msg in messages:
        send_message(push, msg)


def test_a_running_episode_is_cut_at_the_horizon_and_bootstraps_from_the_next_obs(assembler):
    _, push, pull = assembler
    s = Script()
    feed(push, s.first(), *[s.step(reward=1.0) for _ in range(9)])
    for start in (0, 4):
        traj = pull.recv()
        assert isinstance(traj, p.Trajectory)
        assert traj.agent == "w/0"
        assert not traj.terminated and not traj.truncated
        assert traj.obs[:, 1].tolist() == [start, start + 1, start + 2, start + 3]
        assert traj.bootstrap_obs.tolist() == [0, start + 4]
        assert traj.rewards.tolist() == [1, 1, 1, 1]
        assert traj.policy_versions.tolist() == [7] * 4
        assert traj.episode_return is None and traj.episode_length is None
    assert not pull.poll(300), "the 9th step must wait for the horizon or the episode end"


def test_truncation_keeps_the_final_observation_for_bootstrapping(assembler):
    _, push, pull = assembler
    s = Script()
    feed(push, s.first(), s.step(), s.step(), s.step(reward=2.0, truncated=[0]))
    traj = pull.recv()
    assert traj.truncated and not traj.terminated
    assert traj.obs[:, 1].tolist() == [0, 1, 2]
    assert traj.bootstrap_obs.tolist() == [0, 1003], "the final obs, not the autoreset obs"
    assert traj.episode_return == 4.0 and traj.episode_length == 3


def test_termination_is_kept_apart_from_truncation(assembler):
    _, push, pull = assembler
    s = Script()
    feed(push, s.first(), s.step(), s.step(terminated=[0]), s.step(), s.step(terminated=[0]))
    first, second = pull.recv(), pull.recv()
    assert first.terminated and not first.truncated
    assert first.obs[:, 1].tolist() == [0, 1] and first.episode_length == 2
    assert second.terminated and second.obs[:, 1].tolist() == [0, 1], "a new episode from t=0"


def test_episode_statistics_span_horizon_cuts(assembler):
    _, push, pull = assembler
    s = Script()
    feed(push, s.first(), *[s.step(reward=0.5) for _ in range(5)], s.step(reward=0.5,
                                                                          terminated=[0]))
    cut, end = pull.recv(), pull.recv()
    assert cut.episode_return is None and len(cut.rewards) == 4
    assert end.terminated and len(end.rewards) == 2
    assert end.episode_return == 3.0 and end.episode_length == 6


def test_agents_of_one_worker_have_their_own_trajectories(assembler):
    _, push, pull = assembler
    s = Script(k=3)
    feed(push, s.first(), s.step(terminated=[1]), s.step(truncated=[2]), s.step(), s.step())
    got = [pull.recv() for _ in range(3)]
    by_agent = {t.agent: t for t in got}
    assert set(by_agent) == {"w/0", "w/1", "w/2"}
    assert by_agent["w/1"].terminated and len(by_agent["w/1"].rewards) == 1
    assert by_agent["w/2"].truncated and len(by_agent["w/2"].rewards) == 2
    assert by_agent["w/0"].obs[:, 0].tolist() == [0, 0, 0, 0], "rows never mix agents"
    assert not by_agent["w/0"].terminated and len(by_agent["w/0"].rewards) == 4


def test_a_new_worker_incarnation_closes_open_trajectories_as_truncated(assembler):
    _, push, pull = assembler
    s = Script()
    feed(push, s.first(), s.step(), s.step())
    restarted = Script(incarnation="i2")
    feed(push, restarted.first(), restarted.step())
    traj = pull.recv()
    assert traj.truncated and not traj.terminated
    assert traj.obs[:, 1].tolist() == [0, 1]
    assert traj.bootstrap_obs.tolist() == [0, 2], "bootstrap from the last obs seen"
    assert traj.episode_return is None, "a cut episode is not an episode statistic"
    assert not pull.poll(300), "nothing is emitted twice"


def test_a_reset_closes_open_trajectories_and_drained_steps_complete_them(assembler):
    _, push, pull = assembler
    s = Script()
    feed(push, s.first(), s.step(), s.step(act=False), s.first(), s.step())
    traj = pull.recv()
    assert traj.truncated and traj.obs[:, 1].tolist() == [0, 1]
    assert traj.bootstrap_obs.tolist() == [0, 2]
    assert not pull.poll(300)


def test_shutdown_flushes_partial_trajectories_as_truncated(assembler):
    proc, push, pull = assembler
    s = Script(k=2)
    feed(push, s.first(), s.step(), s.step(), s.step(terminated=[0]))
    ended = pull.recv()  # proves every step so far reached the assembler
    assert ended.agent == "w/0" and ended.terminated
    proc.signal(signal.SIGTERM)
    flushed = pull.recv()
    assert flushed.agent == "w/1" and flushed.truncated and not flushed.terminated
    assert len(flushed.rewards) == 3 and flushed.bootstrap_obs.tolist() == [1, 3]
    assert proc.wait(5) == 0
    assert "Traceback" not in proc.output()


def test_garbage_is_counted_and_the_assembler_keeps_serving(assembler):
    proc, push, pull = assembler
    push.send_multipart([b"\x93\x01\x02"])
    push.send_multipart([b"not msgpack at all \xff\xfe"])
    s = Script()
    feed(push, s.first(), *[s.step() for _ in range(4)])
    assert isinstance(pull.recv(), p.Trajectory)
    assert proc.popen.poll() is None
    assert "dropped message" in proc.output()


def test_a_lost_worker_has_its_open_trajectories_closed_as_truncated(assembler):
    _, push, pull = assembler
    s = Script(k=2)
    feed(push, s.first(), s.step(), s.step(), s.step())
    send_message(push, p.WorkerLost(worker="w", incarnation="other", reason="not this one"))
    assert not pull.poll(300), "a lost message for another incarnation changes nothing"
    send_message(push, p.WorkerLost(worker="w", incarnation="i1", reason="silent"))
    got = sorted((pull.recv() for _ in range(2)), key=lambda t: t.agent)
    assert all(t.truncated and len(t.rewards) == 3 for t in got)
    assert [t.bootstrap_obs.tolist() for t in got] == [[0, 3], [1, 3]]
    assert not pull.poll(300), "nothing is emitted twice"


def test_a_lost_experience_message_closes_open_trajectories_instead_of_joining_episodes(
        assembler):
    _, push, pull = assembler
    s = Script()
    feed(push, s.first(), s.step(), s.step())
    s.step(terminated=[0])  # lost on the way: this step ended the episode
    feed(push, s.step(), s.step(), s.step(), s.step(), s.step())
    cut = pull.recv()
    assert cut.truncated and cut.obs[:, 1].tolist() == [0, 1], "closed at the gap"
    after = pull.recv()
    assert after.obs[:, 1].tolist() == [1, 2, 3, 4], "a fresh trajectory after the gap"
    assert after.episode_return is None, "a partly seen episode is no statistic"


def test_well_formed_but_inconsistent_experience_is_refused_and_serving_goes_on(assembler):
    proc, push, pull = assembler
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
    feed(push, *broken)
    feed(push, s.first(), s.step(), s.step(), s.step(), s.step(terminated=[0, 1]))
    got = [pull.recv() for _ in range(2)]
    assert all(t.terminated and len(t.rewards) == 4 for t in got)
    assert proc.popen.poll() is None
    proc.signal(signal.SIGTERM)
    assert proc.wait(5) == 0
    assert f"{len(broken)} messages refused" in proc.output()


def test_trajectories_cut_together_go_out_in_one_message_and_each_keeps_its_fields(
        cluster: Cluster):
    """Batching is what made small-observation envs fast (issue 6); nothing may blur in it."""
    cluster.start("assembler", "--horizon", "4")
    push = cluster.socket(zmq.PUSH, cluster.endpoints["experience"])
    pull = cluster.socket(zmq.PULL, cluster.endpoints["trajectories"])
    s = Script(k=3)
    feed(push, s.first(), s.step(), s.step(), s.step(reward=[1.0, 2.0, 3.0], terminated=[1]))
    msg = recv_message(pull)
    assert isinstance(msg, p.Trajectories), "env 1's end alone: or all three at the horizon?"
    assert msg.agents == ["w/1"] and msg.lengths == [3] and msg.terminated == [True]
    assert msg.episode_returns == [4.0] and msg.episode_lengths == [3]
    feed(push, s.step(reward=[5.0, 6.0, 7.0]))  # envs 0 and 2 reach the horizon
    msg = recv_message(pull)
    assert isinstance(msg, p.Trajectories) and msg.agents == ["w/0", "w/2"]
    first, second = msg.split()
    assert (first.seq, second.seq) == (1, 2) and msg.lengths == [4, 4]
    assert first.obs[:, 0].tolist() == [0] * 4 and second.obs[:, 0].tolist() == [2] * 4
    assert first.rewards.tolist() == [1, 1, 1, 5] and second.rewards.tolist() == [1, 1, 3, 7]
    assert first.bootstrap_obs.tolist() == [0, 4] and second.bootstrap_obs.tolist() == [2, 4]
    assert not (first.terminated or first.truncated) and first.episode_return is None
