"""End-to-end learning check, in process: the numpy PPO solves CartPole-v1 like SB3 does.

rl-zoo's SB3 PPO settings (8 envs x 32 steps, 20 epochs, lr 1e-3) solve CartPole in roughly
25-38k env steps; this run (seed 0) takes about 29k steps and ~3 s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import pytest

from stepbus.models.mlp import Adam, act, init_params
from stepbus.policy import ActionSpace
from stepbus.trainer.ppo import PPOConfig, Trajectory, ppo_update

N_ENVS = 8
HORIZON = 32  # steps per env between updates: 8 x 32 = PPOConfig.batch_steps
MAX_ENV_STEPS = 100_000
TARGET = 475.0


@dataclass
class _Segment:
    """Steps of one env since its last cut (episode end or update)."""

    obs: list[np.ndarray] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    def cut(self, terminated: bool, truncated: bool, bootstrap_obs: np.ndarray) -> Trajectory:
        return Trajectory(
            obs=np.stack(self.obs),
            actions=np.asarray(self.actions, dtype=np.int64),
            logp=np.asarray(self.logp, dtype=np.float32),
            values=np.asarray(self.values, dtype=np.float32),
            rewards=np.asarray(self.rewards, dtype=np.float32),
            terminated=terminated,
            truncated=truncated,
            bootstrap_obs=bootstrap_obs.copy(),
        )


class Rollout:
    """CartPole envs stepped by a policy's `act(obs, rng) -> (actions, logp, values)`, cut
    into trajectories as a learner gets them: at episode end, and at the horizon."""

    def __init__(self, n_envs: int, seed: int = 0) -> None:
        self.envs = [gym.make("CartPole-v1") for _ in range(n_envs)]
        self.obs = np.stack([env.reset(seed=seed * 1000 + i)[0]
                             for i, env in enumerate(self.envs)])
        self.segments = [_Segment() for _ in self.envs]
        self.episode_return = np.zeros(n_envs)
        self.finished: list[float] = []
        self.env_steps = 0

    def collect(self, act: Callable[[np.ndarray, np.random.Generator], tuple],
                rng: np.random.Generator, horizon: int) -> list[Trajectory]:
        trajs: list[Trajectory] = []
        for _ in range(horizon):
            actions, logp, values = act(self.obs, rng)
            for i, env in enumerate(self.envs):
                next_obs, reward, terminated, truncated, _ = env.step(int(actions[i]))
                seg = self.segments[i]
                seg.obs.append(self.obs[i].copy())
                seg.actions.append(int(actions[i]))
                seg.logp.append(float(logp[i]))
                seg.values.append(float(values[i]))
                seg.rewards.append(float(reward))
                self.episode_return[i] += reward
                if terminated or truncated:
                    # next_obs is the true final observation: bootstrapped iff truncated
                    trajs.append(seg.cut(terminated, truncated, next_obs))
                    self.segments[i] = _Segment()
                    self.finished.append(self.episode_return[i])
                    self.episode_return[i] = 0.0
                    next_obs, _ = env.reset()
                self.obs[i] = next_obs
            self.env_steps += len(self.envs)
        for i, seg in enumerate(self.segments):  # horizon cut: bootstrap from the current obs
            if seg.rewards:
                trajs.append(seg.cut(False, False, self.obs[i]))
                self.segments[i] = _Segment()
        return trajs

    def solved(self, target: float) -> bool:
        return len(self.finished) >= 20 and float(np.mean(self.finished[-20:])) >= target


@pytest.mark.timeout(60)
def test_ppo_solves_cartpole() -> None:
    seed = 0
    cfg = PPOConfig()
    rng = np.random.default_rng(seed)
    rollout = Rollout(N_ENVS, seed)
    space = ActionSpace.from_gymnasium(rollout.envs[0].action_space)
    params = init_params(rollout.obs.shape[1], space, cfg.hidden, rng)
    adam = Adam(lr=cfg.lr)

    while rollout.env_steps < MAX_ENV_STEPS:
        trajs = rollout.collect(lambda obs, rng: act(params, obs, space, rng), rng, HORIZON)
        stats = ppo_update(params, adam, trajs, cfg, rng)
        assert np.isfinite(stats["loss"])
        if rollout.solved(TARGET):
            break

    finished, env_steps = rollout.finished, rollout.env_steps
    assert len(finished) >= 20, f"only {len(finished)} episodes in {env_steps} steps"
    mean_last = float(np.mean(finished[-20:]))
    assert mean_last >= TARGET, f"mean of last 20 returns {mean_last:.1f} after {env_steps} steps"
