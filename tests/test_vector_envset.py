"""A worker's environments under a vector client's resets give Gymnasium's SyncVectorEnv's
episodes: per-env seeds, partial resets and all three autoreset modes, in process."""

from __future__ import annotations

import logging

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from stepbus.bus import protocol as p
from stepbus.workers.envset import EnvSet
from stepbus.workers.worker import Config

N = 4
MODES = {AutoresetMode.SAME_STEP: p.AUTORESET_SAME_STEP,
         AutoresetMode.NEXT_STEP: p.AUTORESET_NEXT_STEP,
         AutoresetMode.DISABLED: p.AUTORESET_DISABLED}


def envset(autoreset: str) -> EnvSet:
    envs = EnvSet(Config(env="CartPole-v1", envs_per_worker=N, name="w"), lambda e: None,
                  logging.getLogger("test"))
    envs.seeding, envs.autoreset = p.SEEDING_GYMNASIUM, autoreset
    return envs


def sync(mode: AutoresetMode) -> SyncVectorEnv:
    return SyncVectorEnv([lambda: gym.make("CartPole-v1")] * N, autoreset_mode=mode)


@pytest.mark.parametrize("mode", list(MODES))
def test_seeded_episodes_match_sync_vector_env_in_every_autoreset_mode(
        mode: AutoresetMode) -> None:
    ours, theirs = envset(MODES[mode]), sync(mode)
    rng = np.random.default_rng(1)
    obs = ours.reset({}, None, [7 + i for i in range(N)])
    expected, _ = theirs.reset(seed=7)
    np.testing.assert_array_equal(obs, expected)
    ended = 0
    for _ in range(300):
        actions = rng.integers(0, 2, N)
        r = ours.step(actions, {})
        o, rew, term, trunc, info = theirs.step(actions)
        np.testing.assert_array_equal(r.obs, o)
        np.testing.assert_array_equal(r.reward, rew)
        np.testing.assert_array_equal(r.terminated, term)
        np.testing.assert_array_equal(r.truncated, trunc)
        assert r.reward.dtype == rew.dtype
        done = term | trunc
        ended += int(done.sum())
        if mode is AutoresetMode.SAME_STEP and done.any():
            np.testing.assert_array_equal(r.final_obs, np.stack(info["final_obs"][done]))
        if mode is AutoresetMode.DISABLED and done.any():
            seeds = [int(s) for s in rng.integers(0, 1000, int(done.sum()))]
            rows = [int(i) for i in np.flatnonzero(done)]
            obs = ours.reset({}, rows, list(seeds))
            all_seeds: list[int | None] = [None] * N
            for i, s in zip(rows, seeds, strict=True):
                all_seeds[i] = s
            expected, _ = theirs.reset(seed=all_seeds, options={"reset_mask": done})
            np.testing.assert_array_equal(obs, expected)
    assert ended > 10  # episodes ended, and the next ones matched too


def test_partial_reset_without_seed_continues_the_envs_own_generator() -> None:
    ours, theirs = envset(p.AUTORESET_NEXT_STEP), sync(AutoresetMode.NEXT_STEP)
    ours.reset({}, None, [3 + i for i in range(N)])
    theirs.reset(seed=3)
    mask = np.array([True, False, True, False])
    obs = ours.reset({}, [0, 2], [None, None])
    expected, _ = theirs.reset(options={"reset_mask": mask})
    np.testing.assert_array_equal(obs, expected)
    for _ in range(50):
        r = ours.step(np.ones(N, np.int64), {})
        np.testing.assert_array_equal(r.obs, theirs.step(np.ones(N, np.int64))[0])


def test_default_resets_keep_per_episode_derived_seeds() -> None:
    envs = EnvSet(Config(env="CartPole-v1", envs_per_worker=2, name="w"), lambda e: None,
                  logging.getLogger("test"))
    envs.reset({})
    seeds = envs.episode_seed.copy()
    assert (seeds > 0).all() and envs.autoreset == p.AUTORESET_SAME_STEP
    assert envs.step(np.zeros(2, np.int64), {}).reward.dtype == np.float32
