"""Replaying one recorded episode alone, to check it against what the pipeline recorded.

Every episode of every env is reset with its own seed (`envs.episode_seed`), and every
trajectory records that seed, the episode index and the step its first row is at. So an episode
needs nothing from the episodes before it: reset a fresh env with the seed, take the recorded
actions, and the observations and rewards come out the same, bit for bit, for a deterministic
env. Single-agent (Gymnasium) envs only: a multi-agent episode needs every agent's actions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from stepbus.workers.envs import make_env, seed_spaces


@dataclass
class Replay:
    obs: np.ndarray  # the observation each action was taken on
    rewards: np.ndarray
    terminated: bool
    truncated: bool
    final_obs: np.ndarray  # the observation after the last action


def replay_episode(env: str, episode_seed: int, actions: np.ndarray,
                   options: dict[str, Any] | None = None) -> Replay:
    """Reset `env` (as `--env` names it) with `episode_seed` and take `actions` in order."""
    made = make_env(env)
    try:
        seed_spaces(made, int(episode_seed))  # as the worker does before each reset
        obs, _ = made.reset(seed=int(episode_seed), options=options)
        seen, rewards = [], []
        terminated = truncated = False
        for action in actions:
            seen.append(np.asarray(obs))
            obs, reward, terminated, truncated, _ = made.step(action)
            rewards.append(reward)
            if terminated or truncated:
                break
        return Replay(np.stack(seen), np.asarray(rewards, np.float32), bool(terminated),
                      bool(truncated), np.asarray(obs))
    finally:
        made.close()
