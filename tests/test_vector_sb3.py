"""stepbus.vector.sb3.VecEnv is Stable-Baselines3's VecEnv: the same seeds and actions give
DummyVecEnv's and SubprocVecEnv's observations, rewards, dones and infos (the env's own,
terminal_observation, TimeLimit.truncated, Monitor's episode), and SB3's PPO trains on it.
Whether it solves CartPole with rl-zoo's settings is benchmarks/vector.py --sb3
(docs/performance.md)."""

from __future__ import annotations

from collections.abc import Iterator

import gymnasium as gym
import numpy as np
import pytest
import vector_envs
from conftest import TESTS_DIR
from vector_envs import Made

pytest.importorskip("stable_baselines3")
from stable_baselines3 import PPO
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecMonitor

from stepbus.vector.sb3 import VecEnv


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Made]:
    yield from vector_envs.closing_make(monkeypatch)


def test_same_seeds_and_actions_give_dummy_vec_env_results(make: Made) -> None:
    ours = VecEnv(make("CartPole-v1", 4, workers=2, autoreset_mode="SameStep"))
    theirs = DummyVecEnv([lambda: Monitor(gym.make("CartPole-v1"))] * 4)
    for venv in (ours, theirs):
        venv.seed(21)
    first, theirs_first = ours.reset(), theirs.reset()
    assert isinstance(first, np.ndarray) and isinstance(theirs_first, np.ndarray)
    assert np.array_equal(first, theirs_first)
    rng = np.random.default_rng(2)
    ended = 0
    for _ in range(200):
        actions = rng.integers(0, 2, 4)
        got, expected = ours.step(actions), theirs.step(actions)
        for a, b in zip(got[:3], expected[:3], strict=True):
            assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
            assert np.array_equal(a, b) and a.dtype == b.dtype
        for a, b in zip(got[3], expected[3], strict=True):
            assert a.keys() == b.keys()
            assert a["TimeLimit.truncated"] == b["TimeLimit.truncated"]
            if "terminal_observation" in b:
                assert np.array_equal(a["terminal_observation"], b["terminal_observation"])
                assert a["episode"]["r"] == b["episode"]["r"]
                assert a["episode"]["l"] == b["episode"]["l"]
        ended += int(expected[2].sum())
    assert ended > 5


def test_ppo_trains_on_it(make: Made) -> None:
    venv = VecMonitor(VecEnv(make("CartPole-v1", 8, workers=2, autoreset_mode="SameStep")))
    model = PPO("MlpPolicy", venv, n_steps=32, batch_size=256, n_epochs=2, seed=0, device="cpu")
    model.learn(total_timesteps=512)
    assert model.ep_info_buffer is not None
    assert model.num_timesteps >= 512 and len(model.ep_info_buffer) > 0


def test_it_needs_same_step_autoreset(make: Made) -> None:
    with pytest.raises(ValueError, match="SameStep"):
        VecEnv(make("CartPole-v1", 2))


def test_make_sb3_gives_subproc_vec_env_infos_with_monitor_episodes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One call makes the SB3 face; on the same seeds and actions its infos are those of
    SB3's SubprocVecEnv over Monitor-wrapped envs (as make_vec_env builds it): the env's own
    keys, terminal_observation, TimeLimit.truncated and episode {r, l} (t is a clock)."""
    from stable_baselines3.common.vec_env import SubprocVecEnv

    import stepbus.vector as sv

    monkeypatch.setenv("PYTHONPATH", str(TESTS_DIR))  # workers import vector_envs
    with pytest.raises(ValueError, match="SameStep"):
        sv.make_sb3("CartPole-v1", 2, autoreset_mode="NextStep")
    ours = sv.make_sb3("vector_envs:chatty", 3, workers=2)
    theirs = SubprocVecEnv([lambda: Monitor(vector_envs.chatty())] * 3)
    try:
        for venv in (ours, theirs):
            venv.seed(1)
        assert np.array_equal(ours.reset(), np.asarray(theirs.reset()))
        assert ours.reset_infos == list(theirs.reset_infos)
        episodes = 0
        for t in range(8):
            actions = np.array([t % 5, 1, 2])
            got, expected = ours.step(actions), theirs.step(actions)
            assert all(np.array_equal(a, np.asarray(b))
                       for a, b in zip(got[:3], expected[:3], strict=True))
            for a, b in zip(got[3], expected[3], strict=True):
                assert a.keys() == b.keys()
                assert vector_envs_same(a, b)
                episodes += "episode" in b
        assert episodes >= 4
    finally:
        ours.close()
        theirs.close()


def vector_envs_same(a: dict, b: dict) -> bool:
    from test_vector_env import same

    a, b = dict(a), dict(b)
    if "episode" in b:
        assert a["episode"]["r"] == b["episode"]["r"] and a["episode"]["l"] == b["episode"]["l"]
        a.pop("episode"), b.pop("episode")
    return same(a, b)
