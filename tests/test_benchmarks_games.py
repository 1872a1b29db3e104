"""The image-game benchmarks still run end to end (their smoke versions: benchmarks are not
tests, this only proves they work and leave nothing behind), and the games are what the
built-in CNNs take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from conftest import REPO

from stepbus.workers import games
from stepbus.workers.envs import make_env, space_spec

sys.path.insert(0, str(REPO / "benchmarks"))
import solve_time  # the benchmarks' own search for the processes they started

TAG_VAR = "STEPBUS_BENCH_TEST_TAG"


def run_smoke(script: str, timeout_s: float) -> str:
    """`benchmarks/SCRIPT --smoke`'s stdout; it exits 0 and leaves no process behind."""
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG_VAR: tag}
    try:
        proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--smoke"],
                              capture_output=True, text=True, env=env, timeout=timeout_s)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        deadline = time.monotonic() + 5
        while solve_time.tagged(tag, var=TAG_VAR) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert solve_time.tagged(tag, var=TAG_VAR) == [], "the benchmark left processes behind"
        return proc.stdout
    finally:
        for pid in solve_time.tagged(tag, var=TAG_VAR):
            os.kill(pid, 9)


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_minatar_and_atari_frames_are_channels_last_as_the_built_in_cnns_take_them() -> None:
    pytest.importorskip("minatar")
    minatar = make_env("stepbus.workers.games:minatar_breakout")
    obs, _ = minatar.reset(seed=0)
    assert (obs.shape, obs.dtype) == ((10, 10, 4), np.bool_)
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    atari = make_env("stepbus.workers.games:atari_breakout")
    obs, _ = atari.reset(seed=0)
    assert (obs.shape, obs.dtype) == ((84, 84, 4), np.uint8) and obs.flags.c_contiguous
    assert atari.observation_space.contains(obs)
    assert space_spec(atari).obs_shape == [84, 84, 4]
    stack = np.arange(4 * 2 * 3, dtype=np.uint8).reshape(4, 2, 3)  # frames on axis 0, oldest first
    moved = games.channels_last(stack)
    assert moved.shape == (2, 3, 4) and all(np.array_equal(moved[..., k], stack[k])
                                            for k in range(4))


def test_atari_frames_are_those_of_a_base_env_that_draws_every_screen() -> None:
    """`UnreadScreen` spares ale-py drawing the screens AtariPreprocessing drops: the frames,
    rewards and episode ends are those of the same stack on a base env drawing every frame."""
    for module in ("ale_py", "cv2"):
        pytest.importorskip(module)
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    ours = games.atari_breakout()  # registers ale-py's envs with gymnasium
    drawn = gym.make("ALE/Breakout-v5", frameskip=1, obs_type="grayscale")
    reference = FrameStackObservation(AtariPreprocessing(
        games.SeedWithoutReload(drawn), noop_max=30, frame_skip=4, grayscale_obs=True), 4)
    rng = np.random.default_rng(0)
    episodes, seed = 0, 7
    theirs, _ = reference.reset(seed=seed)
    obs, _ = ours.reset(seed=seed)
    for _ in range(600):
        assert np.array_equal(obs, games.channels_last(theirs))
        action = int(rng.integers(4))
        theirs, r_ref, term_ref, trunc_ref, _ = reference.step(action)
        obs, r, term, trunc, _ = ours.step(action)
        assert (r, term, trunc) == (r_ref, term_ref, trunc_ref)
        if term or trunc:
            episodes, seed = episodes + 1, seed + 1
            theirs, _ = reference.reset(seed=seed)
            obs, _ = ours.reset(seed=seed)
    assert episodes >= 1, "600 random steps end a Breakout episode; the reset was not compared"


def test_minatar_smoke_learns_with_both_models_and_prints_their_ratio() -> None:
    pytest.importorskip("minatar")
    pytest.importorskip("torch")
    out = run_smoke("minatar_breakout.py", 90)
    runs = {r["model"]: r for r in json_lines(out)}
    assert runs.keys() == {"torch", "mlp"}, out
    assert all(r["env_steps"] > 0 and r["mean_return"] is not None for r in runs.values())
    assert "torch / mlp" in out


def test_atari_smoke_prints_positive_stepbus_and_async_vector_env_figures() -> None:
    for module in ("ale_py", "cv2", "torch"):
        pytest.importorskip(module)
    out = run_smoke("atari.py", 90)
    rows = {r["system"]: r for r in json_lines(out)}
    assert rows["stepbus"]["steps_per_s"] > 0 and rows["AsyncVectorEnv"]["steps_per_s"] > 0
    assert "stepbus / AsyncVectorEnv" in out
