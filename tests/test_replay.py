"""Every trajectory says which episode produced it (env reset seed, episode index, first step),
so an episode can be replayed alone and checked against what the pipeline recorded."""

from __future__ import annotations

import collections

import numpy as np
from conftest import Cluster, act_as_trainer

from stepbus.bus import protocol as p
from stepbus.workers.replay import replay_episode


def test_a_recorded_episode_replays_alone_bit_for_bit(cluster: Cluster):
    for role in ("controller", "broker", "assembler"):
        cluster.start(role)
    cluster.start("worker", "--envs-per-worker", "2", "--seed", "7", "--name", "w")
    trainer, pull = act_as_trainer(cluster, obs_dim=4)
    pieces: dict[tuple[str, int], list[p.Trajectory]] = collections.defaultdict(list)
    episode = None
    while episode is None:  # the first episode whose every piece arrived
        traj = pull.recv(timeout=30)
        assert isinstance(traj, p.Trajectory) and traj.episode >= 0 and traj.episode_seed >= 0
        key = (traj.agent, traj.episode)
        pieces[key].append(traj)
        if (traj.terminated or traj.truncated) and pieces[key][0].episode_step == 0:
            episode = pieces[key]
    steps = [t.episode_step for t in episode]
    lengths = [len(t.rewards) for t in episode]
    assert steps == [sum(lengths[:i]) for i in range(len(episode))], "contiguous pieces"
    assert len({t.episode_seed for t in episode}) == 1
    actions = np.concatenate([t.actions for t in episode])

    replay = replay_episode("CartPole-v1", episode[0].episode_seed, actions)

    assert np.array_equal(replay.obs, np.concatenate([t.obs for t in episode]))
    assert np.array_equal(replay.rewards, np.concatenate([t.rewards for t in episode]))
    assert replay.terminated == episode[-1].terminated
    assert isinstance(episode[-1].bootstrap_obs, np.ndarray)  # CartPole's Box
    assert np.array_equal(replay.final_obs, episode[-1].bootstrap_obs)
    # A wrong seed gives another episode: the check above can fail.
    other = replay_episode("CartPole-v1", episode[0].episode_seed + 1, actions)
    assert not np.array_equal(other.obs[:1], replay.obs[:1])
    trainer.close()
    pull.close()
