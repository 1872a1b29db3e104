"""Making environments from a user's string, describing their spaces, and deriving seeds."""

from __future__ import annotations

import importlib
from typing import Any

import gymnasium as gym
import numpy as np
from stepbus.bus import protocol as p


def make_env(env: str) -> gym.Env:
    """A Gymnasium id (`CartPole-v1`, `module:Env-v0`) or a `module:factory` callable."""
    module, colon, attr = env.partition(":")
    if colon and all(part.isidentifier() for part in attr.split(".")):
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        made = obj()
        if not hasattr(made, "step") or not hasattr(made, "reset"):
            raise TypeError(f"{env} returned {type(made).__name__}, not an environment")
        return made
    return gym.make(env)


def space_spec(env: gym.Env) -> p.SpaceSpec:
    obs, act = env.observation_space, env.action_space
    if not isinstance(obs, gym.spaces.Box):
        raise TypeError(f"observation space {obs} is not a Box; wrap the env to flatten it")
    if isinstance(act, gym.spaces.Discrete):
        return p.SpaceSpec(list(obs.shape), obs.dtype.str, "discrete", action_n=int(act.n))
    if isinstance(act, gym.spaces.Box):
        return p.SpaceSpec(list(obs.shape), obs.dtype.str, "box", action_shape=list(act.shape),
                           action_low=act.low.ravel().astype(float).tolist(),
                           action_high=act.high.ravel().astype(float).tolist())
    raise TypeError(f"action space {act} is neither Discrete nor Box")


def env_seed(seed: int, worker_index: int, env_index: int) -> int:
    """Env i of worker w gets a seed derived from both, independent of start order."""
    sequence = np.random.SeedSequence(seed, spawn_key=(worker_index, env_index))
    return int(sequence.generate_state(1)[0])
