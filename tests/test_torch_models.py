"""PyTorch models through the policy seam: the built-in agents and a user's module acting as a
`Policy`, weights judged against the module's own state_dict, torch PPO learning CartPole in
process and through real processes, safetensors checkpoints, and the one-line error when torch
is missing. CI installs the torch extra, so nothing here is skipped."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import ManualClock
from test_ppo_learns import Rollout
from torch import nn

from stepbus import policy
from stepbus.bus import broker, node
from stepbus.bus import protocol as p
from stepbus.models import mlp, torch_agents, torch_policy
from stepbus.trainer import ppo, torch_model, torch_ppo
from stepbus.trainer.algorithm import CannotStart
from stepbus.workers import envs

CARTPOLE = p.SpaceSpec([4], "<f4", "discrete", action_n=2)
PENDULUM = p.SpaceSpec([3], "<f4", "box", action_shape=[1], action_low=[-2.0],
                       action_high=[2.0])
ATARI = p.SpaceSpec([84, 84, 4], "|u1", "discrete", action_n=6)
MINATAR = p.SpaceSpec([10, 10, 4], "|b1", "discrete", action_n=3)  # MinAtar Breakout
TORCH = policy.ModelConfig(model="torch")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class TinyAgent(nn.Module):
    """A user's model, CleanRL-shaped: one hidden layer shared by actor and critic."""

    def __init__(self, observation_space: Any, action_space: Any) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(int(np.prod(observation_space.shape)), 16),
                                  nn.Tanh())
        self.actor = nn.Linear(16, int(action_space.n))
        self.critic = nn.Linear(16, 1)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.body(x))

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None,
                             action_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        hidden = self.body(x)
        probs = torch.distributions.Categorical(logits=self.actor(hidden))
        action = probs.sample() if action is None else action
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


def tiny(observation_space: Any, action_space: Any) -> nn.Module:
    return TinyAgent(observation_space, action_space)


def wrong_actions(observation_space: Any, action_space: Any) -> nn.Module:
    """A model built for 3 actions whatever the space says."""
    return TinyAgent(observation_space, gym.spaces.Discrete(3))


def loaded(spec: p.SpaceSpec, name: str = "torch") -> torch_policy.TorchPolicy:
    pol = policy.make_policy(name, spec)
    assert isinstance(pol, torch_policy.TorchPolicy)
    pol.load(torch_policy.state_arrays(pol.module), 0)
    return pol


# ---------------------------------------------------------------------------------------------
# The models as policies


@pytest.mark.parametrize(("spec", "agent", "actions"), [
    (CARTPOLE, torch_agents.MLPAgent, ((5,), np.int64)),
    (PENDULUM, torch_agents.MLPAgent, ((5, 1), np.float32)),
    (ATARI, torch_agents.NatureCNNAgent, ((5,), np.int64)),
    (MINATAR, torch_agents.NatureCNNAgent, ((5,), np.int64)),
], ids=["mlp-discrete", "mlp-box", "nature-cnn-uint8-frames", "small-cnn-bool-frames"])
def test_the_built_in_torch_model_acts_on_vectors_and_channels_last_frames(
        spec: p.SpaceSpec, agent: type, actions: tuple) -> None:
    pol = loaded(spec)
    assert isinstance(pol.module, agent)
    obs = np.random.default_rng(0).integers(0, 255, (5, *spec.obs_shape)).astype(spec.obs_dtype)
    a, logp, value = pol.act(obs, np.random.default_rng(1))
    assert (a.shape, a.dtype) == actions
    assert logp.dtype == value.dtype == np.float32 and logp.shape == value.shape == (5,)
    assert np.isfinite(logp).all() and (logp <= 0).all() | (spec.action_kind == "box")
    again = pol.act(obs, np.random.default_rng(1))
    assert all(np.array_equal(x, y) for x, y in zip((a, logp, value), again, strict=True)), \
        "sampling is seeded by the broker's generator"


def test_frames_under_36_pixels_a_side_get_the_minatar_papers_small_torso() -> None:
    small = loaded(MINATAR).module.network
    assert isinstance(small, nn.Sequential)
    assert [type(m) for m in small] == [nn.Conv2d, nn.ReLU, nn.Flatten, nn.Linear, nn.ReLU]
    assert (small[0].out_channels, small[0].kernel_size, small[3].in_features,
            small[3].out_features) == (16, (3, 3), 16 * 8 * 8, 128)
    nature = loaded(ATARI).module.network
    assert isinstance(nature, nn.Sequential)
    assert [m.out_channels for m in nature if isinstance(m, nn.Conv2d)] == [32, 64, 64]
    lstm = policy.make_policy("torch-lstm", MINATAR)
    assert isinstance(lstm, torch_policy.TorchPolicy)
    assert isinstance(lstm.module.encoder, torch_agents.Frames)
    assert lstm.module.encoder.width == torch_agents.SMALL_CNN_FEATURES


def test_a_users_module_by_import_path_acts_and_one_that_does_not_fit_is_refused() -> None:
    pol = loaded(CARTPOLE, f"{__name__}:tiny")
    assert isinstance(pol.module, TinyAgent)
    actions, _, _ = pol.act(np.zeros((3, 4), np.float32), np.random.default_rng(0))
    assert actions.shape == (3,) and actions.dtype == np.int64
    with pytest.raises(ValueError, match="does not fit"):
        policy.make_policy(f"{__name__}:wrong_actions", CARTPOLE)
    with pytest.raises(ValueError, match="too small for the built-in CNNs"):
        policy.make_policy("torch", p.SpaceSpec([2, 10, 3], "|u1", "discrete", action_n=2))


def test_weights_are_judged_by_names_shapes_dtypes_and_values_of_the_modules_own_state() -> None:
    pol = loaded(CARTPOLE)
    good = torch_policy.state_arrays(pol.module)
    assert pol.weights_problem(good) == ""
    assert policy.fingerprint(good) == pol.fingerprint
    mlp_weights = mlp.init_params(4, policy.action_space(CARTPOLE), (64, 64))
    cases = {
        "not this model's weights (another --model?)": mlp_weights,
        "head.out.weight of shape (3, 64)": {**good, "head.out.weight": np.zeros((3, 64),
                                                                                 np.float32)},
        "critic.0.bias of dtype float64": {**good, "critic.0.bias": np.zeros(64)},
        "non-finite values in actor.0.bias": {**good, "actor.0.bias": np.full(64, np.nan,
                                                                              np.float32)},
        "missing ['critic.4.bias']": {k: v for k, v in good.items() if k != "critic.4.bias"},
    }
    for problem, params in cases.items():
        assert problem in pol.weights_problem(params), problem


# ---------------------------------------------------------------------------------------------
# The broker


def test_a_torch_broker_refuses_a_foreign_models_weights_in_one_line_and_acts_with_its_own(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock(1000.0)
    out = node.Outbox()
    b = broker.Broker(broker.Config(models=TORCH), out, logging.getLogger("test.broker"),
                      rules=[], clock=clock)
    b.deliver(b"", p.RunState(run_id="r", epoch=0, options={}, shutting_down=False),
              now=clock.t)
    spec = envs.space_spec(gym.make("CartPole-v1"))
    b.deliver(b"w0", p.WorkerHello(worker="w0", incarnation="i1", env_id="CartPole-v1",
                                   num_envs=2, seed=0, spec=spec, seq=0), now=clock.t)
    [reset] = out.take_sent(p.Reset)

    def weights(params: dict[str, np.ndarray], version: int) -> p.Weights:
        return p.Weights(trainer="t", incarnation="t1", policy="default", version=version,
                         consumed_steps=0, batch_steps=256, starving=False, params=params)

    foreign = mlp.init_params(4, policy.action_space(spec), (64, 64))
    with caplog.at_level(logging.WARNING):
        b.deliver(b"t", p.decode(p.encode(weights(foreign, 1))), now=clock.t)
    [line] = [r.getMessage() for r in caplog.records if "bad weights" in r.getMessage()]
    assert "another --model" in line and "this broker serves --model torch" in line
    b.deliver(b"w0", p.StepResult(incarnation="i1", epoch=0, seq=reset.msg.seq, first=True,
                                  obs=np.zeros((2, 4), np.float32),
                                  reward=np.zeros(2, np.float32),
                                  terminated=np.zeros(2, bool), truncated=np.zeros(2, bool),
                                  final_obs=np.zeros((0, 4), np.float32)), now=clock.t)
    b.tick(clock.t)
    figures = b.figures()
    assert out.take_sent(p.Step) == [] and figures["weights_refused"] == 1
    assert str(figures["held_by"]).startswith("default: not this model's weights")

    own = torch_agents.make_agent(*torch_policy.gym_spaces(spec))
    b.deliver(b"t", p.decode(p.encode(weights(torch_policy.state_arrays(own), 2))), now=clock.t)
    b.tick(clock.t)
    [step] = out.take_sent(p.Step)
    assert step.msg.policy_version == 2 and step.msg.actions.shape == (2,)


def test_a_broker_whose_model_cannot_act_on_the_spaces_refuses_the_hello_not_crashes() -> None:
    out = node.Outbox()
    b = broker.Broker(broker.Config(models=TORCH), out, logging.getLogger("test.broker"),
                      rules=[], clock=ManualClock(1000.0))
    b.deliver(b"", p.RunState(run_id="r", epoch=0, options={}, shutting_down=False), now=1000)
    tiny_frames = p.SpaceSpec([2, 8, 3], "|u1", "discrete", action_n=2)
    b.deliver(b"w0", p.WorkerHello(worker="w0", incarnation="i1", env_id="Tiny", num_envs=1,
                                   seed=0, spec=tiny_frames, seq=0), now=1000)
    assert out.take_sent(p.Reset) == [] and b.figures()["spec_refused"] == 1


# ---------------------------------------------------------------------------------------------
# Learning


def test_torch_ppo_solves_cartpole_in_process() -> None:
    """As test_ppo_learns does for the numpy PPO: the broker's TorchPolicy acts, TorchPPO
    learns, rl-zoo's settings; the return of the last 20 episodes reaches 475."""
    horizon, cfg = 32, ppo.PPOConfig()
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    rollout = Rollout(8)
    acting = loaded(CARTPOLE)
    algo = torch_ppo.TorchPPO(acting.module, acting.action, cfg, rng)
    while rollout.env_steps < 100_000 and not rollout.solved(475):
        stats = algo.update(rollout.collect(acting.act, rng, horizon))
        assert set(stats) >= {"policy_loss", "value_loss", "entropy", "approx_kl",
                              "clip_fraction", "grad_norm", "explained_variance"}
        assert np.isfinite(stats["loss"])
        acting.load(torch_policy.state_arrays(acting.module), acting.version + 1)
    finished = rollout.finished
    assert rollout.solved(475), (rollout.env_steps, finished[-20:])


def test_the_example_model_in_the_docs_acts_and_trains(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    page = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    [example] = [block for block in page.split("```python\n")[1:] if "def make(" in block]
    (tmp_path / "docs_model.py").write_text(example.split("```")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    env_spec = p.EnvSpec(env_id="CartPole-v1", spec=CARTPOLE, policy_version=0)
    model = torch_model.TorchModel(policy.ModelConfig(model="docs_model:make"),
                                 "stepbus.trainer.ppo:PPO", env_spec, ppo.PPOConfig(), seed=0)
    stats = model.update([ppo.Trajectory(
        obs=np.zeros((32, 4), np.float32), actions=np.zeros(32, np.int64),
        logp=np.full(32, -0.69, np.float32), values=np.zeros(32, np.float32),
        rewards=np.ones(32, np.float32), terminated=True, truncated=False,
        bootstrap_obs=np.zeros(4, np.float32))], tick=lambda: None)
    assert np.isfinite(stats["loss"]) and stats["n_samples"] == 32
    acting = policy.make_policy("docs_model:make", CARTPOLE)
    assert acting.weights_problem(model.weights()) == ""
    acting.load(model.weights(), 1)
    actions, _, _ = acting.act(np.zeros((3, 4), np.float32), np.random.default_rng(0))
    assert actions.shape == (3,)


def test_torch_ppo_is_reproducible_from_the_seed_bit_for_bit() -> None:
    """What --deterministic needs of the learner: the same seed and the same trajectories make
    the same weights and figures (the broker's side: sampling seeded per batch, above)."""
    env_spec = p.EnvSpec(env_id="CartPole-v1", spec=CARTPOLE, policy_version=0)
    rng = np.random.default_rng(5)
    batch = [ppo.Trajectory(obs=rng.normal(size=(40, 4)).astype(np.float32),
                            actions=rng.integers(0, 2, 40), logp=np.full(40, -0.69, np.float32),
                            values=np.zeros(40, np.float32), rewards=rng.normal(size=40),
                            terminated=bool(i % 2), truncated=False,
                            bootstrap_obs=np.ones(4, np.float32)) for i in range(8)]
    runs = []
    for seed in (3, 3, 4):
        model = torch_model.TorchModel(TORCH, "stepbus.trainer.ppo:PPO", env_spec,
                                     ppo.PPOConfig(minibatch_size=64, n_epochs=2), seed=seed)
        stats = [model.update(batch, tick=lambda: None) for _ in range(3)]
        runs.append((stats, model.weights()))
    (stats_a, weights_a), (stats_b, weights_b), (_, weights_c) = runs
    assert stats_a == stats_b and stats_a[0]["n_grad_steps"] == 2 * 5
    assert all(weights_a[k].tobytes() == weights_b[k].tobytes() for k in weights_a)
    assert weights_a["head.out.weight"].tobytes() != weights_c["head.out.weight"].tobytes()


def test_a_torch_checkpoint_is_safetensors_and_resumes_weights_and_adam_exactly(
        tmp_path: Path) -> None:
    env_spec = p.EnvSpec(env_id="CartPole-v1", spec=CARTPOLE, policy_version=0)
    model = torch_model.TorchModel(TORCH, "stepbus.trainer.ppo:PPO", env_spec, ppo.PPOConfig(),
                                 seed=1)
    rng = np.random.default_rng(0)
    batch = [ppo.Trajectory(obs=rng.normal(size=(64, 4)).astype(np.float32),
                            actions=rng.integers(0, 2, 64), logp=np.full(64, -0.69, np.float32),
                            values=np.zeros(64, np.float32), rewards=np.ones(64, np.float32),
                            terminated=True, truncated=False,
                            bootstrap_obs=np.zeros(4, np.float32))]
    model.update(batch, tick=lambda: None)
    path = tmp_path / "checkpoint.safetensors"
    model.save(path, {"version": 7})
    assert path.read_bytes()[8:9] == b"{", "a safetensors file: a length, then a JSON header"

    again = torch_model.TorchModel(TORCH, "stepbus.trainer.ppo:PPO", env_spec, ppo.PPOConfig(),
                                 seed=2)
    assert again.resume(path) == {"version": 7}
    for key, value in model.weights().items():
        assert np.array_equal(again.weights()[key], value), key
    assert isinstance(model.torch_algo, torch_ppo.TorchPPO)
    assert isinstance(again.torch_algo, torch_ppo.TorchPPO)
    ours, theirs = model.torch_algo.optimizer_state(), again.torch_algo.optimizer_state()
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)

    other = dataclasses.replace(env_spec, spec=p.SpaceSpec([5], "<f4", "discrete", action_n=2))
    with pytest.raises(CannotStart, match="does not fit this model"):
        torch_model.TorchModel(TORCH, "stepbus.trainer.ppo:PPO", other, ppo.PPOConfig(),
                             seed=0).resume(path)


# ---------------------------------------------------------------------------------------------
# Without torch

BLOCK_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "safetensors"):
            raise ImportError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoTorch())
"""


@pytest.mark.parametrize("role", ["broker", "learner"])
def test_a_torch_model_without_torch_fails_at_start_with_one_line_saying_how_to_install(
        role: str, tmp_path: Path) -> None:
    code = BLOCK_TORCH + textwrap.dedent(f"""
        sys.argv = ["stepbus", {role!r}, "--model", "torch", "--controller",
                    "ipc://{tmp_path}/c", "--policy", "ipc://{tmp_path}/p"]
        from stepbus.entry import main
        sys.exit(main())
    """)
    res = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 2, res.stdout
    # one line, in the log (ERROR) or as the command's own (`stepbus ROLE: ...`)
    errors = [line for line in res.stdout.splitlines()
              if "ERROR" in line or line.startswith(f"stepbus {role}: ")]
    assert len(errors) == 1 and errors[0].endswith('pip install -e ".[torch]"'), res.stdout
    assert "Traceback" not in res.stdout


def test_the_core_package_never_imports_torch() -> None:
    code = """
import json, sys
import stepbus.cli, stepbus.policy, stepbus.models.mlp, stepbus.trainer.learner
from stepbus import policy
assert not policy.check_model(policy.ModelConfig(model="mlp"))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "safetensors"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert json.loads(out.stdout) == []
