"""`stepbus export RUN --format onnx`: the file, run by onnxruntime alone, acts as `predict(...,
deterministic=True)` does, for every kind of model and space; bad input is one line, exit 2.

Models are freshly initialised as a learner makes them (its `Model`/`TorchModel`, and its own
checkpoint save), so each case takes well under a second to build and export.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributions import Categorical, Normal  # noqa: E402

from stepbus import cli, export, spaces  # noqa: E402
from stepbus.bus import protocol as p  # noqa: E402
from stepbus.normalize import Normalizer  # noqa: E402
from stepbus.policy import ModelConfig  # noqa: E402
from stepbus.trained import TrainedPolicy, load_policy  # noqa: E402
from stepbus.trainer import algorithm, ppo  # noqa: E402
from stepbus.trainer.model import Model  # noqa: E402
from stepbus.trainer.torch_model import TorchModel  # noqa: E402

ROWS = 256
DOC = Path(__file__).resolve().parents[1] / "docs" / "export.md"


@dataclass
class Case:
    """An env's spaces and a model for them."""

    obs: gym.Space
    action: gym.Space
    model: str = "mlp"
    info_mask: bool = False
    normalised: bool = False
    activation: str = "tanh"

    @property
    def spec(self) -> p.SpaceSpec:
        return spaces.describe(self.obs, self.action, info_mask=self.info_mask)


def learner_model(case: Case, seed: int = 3) -> Model:
    """The model a learner starts a run with: its initial weights."""
    env = p.EnvSpec(env_id="Made-v0", spec=case.spec, policy_version=0)
    if case.model == "mlp":
        return Model(algorithm.load("stepbus.trainer.ppo:PPO"), env,
                     ppo.PPOConfig(activation=case.activation), seed)
    return TorchModel(ModelConfig(model=case.model), "stepbus.trainer.torch_ppo:TorchPPO", env,
                      ppo.PPOConfig(), seed)


def statistics(spec: p.SpaceSpec, rng: np.random.Generator) -> Normalizer:
    """Observation statistics as a learner folds them at a checkpoint, for version 1 on: of
    rows far from zero mean and unit variance, so that normalising changes what the policy
    sees."""
    norm = Normalizer(spec)
    for key, shape in norm.shapes.items():
        norm.pending[key].update(rng.normal(3.0, 4.0, (64, *shape)))
    norm.fold(1, 0)
    return norm


def made_run(case: Case, run_dir: Path, rng: np.random.Generator) -> Path:
    """A run directory holding the checkpoint a learner writes of its initial model, with
    the spaces, the model's name and (normalised) the observation statistics of its version."""
    model = learner_model(case)
    progress: dict[str, Any] = {"version": 1, "spec": p.to_map(case.spec), "model": case.model}
    if case.normalised:
        progress["obs_norm"] = statistics(case.spec, rng).to_json()
    run_dir.mkdir(parents=True, exist_ok=True)
    model.save(run_dir / ("checkpoint.npz" if case.model == "mlp" else "checkpoint.safetensors"),
               progress)
    return run_dir


def exported(case: Case, tmp_path: Path, rng: np.random.Generator
             ) -> tuple[TrainedPolicy, Path]:
    """The case's run exported by `stepbus export`, and the run loaded by `load_policy`."""
    run_dir = made_run(case, tmp_path / "run", rng)
    path = tmp_path / "policy.onnx"
    assert cli.main(["export", str(run_dir), "--format", "onnx", "-o", str(path)]) == 0
    return load_policy(run_dir), path


def observations(case: Case, rng: np.random.Generator, n: int = ROWS) -> p.Obs:
    """`n` observations of the case's space as stepbus lays them out, with masks (some rows
    allowing nothing in a dimension) when the env gives them."""
    case.obs.seed(int(rng.integers(1 << 30)))
    rows = spaces.RowWriter(case.spec)
    batch = spaces.zeros(case.spec, n)
    for i in range(n):
        rows(batch, i, case.obs.sample(), None)
    if isinstance(batch, dict) and spaces.MASK in batch:
        batch[spaces.MASK][:] = rng.random(batch[spaces.MASK].shape) < 0.4
    if case.normalised:  # spread about the statistics' mean, some beyond the clip
        assert isinstance(batch, np.ndarray)
        batch = rng.normal(3.0, 4.0 * rng.choice([0.5, 2.0, 20.0], (n, 1)),
                           np.shape(batch)).astype(np.float32)
    return batch


def feeds(obs: p.Obs) -> dict[str, np.ndarray]:
    """The file's inputs: each leaf by its key, a Box observation as `obs`."""
    return dict(obs) if isinstance(obs, dict) else {"obs": obs}


def run_onnx(path: Path, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The file in onnxruntime, nothing of stepbus's."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return list(session.run(None, inputs))


def same_actions(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    else:
        np.testing.assert_array_equal(got, want)


def greedy(trained: TrainedPolicy, obs: p.Obs) -> np.ndarray:
    """`predict`'s deterministic actions for a batch laid out as stepbus lays it out: nested
    as the env's space, an env's masks from `info` as `action_masks`."""
    info_mask = any(leaf.kind == "mask" for leaf in trained.spec.obs_leaves)
    masks = obs[spaces.MASK] if isinstance(obs, dict) and info_mask else None
    nested = spaces.structured(trained.spec, obs)
    return np.asarray(trained.predict(nested, deterministic=True, action_masks=masks)[0])


class CleanRLAgent(nn.Module):
    """CleanRL ``ppo.py``'s agent as a user writes it: a torch Categorical, no deterministic=."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space) -> None:
        super().__init__()
        width = gym.spaces.flatdim(observation_space)
        self.critic = nn.Sequential(nn.Linear(width, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor = nn.Sequential(nn.Linear(width, 16), nn.Tanh(),
                                   nn.Linear(16, int(action_space.n)))  # type: ignore[attr-defined]

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


class CleanRLContinuousAgent(CleanRLAgent):
    """CleanRL ``ppo_continuous_action.py``'s shape without deterministic=: no mean to give."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space) -> None:
        nn.Module.__init__(self)
        width, dim = gym.spaces.flatdim(observation_space), gym.spaces.flatdim(action_space)
        self.critic = nn.Sequential(nn.Linear(width, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor = nn.Sequential(nn.Linear(width, 16), nn.Tanh(), nn.Linear(16, dim))
        self.logstd = nn.Parameter(torch.zeros(1, dim))

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        mean = self.actor(x)
        probs = Normal(mean, self.logstd.expand_as(mean).exp())
        if action is None:
            action = probs.sample()
        return (action, probs.log_prob(action).sum(1), probs.entropy().sum(1),
                self.critic(x))


IMAGE = gym.spaces.Box(0, 255, (44, 44, 3), np.uint8)
BOX4 = gym.spaces.Box(-2.0, 2.0, (4,), np.float32)
DICT = gym.spaces.Dict({"pos": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
                        "room": gym.spaces.Discrete(5, start=1),
                        "keys": gym.spaces.MultiDiscrete([2, 3]),
                        "seen": gym.spaces.MultiBinary(4)})
TUPLE = gym.spaces.Tuple((BOX4, gym.spaces.Dict({"n": gym.spaces.Discrete(3)})))
CASES = {
    "numpy MLP": Case(BOX4, gym.spaces.Discrete(3)),
    "numpy MLP, normalised": Case(gym.spaces.Box(-np.inf, np.inf, (5,), np.float32),
                                  gym.spaces.Discrete(4), normalised=True),
    "numpy MLP, Dict": Case(DICT, gym.spaces.MultiDiscrete([3, 2])),
    "numpy MLP, masked": Case(BOX4, gym.spaces.Discrete(5), info_mask=True),
    "numpy MLP, Box": Case(BOX4, gym.spaces.Box(-0.003, 0.003, (2,), np.float32)),
    "numpy MLP, image": Case(IMAGE, gym.spaces.Discrete(6)),
    "numpy MLP, ReLU": Case(BOX4, gym.spaces.Box(-0.003, 0.003, (2,), np.float32),
                            activation="relu"),
    "torch MLP": Case(BOX4, gym.spaces.Discrete(3), "torch"),
    "torch MLP, normalised": Case(gym.spaces.Box(-np.inf, np.inf, (5,), np.float32),
                                  gym.spaces.MultiBinary(3), "torch", normalised=True),
    "torch CNN": Case(IMAGE, gym.spaces.Discrete(6), "torch"),
    "torch MLP, Dict": Case(DICT, gym.spaces.Discrete(3), "torch"),
    "torch MLP, Tuple": Case(TUPLE, gym.spaces.Discrete(3), "torch"),
    "torch MLP, masked": Case(BOX4, gym.spaces.MultiDiscrete([4, 3]), "torch", info_mask=True),
    "CleanRL module": Case(BOX4, gym.spaces.Discrete(3), "test_export:CleanRLAgent"),
    "torch MLP, Box": Case(BOX4, gym.spaces.Box(-0.003, 0.003, (2,), np.float32), "torch"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_onnx_file_acts_as_predict_does_greedily(name: str, tmp_path: Path) -> None:
    case, rng = CASES[name], np.random.default_rng(7)
    trained, path = exported(case, tmp_path, rng)
    obs = observations(case, rng)
    want = greedy(trained, obs)
    same_actions(run_onnx(path, feeds(obs))[0], want)
    if isinstance(case.action, gym.spaces.Box):
        assert (np.abs(want) == np.float32(0.003)).any() and (np.abs(want) < 0.003).any()
    assert len(np.unique(want.reshape(ROWS, -1), axis=0)) > 1  # not one action for all
    if case.normalised:  # the statistics are in the file: without them, other actions
        assert trained.obs_stats is not None
        raw = trained.policy.inner.act(obs, rng, deterministic=True)[0]
        assert (raw != want).any()


def test_a_recurrent_model_takes_and_gives_its_state_and_restarts_it_at_episode_starts(
        tmp_path: Path) -> None:
    case, rng = Case(BOX4, gym.spaces.Discrete(4), "torch-lstm"), np.random.default_rng(5)
    trained, path = exported(case, tmp_path, rng)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["obs", "episode_start", "state_0",
                                                      "state_1"]
    n = 64
    state = {f"state_{k}": np.zeros_like(v) for k, v in trained.initial_state(n).items()}
    theirs = None
    start = np.ones(n, bool)
    for _ in range(6):
        obs = observations(case, rng, n)
        action, *after = session.run(None, {"obs": obs, "episode_start": start, **state})
        want, theirs = trained.predict(obs, theirs, start, deterministic=True)
        same_actions(action, want)
        assert theirs is not None
        for i, part in enumerate(after):
            np.testing.assert_allclose(part, theirs[str(i)], rtol=0, atol=1e-5)
        state = {f"state_{i}": part for i, part in enumerate(after)}
        start = rng.random(n) < 0.3  # these rows begin an episode: their state is initial


def doc_example() -> str:
    """The first python block of docs/export.md: what a user runs with onnxruntime alone."""
    found = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert found, "docs/export.md has no python example"
    return found.group(1)


def played(act: Callable[[np.ndarray], int]) -> float:
    """The return of one CartPole-v1 episode from seed 0, as the documented example plays it."""
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    total, done = 0.0, False
    while not done:
        obs, reward, terminated, truncated, _ = env.step(act(obs))
        total, done = total + float(reward), terminated or truncated
    return total


def test_the_documented_example_plays_the_file_without_stepbus(tmp_path: Path) -> None:
    env = gym.make("CartPole-v1")
    case = Case(env.observation_space, env.action_space)
    trained, _ = exported(case, tmp_path, np.random.default_rng(1))
    script = tmp_path / "example.py"
    script.write_text(doc_example() + "\nimport sys\nassert 'stepbus' not in sys.modules\n"
                      "print(total)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) == played(
        lambda obs: int(trained.predict(obs, deterministic=True)[0]))


def one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_an_unknown_format_or_a_path_that_is_no_run_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_exit_2(capsys, ["export", str(tmp_path), "--format", "tflite"])
    assert "tflite" in err and "onnx" in err
    err = one_line_exit_2(capsys, ["export", str(tmp_path / "nowhere")])
    assert str(tmp_path / "nowhere") in err


def test_a_module_that_cannot_give_its_mode_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = Case(BOX4, gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
                "test_export:CleanRLContinuousAgent")
    run_dir = made_run(case, tmp_path / "run", np.random.default_rng(0))
    err = one_line_exit_2(capsys, ["export", str(run_dir)])
    assert "deterministic" in err and not (run_dir / "policy.onnx").exists()


def test_missing_libraries_are_named_with_the_pip_command(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from stepbus import cli\n"
            f"sys.exit(cli.main(['export', {str(tmp_path)!r}]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"stepbus export: ONNX export needs torch, not installed: {export.INSTALL}"]


