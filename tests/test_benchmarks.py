"""The benchmark envs behave as documented, and the throughput benchmark still runs end to end
(its 10-second smoke version: benchmarks are not tests, this only proves they work)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from conftest import REPO

from stepbus import policy
from stepbus.bus import checks
from stepbus.trainer import consume, ppo
from stepbus.workers import bench_envs
from stepbus.workers.envs import make_env, space_spec

sys.path.insert(0, str(REPO / "benchmarks"))
import solve_time  # the benchmarks' own search for the processes they started

TAG_VAR = "STEPBUS_BENCH_TEST_TAG"


def tagged_processes(tag: str) -> list[int]:
    """Live processes whose environment carries our tag: everything the benchmark started
    inherits it, so this finds them however they were reparented."""
    return solve_time.tagged(tag, var=TAG_VAR)


def assert_none_left(tag: str) -> None:
    """Every process the benchmark started is gone (SIGKILLed ones vanish once reaped)."""
    deadline = time.monotonic() + 5
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tagged_processes(tag) == [], "the benchmark left processes behind"


def figure(out: str, system: str) -> float:
    """The steps/s column of the first table row of `system` (0 if there is none)."""
    for line in out.splitlines():
        if re.match(rf"^cartpole\s+{re.escape(system)}\s", line):
            # ... envs, steps/s, then the ratio column ("0.39x", or "-")
            match = re.search(r"\s\d+\s+(\d+)\s+(?:[\d.]+x|-)(?:\s|$)", line)
            return float(match.group(1)) if match else 0.0
    return 0.0


def test_throughput_smoke_prints_positive_stepbus_and_async_vector_env_figures() -> None:
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG_VAR: tag}
    try:
        proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "throughput.py"),
                               "--smoke", "--seconds", "0.5"],  # a positive figure is all
                              capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert figure(proc.stdout, "stepbus") > 0, proc.stdout
        assert figure(proc.stdout, "AsyncVectorEnv") > 0, proc.stdout
        assert "command: " in proc.stdout and "cores" in proc.stdout
        assert_none_left(tag)
    finally:
        for pid in tagged_processes(tag):
            os.kill(pid, 9)


def test_heavy_tailed_steps_burn_1_ms_or_10_ms_of_cpu_at_90_to_10() -> None:
    env = bench_envs.heavy_tailed()
    env.reset(seed=0)
    costs, burnt = [], []
    for _ in range(300):
        t0 = time.thread_time()
        env.step(env.action_space.sample())
        burnt.append(time.thread_time() - t0)
        costs.append(env.last_cost_s)
    costs_ms, burnt_ms = np.array(costs) * 1000, np.array(burnt) * 1000
    assert set(np.round(costs_ms, 6)) == {1.0, 10.0}
    assert 0.05 < np.mean(costs_ms == 10.0) < 0.16  # 0.1 within ~2.8 sd for 300 draws
    assert np.all(burnt_ms >= costs_ms)  # CPU time, so preemption cannot shorten a step
    assert np.median(burnt_ms[costs_ms == 1.0]) < 1.5
    assert pytest.approx(1.9) == bench_envs.HEAVY_TAILED_MEAN_MS


def test_cpu_bound_step_costs_its_step_ms_of_cpu() -> None:
    env = bench_envs.cpu_bound(2.0)
    env.reset(seed=0)
    t0 = time.thread_time()
    for _ in range(20):
        env.step(0)
    assert 0.040 <= time.thread_time() - t0 < 0.060


def test_bench_envs_replay_from_their_reset_seed() -> None:
    def episode(make, seed: int, steps: int = 30) -> list[np.ndarray]:
        env = make()
        obs, _ = env.reset(seed=seed)
        seen = [np.array(obs)]
        for _ in range(steps):
            obs, *_ = env.step(0)
            seen.append(np.array(obs))
            seen.append(np.array(getattr(env, "last_cost_s", 0.0)))
        return seen

    for make in (bench_envs.heavy_tailed, bench_envs.frames, lambda: bench_envs.cpu_bound(0.01)):
        first, again, other = episode(make, 7), episode(make, 7), episode(make, 8)
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
        assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_episodes_end_by_truncation_at_their_length() -> None:
    env = bench_envs.cpu_bound(0.0)
    env.reset(seed=0)
    flags = [env.step(0)[2:4] for _ in range(env.max_episode_steps)]
    assert flags[-1] == (False, True) and all(f == (False, False) for f in flags[:-1])


def test_frames_are_84x84x4_uint8_read_only_and_about_free_to_step() -> None:
    env = make_env("stepbus.workers.bench_envs:frames")  # as a worker's --env loads it
    obs, _ = env.reset(seed=0)
    assert obs.shape == (84, 84, 4) and obs.dtype == np.uint8
    assert env.observation_space.contains(obs)
    assert not obs.flags.writeable  # shared preallocated buffers: nobody may change them
    t0 = time.perf_counter()
    for _ in range(10_000):
        obs, *_ = env.step(0)
    assert time.perf_counter() - t0 < 0.5  # ~0.2 us a step here; generous for a busy machine
    assert obs.shape == (84, 84, 4) and obs.dtype == np.uint8
    spec = space_spec(env)
    assert (spec.obs_shape, spec.obs_dtype, spec.action_n) == ([84, 84, 4], "|u1", 4)


def test_consume_only_weights_fit_what_the_broker_serves() -> None:
    spec = space_spec(bench_envs.heavy_tailed())
    action = policy.action_space(spec)
    algo = consume.ConsumeOnly(policy.obs_dim(spec), action, ppo.PPOConfig(),
                               np.random.default_rng(0))
    assert checks.weights_problem(algo.params, spec, action) == ""
    before = {k: v.copy() for k, v in algo.params.items()}
    traj = ppo.Trajectory(obs=np.zeros((3, 4), np.float32), actions=np.zeros(3, np.int64),
                          logp=np.zeros(3, np.float32), values=np.zeros(3, np.float32),
                          rewards=np.ones(3, np.float32), terminated=False, truncated=True,
                          bootstrap_obs=np.zeros(4, np.float32))
    assert algo.update([traj, traj]) == {"consumed_steps": 6.0}
    assert all(np.array_equal(before[k], v) for k, v in algo.params.items())
    assert algo.optimizer_state() == {}
