"""End-to-end learning check, in process: the numpy PPO solves CartPole-v1 like SB3 does.

rl-zoo's SB3 PPO settings (8 envs x 32 steps, 20 epochs, lr 1e-3) solve CartPole in roughly
25-38k env steps; this run (seed 0) takes about 29k steps and ~3 s.
"""

from __future__ import annotations

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


@pytest.mark.timeout(60)
def test_ppo_solves_cartpole() -> None:
    seed = 0
    cfg = PPOConfig()
    rng = np.random.default_rng(seed)
    envs = [gym.make("CartPole-v1") for _ in range(N_ENVS)]
    space = ActionSpace.from_gymnasium(envs[0].action_space)
    obs = np.stack([env.reset(seed=seed * 1000 + i)[0] for i, env in enumerate(envs)])
    params = init_params(obs.shape[1], space, cfg.hidden, rng)
    adam = Adam(lr=cfg.lr)

    segments = [_Segment() for _ in envs]
    episode_return = np.zeros(N_ENVS)
    finished: list[float] = []
    env_steps = 0
    while env_steps < MAX_ENV_STEPS:
        trajs: list[Trajectory] = []
        for _ in range(HORIZON):
            actions, logp, values = act(params, obs, space, rng)
            for i, env in enumerate(envs):
                next_obs, reward, terminated, truncated, _ = env.step(int(actions[i]))
                seg = segments[i]
                seg.obs.append(obs[i].copy())
                seg.actions.append(int(actions[i]))
                seg.logp.append(float(logp[i]))
                seg.values.append(float(values[i]))
                seg.rewards.append(float(reward))
                episode_return[i] += reward
                if terminated or truncated:
                    # next_obs is the true final observation: bootstrapped iff truncated
                    trajs.append(seg.cut(terminated, truncated, next_obs))
                    segments[i] = _Segment()
                    finished.append(episode_return[i])
                    episode_return[i] = 0.0
                    next_obs, _ = env.reset()
                obs[i] = next_obs
            env_steps += N_ENVS
        for i, seg in enumerate(segments):  # horizon cut: bootstrap from the current obs
            if seg.rewards:
                trajs.append(seg.cut(False, False, obs[i]))
                segments[i] = _Segment()

        stats = ppo_update(params, adam, trajs, cfg, rng)
        assert np.isfinite(stats["loss"])
        if len(finished) >= 20 and np.mean(finished[-20:]) >= TARGET:
            break

    assert len(finished) >= 20, f"only {len(finished)} episodes in {env_steps} steps"
    mean_last = float(np.mean(finished[-20:]))
    assert mean_last >= TARGET, f"mean of last 20 returns {mean_last:.1f} after {env_steps} steps"
