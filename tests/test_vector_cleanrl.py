"""A CleanRL-style PPO loop (ppo.py's shape: reset with a seed, step with the policy's actions,
GAE, clipped updates, episode returns from Gymnasium's RecordEpisodeStatistics) runs on
stepbus.vector.make unchanged: given the same seeds it computes exactly what it computes on
SyncVectorEnv, update for update."""

from __future__ import annotations

from collections.abc import Iterator

import gymnasium as gym
import numpy as np
import pytest
import vector_envs
from vector_envs import Made

pytest.importorskip("torch")
import torch
from torch import nn

NUM_ENVS, NUM_STEPS, ITERATIONS, SEED = 4, 64, 3, 1


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Made]:
    yield from vector_envs.closing_make(monkeypatch)


class Agent(nn.Module):
    def __init__(self, obs_dim: int, actions: int) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(obs_dim, 32), nn.Tanh(), nn.Linear(32, 1))
        self.actor = nn.Sequential(nn.Linear(obs_dim, 32), nn.Tanh(), nn.Linear(32, actions))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, ...]:
        probs = torch.distributions.Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def ppo(envs: gym.vector.VectorEnv) -> tuple[list[float], list[float]]:
    """ppo.py's loop, shortened: the returns of the episodes that ended, and each update's
    loss."""
    torch.manual_seed(SEED)
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    assert isinstance(envs.single_observation_space, gym.spaces.Box)
    assert isinstance(envs.single_action_space, gym.spaces.Discrete)
    agent = Agent(int(np.prod(envs.single_observation_space.shape)),
                  int(envs.single_action_space.n))
    optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-3, eps=1e-5)
    obs = torch.zeros((NUM_STEPS, NUM_ENVS, *envs.single_observation_space.shape))
    actions, logprobs, rewards, dones, values = (torch.zeros((NUM_STEPS, NUM_ENVS))
                                                 for _ in range(5))
    next_obs_np, _ = envs.reset(seed=SEED)
    next_obs, next_done = torch.Tensor(next_obs_np), torch.zeros(NUM_ENVS)
    returns_seen, losses = [], []
    for _ in range(ITERATIONS):
        for step in range(NUM_STEPS):
            obs[step], dones[step] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[step], actions[step], logprobs[step] = value.flatten(), action, logprob
            next_obs_np, reward, terminations, truncations, infos = envs.step(action.numpy())
            next_done = torch.Tensor(np.logical_or(terminations, truncations).astype(float))
            rewards[step], next_obs = torch.tensor(reward).view(-1), torch.Tensor(next_obs_np)
            if "episode" in infos:
                returns_seen += [float(r) for r in infos["episode"]["r"][infos["_episode"]]]
        with torch.no_grad():
            advantages = torch.zeros_like(rewards)
            last = torch.zeros(NUM_ENVS)
            next_value = agent.get_value(next_obs).reshape(1, -1)
            for t in reversed(range(NUM_STEPS)):
                nonterminal = 1.0 - (next_done if t == NUM_STEPS - 1 else dones[t + 1])
                nxt = next_value if t == NUM_STEPS - 1 else values[t + 1]
                delta = rewards[t] + 0.99 * nxt * nonterminal - values[t]
                advantages[t] = last = delta + 0.99 * 0.95 * nonterminal * last
            returns = advantages + values
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(
            obs.reshape(-1, obs.shape[-1]), actions.reshape(-1).long())
        ratio = (newlogprob - logprobs.reshape(-1)).exp()
        b_adv = advantages.reshape(-1)
        pg_loss = torch.max(-b_adv * ratio, -b_adv * ratio.clamp(0.8, 1.2)).mean()
        loss = pg_loss + 0.5 * ((newvalue.view(-1) - returns.reshape(-1)) ** 2).mean()
        optimizer.zero_grad()
        (loss - 0.01 * entropy.mean()).backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    envs.close()
    return returns_seen, losses


def test_a_cleanrl_loop_runs_unchanged_and_computes_what_it_does_on_sync_vector_env(
        make: Made) -> None:
    torch.set_num_threads(1)
    expected = ppo(gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * NUM_ENVS))
    got = ppo(make("CartPole-v1", NUM_ENVS, workers=2))
    assert got == expected
    assert len(got[0]) >= 5 and len(got[1]) == ITERATIONS
