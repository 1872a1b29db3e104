"""Greedy acting (`Policy.act(..., deterministic=True)`), what evaluation plays with: the mode
of each model's action distribution (argmax of the masked logits, a Box's mean clipped to the
space), with no draw from the generator, for the numpy MLP, the built-in torch agents and a
CleanRL-shaped user module that knows nothing of it."""

from __future__ import annotations

from typing import Any, cast

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from stepbus import spaces
from stepbus.bus import protocol as p
from stepbus.models import mlp, torch_agents, torch_policy
from stepbus.policy import ModelUnavailable, Policy, make_policy

OBS = gym.spaces.Box(-1.0, 1.0, (4,))
MASKED = gym.spaces.Dict({"obs": OBS, "action_mask": gym.spaces.MultiBinary(5)})
ACTIONS = [gym.spaces.Discrete(5), gym.spaces.MultiDiscrete([3, 4]),
           gym.spaces.Box(-0.5, 0.5, (2,))]


def sharpened(model: Policy, seed: int) -> dict[str, np.ndarray]:
    """Weights whose policy head is far from uniform, so the mode differs from most samples."""
    if isinstance(model, torch_policy.TorchPolicy):
        params = torch_policy.state_arrays(model.module)
        params["head.out.weight"] = params["head.out.weight"] * 300
        return params
    params = mlp.init_params(spaces.flat_dim(model.spec), model.action,
                             rng=np.random.default_rng(seed))
    params["pi.2.w"] *= 300
    return params


def observations(spec: p.SpaceSpec, n: int, seed: int) -> p.Obs:
    rng = np.random.default_rng(seed)
    obs = rng.uniform(-1, 1, (n, 4)).astype(np.float32)
    if not spec.obs_leaves:
        return obs
    return {"obs": obs, "action_mask": (rng.random((n, 5)) < 0.5).astype(np.int8)}


def head_output(model: Policy, obs: p.Obs) -> np.ndarray:
    """Logits (or Gaussian means) computed apart from acting."""
    if isinstance(model, torch_policy.TorchPolicy):
        module: Any = model.module
        with torch.no_grad():
            x = torch_policy.module_input(model.spec, obs, torch.device("cpu"))
            out: np.ndarray = module.head.out(module.actor(module.flatten(x))).numpy()
            return out
    assert isinstance(model, mlp.MLPPolicy)
    return mlp.forward(model.params, spaces.flatten(model.spec, obs))[0]


@pytest.mark.parametrize("name", ["mlp", "torch"])
@pytest.mark.parametrize("action", ACTIONS, ids=str)
def test_greedy_actions_are_the_mode_and_draw_nothing(name: str, action: gym.Space) -> None:
    spec = spaces.describe(OBS, action)
    model = make_policy(name, spec)
    model.load(sharpened(model, 1), 0)
    obs = observations(spec, 64, 2)
    greedy, logp, value = model.act(obs, np.random.default_rng(3), deterministic=True)
    again, _, _ = model.act(obs, np.random.default_rng(4), deterministic=True)
    sampled, _, sampled_value = model.act(obs, np.random.default_rng(3))
    out = head_output(model, obs)
    if isinstance(action, gym.spaces.Box):
        want = np.clip(out, -0.5, 0.5)
        assert np.allclose(greedy, want, atol=1e-5) and (np.abs(greedy) <= 0.5).all()
        assert (np.abs(out) > 0.5).any(), "some means must lie outside the bounds"
    else:
        parts = np.split(out, np.cumsum(spec.action_nvec or [spec.action_n])[:-1], axis=1)
        want = np.stack([part.argmax(1) for part in parts], 1).reshape(greedy.shape)
        assert (greedy == want).all()
    assert (greedy == again).all() and np.isfinite(logp).all()
    assert np.allclose(value, sampled_value) and (greedy != sampled).any()


@pytest.mark.parametrize("name", ["mlp", "torch"])
def test_greedy_actions_obey_the_action_mask(name: str) -> None:
    spec = spaces.describe(MASKED, gym.spaces.Discrete(5))
    model = make_policy(name, spec)
    model.load(sharpened(model, 5), 0)
    obs = observations(spec, 200, 6)
    assert isinstance(obs, dict)
    obs["action_mask"][:, 0] = 1  # at least one action allowed per row
    greedy, _, _ = model.act(obs, np.random.default_rng(0), deterministic=True)
    assert obs["action_mask"][np.arange(200), greedy].all()


class PlainAgent(nn.Module):
    """A CleanRL-shaped module that knows nothing of greedy acting (no `deterministic`)."""

    def __init__(self, observation_space: Any, action_space: Any) -> None:
        super().__init__()
        self.inner = torch_agents.MLPAgent(observation_space, action_space)

    def get_value(self, x: Any) -> Any:
        return self.inner.get_value(x)

    def get_action_and_value(self, x: Any, action: Any = None, action_mask: Any = None
                             ) -> tuple[Any, Any, Any, Any]:
        return self.inner.get_action_and_value(x, action, action_mask)


@pytest.mark.parametrize("obs_space,action", [(OBS, gym.spaces.MultiDiscrete([3, 4])),
                                              (MASKED, gym.spaces.Discrete(5))], ids=str)
def test_a_user_module_without_deterministic_acts_greedily_by_its_own_log_probs(
        obs_space: gym.Space, action: gym.Space) -> None:
    spec = spaces.describe(obs_space, action)
    plain = torch_policy.TorchPolicy.of_factory(PlainAgent, spec, name="plain")
    builtin = torch_policy.TorchPolicy(spec, cast(PlainAgent, plain.module).inner)
    assert not plain.takes_deterministic and builtin.takes_deterministic
    weights = sharpened(builtin, 0)
    builtin.load(weights, 0)
    plain.load({f"inner.{k}": v for k, v in weights.items()}, 0)
    obs = observations(spec, 64, 7)
    ours = plain.act(obs, np.random.default_rng(0), deterministic=True)
    want = builtin.act(obs, np.random.default_rng(1), deterministic=True)
    assert (ours[0] == want[0]).all()
    assert np.allclose(ours[1], want[1], atol=1e-5) and np.allclose(ours[2], want[2])


def test_a_user_module_that_cannot_give_a_box_mean_says_so() -> None:
    spec = spaces.describe(OBS, gym.spaces.Box(-1.0, 1.0, (2,)))
    plain = torch_policy.TorchPolicy.of_factory(PlainAgent, spec, name="plain")
    plain.load(torch_policy.state_arrays(plain.module), 0)
    assert "deterministic" in plain.greedy_problem
    with pytest.raises(ModelUnavailable, match="deterministic"):
        plain.act(observations(spec, 2, 0), np.random.default_rng(0), deterministic=True)
    plain.act(observations(spec, 2, 0), np.random.default_rng(0))  # sampling still works


def test_a_recurrent_model_acts_greedily_and_carries_the_same_state() -> None:
    spec = spaces.describe(OBS, gym.spaces.Discrete(5))
    model = make_policy("torch-lstm", spec)
    model.load(sharpened(model, 0), 0)
    obs = observations(spec, 16, 8)
    state = model.initial_state(16)
    state = model.act_recurrent(obs, state, np.random.default_rng(0))[3]
    greedy, _, value, after = model.act_recurrent(obs, state, np.random.default_rng(1), True)
    again, _, _, _ = model.act_recurrent(obs, state, np.random.default_rng(2), True)
    _, _, sampled_value, sampled_after = model.act_recurrent(obs, state,
                                                             np.random.default_rng(1))
    assert (greedy == again).all() and np.allclose(value, sampled_value)
    assert all(np.allclose(after[k], sampled_after[k]) for k in after)
