"""Observation normalisation that broker and learner agree on, and reward scaling: the
statistics are the policy's (versioned with its weights, in the checkpoint), each step is
learned from with exactly those it was acted with, across a learner's swap too, and a task
that needs them learns with them and not without."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from conftest import serial_run
from test_learner_state import BATCH, Bench, trajectory

from stepbus import normalize
from stepbus.bus import protocol as p
from stepbus.models.mlp import MLPPolicy
from stepbus.workers import envs

BOX = envs.space_spec(gym.make("Pendulum-v1"))


def test_running_moments_are_those_of_all_rows_seen_in_any_chunks() -> None:
    rng = np.random.default_rng(0)
    rows = rng.normal(5.0, 3.0, size=(1000, 3))
    moments = normalize.Moments.zeros((3,))
    for chunk in np.array_split(rows, [1, 7, 300, 301]):
        moments.update(chunk)
    assert np.allclose(moments.mean, rows.mean(axis=0), atol=1e-5)
    assert np.allclose(moments.var, rows.var(axis=0), rtol=1e-4)


def test_only_floating_box_leaves_are_normalised() -> None:
    assert normalize.leaves(BOX) == {"obs": (3,)}
    assert normalize.leaves(envs.space_spec(gym.make("CartPole-v1"))) == {"obs": (4,)}
    pixels = p.SpaceSpec([84, 84, 4], "|u1", "discrete", action_n=2)
    assert normalize.leaves(pixels) == {}, "images are left as they are"


def scaled(t: p.Trajectory, k: float) -> p.Trajectory:
    """Observations in large, offset units, so the statistics move with every update."""
    assert isinstance(t.obs, np.ndarray)
    return dataclasses.replace(t, obs=np.asarray(t.obs * k + 100.0, np.float32))


def run_until_versions(bench: Bench, first_seq: int, updates: int) -> dict[int, dict]:
    """Trajectories acted by the newest version until `updates` more updates; the
    normalisation arrays of every version published meanwhile, by version."""
    published: dict[int, dict] = {}
    seq = first_seq
    for _ in range(updates * BATCH // 20):
        for w in bench.weights():
            published[w.version] = normalize.split(w.params)[0]
        version = max(published) if published else bench.learner.progress.version
        bench.deliver(scaled(trajectory(seq, version=version), 1.0 + seq))
        seq += 1
    for w in bench.weights():
        published[w.version] = normalize.split(w.params)[0]
    return published


def test_each_step_is_learned_with_the_statistics_it_was_acted_with_across_a_swap(
        tmp_path: Path) -> None:
    """Versions published by a learner carry their statistics; its successor (a swap: the
    same run directory, the checkpoint resumed) knows every one of them; a trajectory whose
    steps several of those versions acted is normalised step by step exactly as the broker
    acting with each version's weights normalised it."""
    first = Bench(tmp_path, norm_obs=True)
    published = run_until_versions(first, 0, updates=6)
    assert len(published) >= 5
    means = {v: a["obs_norm/obs/mean"].tobytes() for v, a in published.items() if a}
    assert len(set(means.values())) >= 3, "the statistics moved from version to version"
    assert not published[min(published)], "the first version acts on observations as they are"
    first.learner.metrics.close()

    second = Bench(tmp_path, norm_obs=True, newest_version=max(published), incarnation="i2")
    for version, arrays in published.items():
        theirs = second.learner.obs_norm.stats_for(version).arrays()  # type: ignore[union-attr]
        assert theirs.keys() == arrays.keys()
        assert all(theirs[k].tobytes() == arrays[k].tobytes() for k in arrays), version
    published |= run_until_versions(second, 1000, updates=2)

    versions = sorted(published)[-6:]
    mixed = scaled(trajectory(5000, steps=len(versions)), 77.0)
    mixed = dataclasses.replace(mixed, policy_versions=np.array(versions, np.int64))
    wired = p.decode(p.encode(mixed))
    assert isinstance(wired, p.Trajectory)
    learned = second.learner.learned_from(wired)
    assert isinstance(learned.obs, np.ndarray) and isinstance(mixed.obs, np.ndarray)
    broker = normalize.Normalizing(MLPPolicy(second.learner.model.spec))
    for row, version in enumerate(versions):
        weights = {**second.learner.model.weights(), **published[version]}
        assert not broker.weights_problem(weights)
        broker.load(weights, version)
        acted = np.asarray(broker.normalized(mixed.obs[row:row + 1]), np.float32)
        assert acted.tobytes() == learned.obs[row:row + 1].tobytes(), version
    assert isinstance(mixed.bootstrap_obs, np.ndarray)
    last = np.asarray(broker.normalized(mixed.bootstrap_obs[None]), np.float32)
    assert last[0].tobytes() == np.asarray(learned.bootstrap_obs).tobytes()
    second.learner.metrics.close()


def test_the_statistics_and_reward_scale_survive_a_checkpoint_round_trip(tmp_path: Path
                                                                        ) -> None:
    """What the last checkpoint holds (what came after it, a successor is sent again)."""
    first = Bench(tmp_path, norm_obs=True, norm_reward=True)
    run_until_versions(first, 0, updates=2)
    first.learner.checkpoint(first.clock.t)
    before = first.learner.obs_norm, first.learner.reward_scale
    first.learner.metrics.close()
    again = Bench(tmp_path, norm_obs=True, norm_reward=True, incarnation="i2")
    after = again.learner.obs_norm, again.learner.reward_scale
    assert before[0] is not None and after[0] is not None
    assert before[0].to_json() == after[0].to_json()
    assert before[1] is not None and after[1] is not None
    assert before[1].to_json() == after[1].to_json()
    again.learner.metrics.close()


def test_statistics_that_do_not_fit_the_spaces_are_refused() -> None:
    broker = normalize.Normalizing(MLPPolicy(BOX))
    good = normalize.Stats.identity({"obs": (3,)}, 10.0).arrays()
    assert normalize.stats_problem(BOX, good) == ""
    assert "need" in normalize.stats_problem(BOX, {**good, "obs_norm/x/mean": np.zeros(3)})
    bad = {**good, "obs_norm/obs/var": np.array([1.0, -1.0, 1.0])}
    assert "negative" in normalize.stats_problem(BOX, bad)
    nan = {**good, "obs_norm/obs/mean": np.array([np.nan, 0.0, 0.0])}
    assert "finite" in broker.weights_problem(nan)
    saved = normalize.Normalizer(BOX)
    with pytest.raises((ValueError, KeyError)):
        saved.restore([{"first": 0, "mean": {"obs": [0.0]}, "var": {"obs": [1.0]}, "clip": 10},
                       {"moments": {"obs": [1.0, [0.0], [1.0]]}}])


def test_rewards_are_scaled_by_the_discounted_returns_spread_and_clipped() -> None:
    scale = normalize.RewardScale(gamma=0.99, clip=10.0)
    t = dataclasses.replace(trajectory(1), rewards=np.full(20, 100.0, np.float32))
    for _ in range(20):
        out = scale.scale(t)
    assert abs(float(out.rewards[0])) < 100.0 and np.all(np.abs(out.rewards) <= 10.0)
    assert t.rewards[0] == 100.0, "the message's own rewards are untouched"


def test_a_task_that_needs_normalised_observations_learns_with_them_and_not_without(
        tmp_path: Path) -> None:
    """space_envs.far_target shows its target in large, offset units: with --norm-obs the
    numpy MLP reaches a mean return of -1 within 40k env steps (about 11k here); without,
    the same 40k steps leave it short (the serial runner)."""
    flags = ("--env", "space_envs:far_target", "--envs-per-worker", "16",
             "--target-return", "-1.0", "--max-env-steps", "40000")
    normalised = serial_run(tmp_path / "with", "--norm-obs", *flags)
    assert normalised[-1]["mean_return"] >= -1.0, normalised[-1]
    raw = serial_run(tmp_path / "without", *flags[:-2], "--max-env-steps",
                     str(normalised[-1]["env_steps"]))
    assert raw[-1]["mean_return"] < -1.0, raw[-1]
