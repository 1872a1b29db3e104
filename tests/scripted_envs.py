"""Environments the tests start workers with (`--env scripted_envs:FACTORY`)."""

from __future__ import annotations

import json
import os
import time

import gymnasium as gym


class ResetRecorder(gym.Wrapper):
    """CartPole that appends every reset's options to $RESET_LOG, one JSON line each."""

    def reset(self, *, seed=None, options=None):
        with open(os.environ["RESET_LOG"], "a") as f:
            f.write(json.dumps(options or {}) + "\n")
        return self.env.reset(seed=seed)


def recording_cartpole() -> gym.Env:
    return ResetRecorder(gym.make("CartPole-v1"))


class Flaky(gym.Wrapper):
    """CartPole whose every instance raises on its 40th step: a buggy user environment."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == 40:
            raise RuntimeError("simulated physics blow-up")
        return self.env.step(action)


def flaky_cartpole() -> gym.Env:
    return Flaky(gym.make("CartPole-v1"))


class Slow(gym.Wrapper):
    """CartPole whose every step takes 0.5 s of wall time (a simulator behind a socket)."""

    def step(self, action):
        time.sleep(0.5)
        return self.env.step(action)


def slow_cartpole() -> gym.Env:
    return Slow(gym.make("CartPole-v1"))


class Picky(gym.Wrapper):
    """CartPole that raises on reset when the options ask for a level it does not have."""

    def reset(self, *, seed=None, options=None):
        if options and options.get("level", 0) > 3:
            raise ValueError(f"no level {options['level']}")
        return self.env.reset(seed=seed)


def picky_cartpole() -> gym.Env:
    return Picky(gym.make("CartPole-v1"))
