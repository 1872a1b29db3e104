"""Benchmark environments, shipped so anyone can measure their own setup the way
`benchmarks/throughput.py` measures ours (`--env stepbus.workers.bench_envs:heavy_tailed`).

- `heavy_tailed`: each step costs 1 ms of CPU with probability 0.9 and 10 ms with 0.1 (mean
  1.9 ms), so a vectorizer that waits for the slowest env at every step shows it.
- `cpu_bound`: each step costs `step_ms` (1 ms by default) of CPU: the scaling target.
- `frames`: 84x84x4 uint8 observations (Atari-sized) at about zero step cost: what moving
  observation bytes costs.

Step costs are burnt as CPU time of the stepping thread, not wall time and not sleep: a
busy-wait on the wall clock would count time the process spent descheduled as work done and
flatter a machine with more processes than cores; sleeping would not load a core at all.
Worker factories are called with no arguments (`--env module:factory`), so every factory
here has usable defaults.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import gymnasium as gym
import numpy as np

HEAVY_TAILED_COSTS_MS = (1.0, 10.0)
HEAVY_TAILED_PROBS = (0.9, 0.1)
HEAVY_TAILED_MEAN_MS = float(np.dot(HEAVY_TAILED_COSTS_MS, HEAVY_TAILED_PROBS))  # 1.9 ms
FRAME_SHAPE = (84, 84, 4)
FRAME_POOL = 16  # distinct frames an episode cycles through


def burn_cpu(seconds: float) -> None:
    """Spin until this thread has used `seconds` of CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class BurnEnv(gym.Env):
    """A small Box/Discrete env whose steps cost CPU time drawn from a discrete distribution.

    The cost of each step comes from the env's `np_random`, which `reset(seed=...)` seeds, so an
    episode's costs and observations replay from its seed. Episodes end by truncation after
    `max_episode_steps` steps; they never terminate.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, costs_ms: tuple[float, ...] = (1.0,), probs: tuple[float, ...] = (1.0,),
                 max_episode_steps: int = 200, obs_dim: int = 4) -> None:
        if len(costs_ms) != len(probs) or not np.isclose(sum(probs), 1.0):
            raise ValueError(f"costs {costs_ms} and probabilities {probs} do not match")
        self.costs_s = np.asarray(costs_ms, np.float64) / 1000.0
        self.cumulative = np.cumsum(probs)
        self.cumulative[-1] = 1.0  # a draw of 0.999... never falls off the end
        self.max_episode_steps = max_episode_steps
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (obs_dim,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0
        self.last_cost_s = 0.0  # what the last step burnt (for tests and the curious)

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        rng = self.np_random
        self.last_cost_s = float(self.costs_s[np.searchsorted(self.cumulative, rng.random(),
                                                              side="right")])
        burn_cpu(self.last_cost_s)
        self.t += 1
        return self._obs(), 1.0, False, self.t >= self.max_episode_steps, {}

    def _obs(self) -> np.ndarray:
        return self.np_random.uniform(-1.0, 1.0, self.observation_space.shape).astype(np.float32)


@functools.lru_cache(maxsize=1)
def _frame_pool() -> np.ndarray:
    """FRAME_POOL noise frames, made once per process and read-only, so every env can hand out
    the same buffers forever: nobody can write to them, so nobody can see one change."""
    pool = np.random.default_rng(0).integers(0, 256, (FRAME_POOL, *FRAME_SHAPE), np.uint8)
    pool.setflags(write=False)
    return pool


class FrameEnv(gym.Env):
    """Atari-sized observations (84x84x4 uint8) for about zero step cost.

    Observations are read-only views into one preallocated pool of noise frames per process
    (incompressible, so nothing on the way can cheat by compressing), cycled from an offset the
    reset seed picks. A step allocates nothing and copies nothing: whatever the pipeline costs
    per frame is the pipeline's. Episodes end by truncation after `max_episode_steps` steps.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, max_episode_steps: int = 1000) -> None:
        self.pool = _frame_pool()
        self.max_episode_steps = max_episode_steps
        self.observation_space = gym.spaces.Box(0, 255, FRAME_SHAPE, np.uint8)
        self.action_space = gym.spaces.Discrete(4)
        self.t = 0
        self.offset = 0

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        self.offset = int(self.np_random.integers(FRAME_POOL))
        return self.pool[self.offset], {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        obs = self.pool[(self.offset + self.t) % FRAME_POOL]
        return obs, 1.0, False, self.t >= self.max_episode_steps, {}


def heavy_tailed() -> BurnEnv:
    """1 ms of CPU per step with probability 0.9, 10 ms with 0.1 (mean 1.9 ms)."""
    return BurnEnv(HEAVY_TAILED_COSTS_MS, HEAVY_TAILED_PROBS)


def cpu_bound(step_ms: float = 1.0) -> BurnEnv:
    """`step_ms` of CPU per step, every step (1 ms as `--env ...:cpu_bound`)."""
    return BurnEnv((step_ms,), (1.0,))


def frames() -> FrameEnv:
    """84x84x4 uint8 observations at about zero step cost."""
    return FrameEnv()
