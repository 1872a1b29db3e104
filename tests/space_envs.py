"""Environments with every kind of Gymnasium space and action masks, for the tests
(`--env space_envs:FACTORY`). Each is a matching game: the reward says how much of the action
matches a part of the observation, so a policy learns it only if that part reaches the model
intact. Episodes last `LENGTH` steps; a perfect return is LENGTH."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

LENGTH = 8


class Match(gym.Env):
    """Observation `observation_space` (sampled each step), action `action_space`; the reward
    is `score(obs, action)` in [0, 1]."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space,
                 score: Any) -> None:
        self.observation_space, self.action_space, self.score = (observation_space,
                                                                 action_space, score)
        self.t, self.obs = 0, None

    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        self.t, self.obs = 0, self.observation_space.sample()
        return self.obs, {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        assert self.action_space.contains(np.asarray(action, self.action_space.dtype)), action
        reward = float(self.score(self.obs, action))
        self.t += 1
        self.obs = self.observation_space.sample()
        return self.obs, reward, False, self.t >= LENGTH, {}


def match_discrete() -> Match:
    """Discrete(4, start=1) observations: act the cell's number minus one."""
    return Match(spaces.Discrete(4, start=1), spaces.Discrete(4),
                 lambda obs, a: int(a) == int(obs) - 1)


def match_dict() -> Match:
    """A nested Dict of every leaf kind; act out its MultiDiscrete leaf."""
    obs = spaces.Dict({
        "pos": spaces.Box(-1, 1, (2,), np.float32),
        "cell": spaces.Discrete(5, start=-2),
        "inner": spaces.Tuple((spaces.MultiBinary(3), spaces.MultiDiscrete([3, 3]),
                               spaces.Box(0, 3, (2, 2), np.uint8))),
    })
    return Match(obs, spaces.MultiDiscrete([3, 3]),
                 lambda o, a: float(np.mean(np.asarray(a) == o["inner"][1])))


def match_bits() -> Match:
    """A Tuple of MultiBinary and Box; act out the bits (MultiBinary actions)."""
    obs = spaces.Tuple((spaces.MultiBinary(3), spaces.Box(-1, 1, (1,), np.float32)))
    return Match(obs, spaces.MultiBinary(3),
                 lambda o, a: float(np.mean(np.asarray(a) == o[0])))


class Forbidden(RuntimeError):
    """A masked action reached the env."""


class Masked(gym.Env):
    """Discrete(6) actions, two of them allowed at each step, and a reward of 1 for the first
    allowed one (0.5 for the other). A masked action raises `Forbidden`, which the worker
    reports: a run that ever takes one shows an env error. The mask is in `info` (Gymnasium's
    convention) or in a Dict observation (PettingZoo's), as `in_obs` says."""

    action_space: spaces.Discrete

    def __init__(self, in_obs: bool) -> None:
        self.in_obs = in_obs
        n = 6
        self.action_space = spaces.Discrete(n)
        cue = spaces.Box(-1, 1, (n,), np.float32)
        self.observation_space = (spaces.Dict({"observation": cue,
                                               "action_mask": spaces.MultiBinary(n)})
                                  if in_obs else cue)
        self.t, self.allowed = 0, np.zeros(n, np.int8)

    def _observe(self) -> tuple[Any, dict]:
        self.allowed = np.zeros(self.action_space.n, np.int8)
        self.allowed[self.np_random.choice(self.action_space.n, 2, replace=False)] = 1
        self.best = int(np.flatnonzero(self.allowed)[0])
        cue = np.zeros(self.action_space.n, np.float32)
        cue[self.best] = 1.0
        if self.in_obs:
            return {"observation": cue, "action_mask": self.allowed.copy()}, {}
        return cue, {"action_mask": self.allowed.copy()}

    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.t = 0
        return self._observe()

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        if not self.allowed[int(action)]:
            raise Forbidden(f"action {int(action)} was masked ({self.allowed.tolist()})")
        reward = 1.0 if int(action) == self.best else 0.5
        self.t += 1
        obs, info = self._observe()
        return obs, reward, False, self.t >= LENGTH, info


def masked_info() -> Masked:
    return Masked(in_obs=False)


def masked_obs() -> Masked:
    return Masked(in_obs=True)


class MaskedPair:
    """A PettingZoo parallel env of two `Masked` agents: Dict observations with an
    "action_mask" key (PettingZoo's convention), or masks in each agent's info."""

    metadata: dict = {}

    def __init__(self, in_obs: bool) -> None:
        self.possible_agents = ["left", "right"]
        self.agents: list[str] = []
        self.games = {a: Masked(in_obs) for a in self.possible_agents}

    def observation_space(self, agent: str) -> gym.Space:
        return self.games[agent].observation_space

    def action_space(self, agent: str) -> gym.Space:
        return self.games[agent].action_space

    def reset(self, seed: int | None = None, options: dict | None = None
              ) -> tuple[dict, dict]:
        self.agents = list(self.possible_agents)
        firsts = {a: g.reset(seed=None if seed is None else seed + i)
                  for i, (a, g) in enumerate(self.games.items())}
        return {a: f[0] for a, f in firsts.items()}, {a: f[1] for a, f in firsts.items()}

    def step(self, actions: dict) -> tuple[dict, dict, dict, dict, dict]:
        out = {a: self.games[a].step(actions[a]) for a in self.agents}
        obs, rew, term, trunc, info = ({a: o[i] for a, o in out.items()} for i in range(5))
        if all(trunc.values()):
            self.agents = []
        return obs, rew, term, trunc, info

    def close(self) -> None:
        pass


def masked_pair_obs() -> MaskedPair:
    return MaskedPair(in_obs=True)


def masked_pair_info() -> MaskedPair:
    return MaskedPair(in_obs=False)


class FarTarget(gym.Env):
    """A continuous task that needs observation normalisation: each step shows a target x in
    [-1, 1] as 1000 + 10 x (large, offset units, as raw sensor readings come) and rewards
    -(a - x)^2 for the action a in [-1, 1]; 10 steps an episode. Raw, the offset saturates
    every tanh unit and no policy beats a = 0 (about -3.3 an episode, less its noise);
    normalised, a = x is easily learned."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self) -> None:
        self.x, self.t = 0.0, 0

    def observe(self) -> np.ndarray:
        self.x = float(self.np_random.uniform(-1.0, 1.0))
        return np.array([1000.0 + 10.0 * self.x], np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        return self.observe(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = -float((float(np.asarray(action).reshape(-1)[0]) - self.x) ** 2)
        self.t += 1
        return self.observe(), reward, self.t >= 10, False, {}


def far_target() -> FarTarget:
    return FarTarget()
