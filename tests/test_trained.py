"""`stepbus.load_policy`: a run's checkpoint as a policy with SB3's `predict`, played in a plain
Gymnasium loop with no stepbus process, acting exactly as the model it was trained as (the
broker's `Policy` on the same weights, observations normalised with the version's statistics,
recurrent state carried by the caller); checkpoints and paths it cannot use refused in one
line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import space_envs
from conftest import SolvedRun, serial_run
from test_cnn_pixels import FindTheBlock

import stepbus
from stepbus import normalize, spaces
from stepbus.bus.exits import SettingError
from stepbus.policy import Policy, make_policy
from stepbus.trainer import checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUICK = ("--target-return", "0", "--max-updates", "2", "--checkpoint-interval-s", "0")


def play(policy: stepbus.TrainedPolicy, env: gym.Env, episodes: int) -> list[float]:
    """Deterministic episodes of `policy` on `env`, seeded 0, 1, ...: their returns."""
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=episode)
        total, done = 0.0, False
        while not done:
            action, _ = policy.predict(obs, deterministic=True)
            obs, reward, terminated, truncated, _ = env.step(action)
            total, done = total + float(reward), terminated or truncated
        returns.append(total)
    return returns


def test_a_solved_cartpole_run_plays_its_env_in_a_plain_gymnasium_loop(
        solved_cartpole: SolvedRun) -> None:
    assert solved_cartpole.returncode == 0, solved_cartpole.stderr[-3000:]
    policy = stepbus.load_policy(solved_cartpole.runs_dir / "latest")
    assert policy.model == "mlp" and policy.policy_version > 0 and not policy.recurrent
    assert policy.config["env"] == "CartPole-v1" and policy.run_dir is not None
    assert policy.observation_space.shape == (4,) and policy.action_space == gym.spaces.Discrete(2)
    returns = play(policy, gym.make("CartPole-v1"), 5)
    assert np.mean(returns) >= 475, returns
    batch, state = policy.predict(np.zeros((3, 4), np.float32), deterministic=True)
    assert batch.shape == (3,) and state is None
    same = stepbus.load_policy(policy.checkpoint)  # the checkpoint file itself
    assert same.policy_version == policy.policy_version and same.config == policy.config


def checkpoint_weights(ckpt: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The model's weights and the progress record, read apart from load_policy."""
    if ckpt.suffix == ".npz":
        params, _, progress = checkpoint.load(ckpt)
        return params, progress
    tensors, _, progress = checkpoint.load_torch(ckpt)
    return {k: v.numpy() for k, v in tensors.items()}, progress


def by_hand(progress: dict[str, Any], obs: np.ndarray) -> np.ndarray:
    """Observations normalised as the version's statistics say, written out: the newest epoch
    that starts at or before the checkpoint's version."""
    *epochs, _ = progress["obs_norm"]
    epoch = [e for e in epochs if e["first"] <= progress["version"]][-1]
    mean, var = (np.asarray(epoch[k]["obs"]) for k in ("mean", "var"))
    return np.clip((obs - mean) / np.sqrt(var + 1e-8), -epoch["clip"], epoch["clip"]).astype(
        np.float32)


def reference(ckpt: Path, name: str) -> tuple[Policy, dict[str, Any]]:
    """The model the run trained, as the broker builds it, with the checkpoint's weights."""
    params, progress = checkpoint_weights(ckpt)
    model = make_policy(name, spaces.describe(*spaces_of(name)))
    model.load(params, progress["version"])
    return model, progress


def spaces_of(name: str) -> tuple[gym.Space, gym.Space]:
    env = FindTheBlock() if name == "torch" else gym.make("CartPole-v1")
    return env.observation_space, env.action_space


def test_a_torch_cnn_loads_and_acts_as_the_model_it_trained(tmp_path: Path) -> None:
    serial_run(tmp_path, "--model", "torch", "--env", "test_cnn_pixels:FindTheBlock", *QUICK)
    policy = stepbus.load_policy(tmp_path / "latest")
    model, _ = reference(policy.checkpoint, "torch")
    assert policy.checkpoint.name == checkpoint.TORCH_FILE and policy.model == "torch"
    frames = np.random.default_rng(0).integers(0, 256, (64, 36, 36, 3), dtype=np.uint8)
    ours, _ = policy.predict(frames, deterministic=True)
    want, _, _ = model.act(frames, np.random.default_rng(0), deterministic=True)
    assert (ours == want).all()
    policy.set_random_seed(7)
    sampled, _ = policy.predict(frames)
    assert (sampled == model.act(frames, np.random.default_rng(7))[0]).all()
    one, _ = policy.predict(frames[0], deterministic=True)
    assert np.shape(one) == () and one == want[0]
    returns = play(policy, FindTheBlock(), 3)  # its pixel env, in a plain Gymnasium loop
    assert len(returns) == 3 and all(0 <= r <= 8 for r in returns), returns


def test_an_lstm_loads_with_its_statistics_and_the_caller_carries_its_state(
        tmp_path: Path) -> None:
    serial_run(tmp_path, "--model", "torch-lstm", "--norm-obs", *QUICK)
    policy = stepbus.load_policy(tmp_path / "latest")
    model, progress = reference(policy.checkpoint, "torch-lstm")
    assert policy.recurrent and policy.obs_stats is not None and len(progress["obs_norm"]) > 1
    rng = np.random.default_rng(1)
    state, memory = None, model.initial_state(8)
    for t in range(12):
        obs = rng.normal(0, 2, (8, 4)).astype(np.float32)
        starts = (rng.random(8) < 0.2) | (t == 0)
        ours, state = policy.predict(obs, state, starts, deterministic=True)
        fresh = model.initial_state(8)
        memory = {k: np.where(starts[:, None, None], fresh[k], v) for k, v in memory.items()}
        want, _, _, memory = model.act_recurrent(by_hand(progress, obs), memory,
                                                 np.random.default_rng(0), deterministic=True)
        assert state is not None and (ours == want).all()
        assert all(np.allclose(state[k], memory[k], atol=1e-6) for k in memory)
    assert play_carrying_state(policy, gym.make("CartPole-v1")) >= 1


def play_carrying_state(policy: stepbus.TrainedPolicy, env: gym.Env) -> int:
    """One greedy episode of a recurrent policy in a plain Gymnasium loop, the caller carrying
    its state from step to step (reset by episode_start on the first): the episode's length."""
    obs, _ = env.reset(seed=0)
    state, start, steps, done = None, True, 0, False
    while not done:
        action, state = policy.predict(obs, state, np.array([start]), deterministic=True)
        assert state is not None
        obs, _, terminated, truncated, _ = env.step(action)
        start, steps, done = False, steps + 1, terminated or truncated
    return steps


@pytest.mark.parametrize("env", ["masked_info", "masked_obs"])
def test_action_masks_from_info_or_a_dict_observation_are_obeyed(tmp_path: Path,
                                                                 env: str) -> None:
    serial_run(tmp_path, "--env", f"space_envs:{env}", *QUICK)
    policy = stepbus.load_policy(tmp_path / "latest")
    game = getattr(space_envs, env)()
    obs, info = game.reset(seed=0)
    for _ in range(200):  # a masked action raises space_envs.Forbidden
        masks = info.get("action_mask")
        action, _ = policy.predict(obs, action_masks=masks)
        obs, _, _, truncated, info = game.step(action)
        if truncated:
            obs, info = game.reset()
    if env == "masked_info":
        rows = np.zeros((3, 6), np.float32)
        allowed = np.eye(6, dtype=bool)[[4, 5, 1]]
        for _ in range(20):
            assert (policy.predict(rows, action_masks=allowed)[0] == [4, 5, 1]).all()


def test_a_checkpoint_without_its_spaces_is_refused_in_one_line(tmp_path: Path) -> None:
    serial_run(tmp_path, *QUICK)
    ckpt = tmp_path / "latest" / checkpoint.NPZ_FILE
    params, optimizer, progress = checkpoint.load(ckpt)
    del progress["spec"]
    old = tmp_path / "old.npz"
    checkpoint.save(old, params, optimizer, progress)
    with pytest.raises(SettingError) as refused:
        stepbus.load_policy(old)
    line = str(refused.value)
    assert "\n" not in line and str(old) in line and "spaces" in line
    progress["spec"] = {"obs_shape": "four"}
    checkpoint.save(old, params, optimizer, progress)
    with pytest.raises(SettingError, match="spaces that cannot be used"):
        stepbus.load_policy(old)


def test_paths_that_are_no_run_or_checkpoint_are_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "pickle.npz").write_bytes(b"\x80\x04K\x01.")
    (tmp_path / "notes.txt").write_text("hello")
    for path, says in ((tmp_path / "nowhere", "no such run directory"),
                       (tmp_path / "empty", "holds no checkpoint"),
                       (tmp_path / "pickle.npz", "pickle"),
                       (tmp_path / "notes.txt", "is no checkpoint")):
        with pytest.raises(SettingError) as refused:
            stepbus.load_policy(path)
        assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_normalised_run_acts_on_statistics_of_its_version(tmp_path: Path) -> None:
    serial_run(tmp_path, "--norm-obs", *QUICK)
    policy = stepbus.load_policy(tmp_path / "latest")
    model, progress = reference(policy.checkpoint, "mlp")
    obs = np.random.default_rng(2).normal(0, 3, (256, 4)).astype(np.float32)
    ours, _ = policy.predict(obs, deterministic=True)
    want, _, _ = model.act(by_hand(progress, obs), np.random.default_rng(0), deterministic=True)
    raw, _, _ = model.act(obs, np.random.default_rng(0), deterministic=True)
    assert (ours == want).all() and (ours != raw).any()
    assert isinstance(policy.obs_stats, normalize.Stats) and policy.obs_stats.mean
