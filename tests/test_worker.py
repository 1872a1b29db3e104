"""Environment construction and seeding, as a worker does them."""

from __future__ import annotations

import logging

import gymnasium as gym
import numpy as np
import pytest
from stepbus.workers.envs import env_seed, make_env, space_spec
from stepbus.workers.worker import Config, EnvSet


def test_env_seeds_derive_from_seed_worker_and_env_and_are_reproducible():
    seeds = {(w, i): env_seed(7, w, i) for w in range(3) for i in range(4)}
    assert len(set(seeds.values())) == len(seeds), "every (worker, env) gets its own seed"
    assert seeds == {(w, i): env_seed(7, w, i) for w in range(3) for i in range(4)}
    assert env_seed(8, 0, 0) != env_seed(7, 0, 0)


def test_workers_with_the_same_seed_and_index_see_the_same_first_observations():
    log = logging.getLogger("test")
    errors: list = []
    first = EnvSet(Config(seed=3, worker_index=1, envs_per_worker=4), errors.append,
                   log).reset({})
    again = EnvSet(Config(seed=3, worker_index=1, envs_per_worker=4), errors.append,
                   log).reset({})
    other = EnvSet(Config(seed=3, worker_index=2, envs_per_worker=4), errors.append,
                   log).reset({})
    assert errors == []
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)
    assert len({row.tobytes() for row in first}) == 4, "envs of one worker differ"


def test_make_env_takes_gymnasium_ids_and_factories():
    assert make_env("CartPole-v1").spec.id == "CartPole-v1"
    assert isinstance(make_env("scripted_envs:recording_cartpole"), gym.Wrapper)
    with pytest.raises(TypeError, match="not an environment"):
        make_env("math:pi.__class__")


def test_spaces_are_described_for_the_learner():
    spec = space_spec(make_env("Pendulum-v1"))
    assert spec.action_kind == "box" and spec.action_shape == [1]
    assert spec.action_low == [-2.0] and spec.action_high == [2.0]
    spec = space_spec(make_env("CartPole-v1"))
    assert (spec.action_kind, spec.action_n, spec.obs_shape) == ("discrete", 2, [4])
