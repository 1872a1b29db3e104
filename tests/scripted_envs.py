"""Environments the tests start workers with (`--env scripted_envs:FACTORY`)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

import gymnasium as gym
import numpy as np


class ResetRecorder(gym.Wrapper):
    """CartPole that appends every reset's options to $RESET_LOG, one JSON line each."""

    def reset(self, *, seed=None, options=None):
        with open(os.environ["RESET_LOG"], "a") as f:
            f.write(json.dumps(options or {}) + "\n")
        return self.env.reset(seed=seed)


# CartPole registered as solved at a mean return of 30 (CartPole-v1 says 475): a run given no
# --target-return ends there after a second or two of learning (`--env
# scripted_envs:EasyCartPole-v0`: gymnasium imports this module, which registers the id).
gym.register("EasyCartPole-v0", entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
             max_episode_steps=500, reward_threshold=30.0)


def recording_cartpole() -> gym.Env:
    return ResetRecorder(gym.make("CartPole-v1"))


class Flaky(gym.Wrapper):
    """CartPole whose first 3 instances in a process raise on their 40th step: a buggy user
    environment, but rare enough to stay within the worker's restart bound (10 a minute)."""

    made = 0  # instances created in this process

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        Flaky.made += 1
        self.raises = Flaky.made <= 3
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == 40 and self.raises:
            raise RuntimeError("simulated physics blow-up")
        return self.env.step(action)


def flaky_cartpole() -> gym.Env:
    return Flaky(gym.make("CartPole-v1"))


class Hundredth(gym.Wrapper):
    """CartPole that raises at its 100th step: a bug to find under the serial runner."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == 100:
            raise ZeroDivisionError("the hundredth step divides by zero")  # HUNDREDTH LINE
        return self.env.step(action)


def hundredth_step_raises() -> gym.Env:
    return Hundredth(gym.make("CartPole-v1"))


class Slow(gym.Wrapper):
    """CartPole whose every step takes 0.5 s of wall time (a simulator behind a socket)."""

    def step(self, action):
        time.sleep(0.5)
        return self.env.step(action)


def slow_cartpole() -> gym.Env:
    return Slow(gym.make("CartPole-v1"))


class CSleeping(gym.Wrapper):
    """CartPole whose every step waits 0.6 s inside one C call (usleep through ctypes, which
    lets the GIL go): a simulator blocked in native code, which no signal handler could beat
    through and whose wait a timer signal would cut short (nanosleep returns early on EINTR)."""

    def step(self, action):
        ctypes.CDLL(None).usleep(600_000)
        return self.env.step(action)


def c_sleeping_cartpole() -> gym.Env:
    return CSleeping(gym.make("CartPole-v1"))


class Stalling(gym.Wrapper):
    """CartPole whose every step takes 2.5 s: one env call longer than the 1.5 s liveness
    timeout (a simulator that computes for a while before it answers)."""

    def step(self, action):
        time.sleep(2.5)
        return self.env.step(action)


def stalling_cartpole() -> gym.Env:
    return Stalling(gym.make("CartPole-v1"))


class SlowReset(gym.Wrapper):
    """CartPole whose every reset takes 4 s (a simulator loading a level), longer than a
    supervisor's 3 s of silence; each reset done is a line in the file STEPBUS_TEST_MARK names."""

    def reset(self, **kwargs):
        time.sleep(4.0)
        out = self.env.reset(**kwargs)
        with open(os.environ["STEPBUS_TEST_MARK"], "a") as mark:
            mark.write("reset\n")
        return out


def slow_reset_cartpole() -> gym.Env:
    return SlowReset(gym.make("CartPole-v1"))


class Sleepy(gym.Wrapper):
    """CartPole whose steps take 5 ms: a worker is nearly always inside a step (so a signal
    lands mid-step), and stepping stays well below what the trainer takes in (so the credit
    window never pauses it)."""

    def step(self, action):
        time.sleep(0.005)
        return self.env.step(action)


def sleepy_cartpole() -> gym.Env:
    return Sleepy(gym.make("CartPole-v1"))


class Broken(gym.Wrapper):
    """CartPole whose every instance raises from its 3rd step on: an env that cannot work."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps >= 3:
            raise RuntimeError("simulated broken build")
        return self.env.step(action)


def broken_cartpole() -> gym.Env:
    return Broken(gym.make("CartPole-v1"))


class Picky(gym.Wrapper):
    """CartPole that raises on reset when the options ask for a level it does not have."""

    def reset(self, *, seed=None, options=None):
        if options and options.get("level", 0) > 3:
            raise ValueError(f"no level {options['level']}")
        return self.env.reset(seed=seed)


def picky_cartpole() -> gym.Env:
    return Picky(gym.make("CartPole-v1"))


class RelayTeam:
    """A PettingZoo-style parallel env (duck-typed, no pettingzoo import) whose agents do every
    thing the assembler must handle, on a fixed 5-step script per episode:
    `a` acts throughout and is truncated after step 5; `b` terminates after step 2 while the
    others go on; `c` appears after step 1; `d` vanishes after step 3 (leaves without a done
    flag). Observations are [agent index, t]; every acting agent gets reward 1 per step."""

    possible_agents = ["a", "b", "c", "d"]

    def __init__(self) -> None:
        self.t = 0
        self.agents: list[str] = []

    def observation_space(self, agent: str) -> gym.spaces.Box:
        return gym.spaces.Box(-1e6, 1e6, (2,), np.float32)

    def action_space(self, agent: str) -> gym.spaces.Discrete:
        return gym.spaces.Discrete(2)

    def _obs(self) -> dict:
        return {a: np.array([self.possible_agents.index(a), self.t], np.float32)
                for a in self.agents}

    def reset(self, seed=None, options=None):
        self.t, self.agents = 0, ["a", "b", "d"]
        return self._obs(), {a: {} for a in self.agents}

    def step(self, actions: dict):
        assert set(actions) == set(self.agents), (sorted(actions), self.agents)
        self.t += 1
        acting = list(self.agents)
        terminated = {a: a == "b" and self.t == 2 for a in acting}
        truncated = {a: self.t == 5 for a in acting}
        rewards = dict.fromkeys(acting, 1.0)
        obs = {a: np.array([self.possible_agents.index(a), self.t], np.float32) for a in acting}
        self.agents = [a for a in acting if not (terminated[a] or truncated[a])]
        if self.t == 1:
            self.agents.append("c")
        if self.t == 3:
            self.agents.remove("d")
        obs.update(self._obs())
        return obs, rewards, terminated, truncated, {a: {} for a in acting}

    def close(self) -> None:
        pass


def relay_team() -> RelayTeam:
    return RelayTeam()


class Pair:
    """Two agents, 3-step episodes, to pin down how episodes end (see the factories below)."""

    def __init__(self, keys: list, end: str) -> None:
        self.possible_agents, self.end = keys, end
        self.t = 0
        self.agents: list = []

    def observation_space(self, agent) -> gym.spaces.Box:
        return gym.spaces.Box(-1e6, 1e6, (2,), np.float32)

    def action_space(self, agent) -> gym.spaces.Discrete:
        return gym.spaces.Discrete(2)

    def _obs(self, agents: list) -> dict:
        return {a: np.array([self.possible_agents.index(a), self.t], np.float32) for a in agents}

    def reset(self, seed=None, options=None):
        self.t, self.agents = 0, list(self.possible_agents)
        return self._obs(self.agents), {}

    def step(self, actions: dict):
        self.t += 1
        first = self.possible_agents[0]
        acting, last = list(self.agents), self.t == 3
        # At the end the first agent is truncated; the second leaves without a done flag,
        # except in "keeps" mode, where both are truncated and stay listed.
        truncated = {a: last and (self.end == "keeps" or a == first) for a in acting}
        terminated = dict.fromkeys(acting, False)
        if last and self.end != "keeps":
            self.agents = []
        return (self._obs(acting), dict.fromkeys(acting, 1.0), terminated, truncated,
                {a: {} for a in acting})

    def close(self) -> None:
        pass


def int_keys() -> Pair:
    return Pair([0, 1], "vanish")


def vanish_at_end() -> Pair:
    return Pair(["a", "b"], "vanish")


def keeps_done_agents() -> Pair:
    return Pair(["a", "b"], "keeps")


class Leaver(Pair):
    """Two agents: `b` leaves after step 1 without a done flag and without an observation;
    step 2 raises (the env's fault), so `a` has no observation after its last action either."""

    def __init__(self) -> None:
        super().__init__(["a", "b"], "vanish")

    def step(self, actions: dict):
        self.t += 1
        if self.t == 2:
            raise RuntimeError("simulated crash")
        self.agents = ["a"]
        return (self._obs(["a"]), dict.fromkeys(actions, 1.0), dict.fromkeys(actions, False),
                dict.fromkeys(actions, False), {})


def leaves_unobserved() -> Leaver:
    return Leaver()


class PickyAndFlaky(gym.Wrapper):
    """CartPole that rejects reset options with level > 3 and whose first instance in a
    process raises once, on its second step."""

    raised = False

    def reset(self, *, seed=None, options=None):
        if (options or {}).get("level", 0) > 3:
            raise ValueError("no such level")
        return self.env.reset(seed=seed)

    def step(self, action):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 2 and not PickyAndFlaky.raised:
            PickyAndFlaky.raised = True
            raise RuntimeError("simulated crash")
        return self.env.step(action)


def picky_and_flaky() -> gym.Env:
    return PickyAndFlaky(gym.make("CartPole-v1"))


STAMP_SHAPE = (32, 32, 4)


def stamp(seed: int, t: int) -> np.ndarray:
    """Observation t of the episode reset with `seed`: what `StampFrames` returns, so a test can
    check every observation a trajectory carries, bit for bit."""
    frame = np.full(STAMP_SHAPE, (seed * 7 + t) % 256, np.uint8)
    frame.reshape(-1)[:16] = np.frombuffer(np.array([seed, t], np.int64).tobytes(), np.uint8)
    return frame


class StampFrames(gym.Env):
    """uint8 frames that say which episode (reset seed) and step they are; 50-step episodes."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, STAMP_SHAPE, np.uint8)
        self.action_space = gym.spaces.Discrete(2)
        self.seed, self.t = 0, 0

    def reset(self, *, seed=None, options=None):
        self.seed, self.t = int(seed or 0), 0
        return stamp(self.seed, 0), {}

    def step(self, action):
        self.t += 1
        return stamp(self.seed, self.t), 1.0, False, self.t >= 50, {}


def stamp_frames() -> StampFrames:
    return StampFrames()


def segfaulting_cartpole() -> gym.Env:
    """An env whose making takes its whole worker down, as a native crash would: a line on
    stderr, then SIGSEGV (nothing Python could catch)."""
    print("simulated native crash in the env", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
    raise AssertionError("unreachable")
