"""The built-in Nature CNN (`--model torch` on image observations) learns from pixels, in
process as test_torch_models' CartPole run does: the broker's TorchPolicy acts on channels-last
uint8 frames, TorchPPO learns, with CleanRL ppo_atari.py's settings. The task is small enough
for the suite: find the bright block in a 36x36 image (the CNN's smallest, docs/models.md)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from test_ppo_learns import Rollout

from stepbus import policy
from stepbus.bus import protocol as p
from stepbus.models import torch_agents, torch_policy
from stepbus.trainer import ppo, torch_ppo

SIDE = torch_agents.MIN_IMAGE_SIDE  # 36 pixels a side
BLOCK = 8  # pixels a side of the block, somewhere inside its quadrant
STEPS = 8  # frames an episode: a return of 8 finds every block, guessing makes 2
SPEC = p.SpaceSpec([SIDE, SIDE, 3], "|u1", "discrete", action_n=4)
N_ENVS, HORIZON = 8, 32  # a batch of 256 steps, as the learner's default
# CleanRL ppo_atari.py's settings (its four minibatches of this batch)
ATARI = ppo.PPOConfig(lr=2.5e-4, n_epochs=4, clip_range=0.1, ent_coef=0.01, gamma=0.99,
                      gae_lambda=0.95, minibatch_size=64)
TARGET = 7.5  # mean return of the last 20 episodes: about 30 updates, a few seconds
MAX_UPDATES = 150


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FindTheBlock(gym.Env):
    """A channels-last RGB frame, black but for a white block in one of its four quadrants;
    the action names the quadrant (0 top left, 1 top right, 2 bottom left, 3 bottom right),
    reward 1 if right. Every step shows a new block; an episode is STEPS frames."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, (SIDE, SIDE, 3), np.uint8)
        self.action_space = gym.spaces.Discrete(4)
        self.target, self.t = 0, 0

    def frame(self) -> np.ndarray:
        self.target = int(self.np_random.integers(4))
        half = SIDE // 2
        top = (self.target // 2) * half + int(self.np_random.integers(half - BLOCK + 1))
        left = (self.target % 2) * half + int(self.np_random.integers(half - BLOCK + 1))
        image = np.zeros((SIDE, SIDE, 3), np.uint8)
        image[top:top + BLOCK, left:left + BLOCK] = 255
        return image

    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        return self.frame(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = float(int(action) == self.target)
        self.t += 1
        return self.frame(), reward, self.t >= STEPS, False, {}


class PixelRollout(Rollout):
    """test_ppo_learns' Rollout (its trajectory cuts and returns) over FindTheBlock envs."""

    def __init__(self, n_envs: int, seed: int) -> None:
        super().__init__(n_envs, seed)
        self.envs = [FindTheBlock() for _ in range(n_envs)]
        self.obs = np.stack([env.reset(seed=seed * 1000 + i)[0]
                             for i, env in enumerate(self.envs)])


def train(seed: int, max_updates: int) -> tuple[PixelRollout, dict[str, np.ndarray]]:
    """Updates until the last 20 episodes reach TARGET or `max_updates`; the rollout and the
    CNN's weights."""
    torch.manual_seed(seed)  # the CNN's initial weights
    rng = np.random.default_rng(seed)
    rollout = PixelRollout(N_ENVS, seed)
    acting = policy.make_policy("torch", SPEC)
    assert isinstance(acting, torch_policy.TorchPolicy)
    assert isinstance(acting.module, torch_agents.NatureCNNAgent)
    algo = torch_ppo.TorchPPO(acting.module, acting.action, ATARI, rng)
    for version in range(max_updates):
        if rollout.solved(TARGET):
            break
        acting.load(torch_policy.state_arrays(acting.module), version)
        stats = algo.update(rollout.collect(acting.act, rng, HORIZON))
        assert np.isfinite(stats["loss"])
    return rollout, torch_policy.state_arrays(acting.module)


@pytest.mark.timeout(90)
def test_the_built_in_cnn_learns_where_the_block_is_from_uint8_frames() -> None:
    rollout, _ = train(seed=0, max_updates=MAX_UPDATES)
    first, last = rollout.finished[:20], rollout.finished[-20:]
    assert np.mean(first) < 3.5, first  # guessing (2 of 8) before it learned
    assert rollout.solved(TARGET), (rollout.env_steps, last)


def test_a_cnn_run_from_one_seed_is_the_same_twice() -> None:
    """Seeded envs, initial weights, sampling and minibatches: the same returns and weights
    bit for bit (another seed, other weights)."""
    (one, weights_one), (two, weights_two), (_, weights_other) = (
        train(seed, max_updates=2) for seed in (3, 3, 4))
    assert one.finished == two.finished and one.env_steps == two.env_steps == 2 * 256
    assert all(weights_one[k].tobytes() == weights_two[k].tobytes() for k in weights_one)
    assert weights_one["head.out.weight"].tobytes() != weights_other["head.out.weight"].tobytes()
