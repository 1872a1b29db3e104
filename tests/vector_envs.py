"""Environments the vector env tests start workers with (`vector_envs:count`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from conftest import TESTS_DIR, shared_forkserver

import stepbus.vector as sv

Made = Callable[..., sv.BusVectorEnv]


def closing_make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Made]:
    """A test's `stepbus.vector.make` (workers can import this module), its processes forked
    from the test process's fork server unless the test says otherwise: every env it made is
    closed after the test, and none of their processes is left running."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])))
    made: list[sv.BusVectorEnv] = []

    def factory(*args: Any, **kwargs: Any) -> sv.BusVectorEnv:
        # The suite makes dozens: forked, unless STEPBUS_TEST_FORKSERVER=0 says otherwise.
        kwargs.setdefault("context", "forkserver" if shared_forkserver() else "spawn")
        made.append(sv.make(*args, **kwargs))
        return made[-1]

    try:
        yield factory
    finally:
        pids = [pid for env in made if env.launched for pid in env.launched.pids()]
        for env in made:
            env.close()
        assert not [pid for pid in pids if alive(pid)], "close() leaves nothing running"


def alive(pid: int) -> bool:
    """A process that runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Count(gym.Env):
    """Counts its steps from the reset seed (0 without one); the reward is the action, and the
    episode terminates when the count reaches `max_count`: every autoreset shows in the
    observations, as in Gymnasium's own autoreset tests."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Discrete(5)
        self.action_space = gym.spaces.Discrete(5)
        self.count, self.max_count = 0, 3

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        super().reset(seed=seed)
        self.count = seed if seed is not None else 0
        return self.count, {}

    def step(self, action: Any) -> tuple[int, float, bool, bool, dict[str, Any]]:
        self.count += 1
        return self.count, float(action), self.count == self.max_count, False, {}

    def scale(self, x: Any, factor: float = 1.0) -> Any:
        """For `call`: arrays and numbers in, arrays out."""
        return np.asarray(x, np.float64) * factor + self.count


def count() -> gym.Env:
    return Count()


class Chatty(Count):
    """Count with infos of every kind that travels: Python and numpy scalars (their dtypes
    kept), strings, None, lists, small arrays, nested dicts; resets say their seed. With
    `unsendable`, a value no wire carries (an object) besides."""

    def __init__(self, unsendable: bool = False) -> None:
        super().__init__()
        self.unsendable = unsendable

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        obs, _ = super().reset(seed=seed, options=options)
        return obs, {"seeded": seed is not None, "start": np.int64(self.count)}

    def step(self, action: Any) -> tuple[int, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, _ = super().step(action)
        info: dict[str, Any] = {
            "count": self.count, "half": self.count / 2, "odd": bool(self.count % 2),
            "f32": np.float32(self.count + 0.5), "flag": np.bool_(terminated),
            "name": f"step {self.count}", "nothing": None, "pair": [self.count, "x"],
            "grid": np.full((2, 3), self.count, np.int16),
            "nested": {"a": np.uint8(self.count), "deeper": {"b": float(action)}}}
        if self.count % 2:  # a key some envs have on some steps: its mask says which
            info["sometimes"] = np.arange(self.count, dtype=np.float32)[:1]
        if self.unsendable:
            info["handle"] = object()
        return obs, reward, terminated, truncated, info


def chatty() -> gym.Env:
    return Chatty()


def chatty_unsendable() -> gym.Env:
    return Chatty(unsendable=True)
