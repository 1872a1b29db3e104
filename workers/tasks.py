"""Tasks for trying stepbus's models, reached as `--env stepbus.workers.tasks:NAME`.

- `cartpole_no_velocity`: CartPole-v1 whose observation keeps the cart's position and the
  pole's angle and drops both velocities. A policy must infer them from what it saw before,
  so a feed-forward model cannot solve it and a recurrent one can (`--model torch-lstm`).
  Its goal stays CartPole-v1's (475).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

POSITION_AND_ANGLE = [0, 2]  # of CartPole's (x, x_dot, theta, theta_dot)


def cartpole_no_velocity() -> gym.Env:
    env = gym.make("CartPole-v1")
    full = env.observation_space
    assert isinstance(full, gym.spaces.Box)
    space = gym.spaces.Box(full.low[POSITION_AND_ANGLE], full.high[POSITION_AND_ANGLE],
                           dtype=np.float32)
    return gym.wrappers.TransformObservation(
        env, lambda obs: obs[POSITION_AND_ANGLE], observation_space=space)
