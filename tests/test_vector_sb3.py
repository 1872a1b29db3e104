"""stepbus.vector.sb3.VecEnv is Stable-Baselines3's VecEnv: the same seeds and actions give
DummyVecEnv's observations, rewards, dones and infos (terminal_observation,
TimeLimit.truncated), and SB3's PPO trains on it. Whether it solves CartPole with rl-zoo's
settings is benchmarks/vector.py --sb3 (docs/performance.md)."""

from __future__ import annotations

from collections.abc import Iterator

import gymnasium as gym
import numpy as np
import pytest
import vector_envs
from vector_envs import Made

pytest.importorskip("stable_baselines3")
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv, VecMonitor

from stepbus.vector.sb3 import VecEnv


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Made]:
    yield from vector_envs.closing_make(monkeypatch)


def test_same_seeds_and_actions_give_dummy_vec_env_results(make: Made) -> None:
    ours = VecEnv(make("CartPole-v1", 4, workers=2, autoreset_mode="SameStep"))
    theirs = DummyVecEnv([lambda: gym.make("CartPole-v1")] * 4)
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
