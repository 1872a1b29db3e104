"""Image-observation games for `--env module:callable`: MinAtar Breakout and Atari Breakout.

    stepbus worker --env stepbus.workers.games:minatar_breakout
    stepbus worker --env stepbus.workers.games:atari_breakout

Both give channels-last frames, the layout `--model torch`'s built-in CNNs take (docs/models.md):
MinAtar's are 10x10x4 bool already; Atari's are stacked by Gymnasium's FrameStackObservation on
axis 0, (4, 84, 84), so `atari_breakout` moves the stack to the last axis, (84, 84, 4), in the
env rather than the model, and every model sees one image layout. Each needs its package
(`minatar`; `ale-py` and `opencv-python-headless` for AtariPreprocessing), imported here only
when the env is made.
"""

from __future__ import annotations

import importlib
from typing import Any, cast

import gymnasium as gym
import numpy as np

ATARI_FRAME_SIDE = 84
ATARI_STACK = 4


def minatar_breakout() -> gym.Env:
    """MinAtar's Breakout (`MinAtar/Breakout-v1`): 10x10 frames of 4 bool channels (paddle,
    ball, trail, bricks), 3 actions, reward 1 a brick; an episode ends when the ball is lost."""
    importlib.import_module("minatar.gym").register_envs()
    return gym.make("MinAtar/Breakout-v1")


def channels_last(obs: np.ndarray) -> np.ndarray:
    """A frame stack (4, 84, 84) as one channels-last image (84, 84, 4), contiguous: OpenCV's
    channel merge interleaves the frames in 3 us, where numpy's strided copy of the moved axis
    takes 31 us, a twentieth of an Atari step."""
    merged = importlib.import_module("cv2").merge(list(obs))
    return np.asarray(merged).reshape(*obs.shape[1:], len(obs))


class SeedWithoutReload(gym.Wrapper):
    """ale-py reloads the ROM whenever `reset` is given a seed (100 ms here, against 5 ms for a
    reset without one), and a stepbus worker seeds every episode: at Breakout's few hundred
    steps an episode, that was half a worker's CPU. The first seeded reset seeds and loads the
    emulator; later ones seed only the generator the no-ops at reset are drawn from, and the
    emulator's own (sticky actions) carries on, so a worker's run is as reproducible as before
    but an episode no longer replays from its seed alone."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.loaded = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[Any, dict[str, Any]]:
        if seed is None or not self.loaded:
            self.loaded = self.loaded or seed is not None
            return self.env.reset(seed=seed, options=options)
        self.env.unwrapped.np_random = gym.utils.seeding.np_random(seed)[0]
        return self.env.reset(options=options)


class UnreadScreen(gym.ObservationWrapper):
    """AtariPreprocessing reads the two frames it max-pools from the emulator itself
    (`ale.getScreenGrayscale`) and drops the observation the base env returns on each of the 4
    frames of a step, which ale-py would draw for nothing (a tenth of a step's CPU). So the
    base env returns its 128 bytes of RAM, and this wrapper shows AtariPreprocessing what it
    sizes its buffers from, the screen's space, with one blank screen for each observation it
    drops. The frames that come out are the same (tests/test_benchmarks_games.py)."""

    def __init__(self, env: gym.Env, screen: tuple[int, int]) -> None:
        super().__init__(env)
        self.observation_space = gym.spaces.Box(0, 255, screen, np.uint8)
        self.blank = np.zeros(screen, np.uint8)
        self.blank.flags.writeable = False

    def observation(self, observation: Any) -> np.ndarray:
        return self.blank


def atari_breakout() -> gym.Env:
    """`ALE/Breakout-v5` as CleanRL's ppo_atari.py sees it: AtariPreprocessing (up to 30 no-ops
    at reset, 4 frames a step with the max of the last two, 84x84 grayscale) on the base env
    with frameskip=1 (v5 skips 4 frames itself, so the wrapper's skipping would repeat it), and
    the last 4 frames stacked, channels last. v5's sticky actions (0.25) are kept; seeded resets
    after the first do not reload the emulator (`SeedWithoutReload`), and the screen is drawn
    only for the frames AtariPreprocessing reads (`UnreadScreen`)."""
    from gymnasium.wrappers import (
        AtariPreprocessing,
        FrameStackObservation,
        TransformObservation,
    )

    gym.register_envs(importlib.import_module("ale_py"))
    base = gym.make("ALE/Breakout-v5", frameskip=1, obs_type="ram")
    rows, columns = cast(Any, base.unwrapped).ale.getScreenDims()  # ale-py's env, untyped
    env: gym.Env = UnreadScreen(SeedWithoutReload(base), (rows, columns))
    env = AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=ATARI_FRAME_SIDE,
                             grayscale_obs=True)
    stacked = FrameStackObservation(env, ATARI_STACK)
    space = gym.spaces.Box(0, 255, (ATARI_FRAME_SIDE, ATARI_FRAME_SIDE, ATARI_STACK), np.uint8)
    return TransformObservation(stacked, channels_last, space)


def make(name: str) -> Any:
    """One of this module's games by function name, for a benchmark's own vector env."""
    return {"minatar_breakout": minatar_breakout, "atari_breakout": atari_breakout}[name]()
