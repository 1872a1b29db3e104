"""The policy seam: `make_policy` by name, the numpy MLP as a `Policy` (weights checked before
use, versioned loads, acting), fingerprints, the spaces as a `SpaceSpec`, and the checks that
judge weights and spaces through the policy without knowing the MLP."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Mapping

import numpy as np
import pytest

from stepbus import policy
from stepbus.bus import checks
from stepbus.bus import protocol as p
from stepbus.models import mlp
from stepbus.policy import ActionSpace, NoWeights, Policy, make_policy

CARTPOLE = p.SpaceSpec([4], "<f4", "discrete", action_n=2)
PENDULUM = p.SpaceSpec([3], "<f4", "box", action_shape=[1], action_low=[-2.0],
                       action_high=[2.0])


def mlp_params(spec: p.SpaceSpec, hidden: tuple[int, ...] = (8,), seed: int = 0
               ) -> dict[str, np.ndarray]:
    return mlp.init_params(policy.obs_dim(spec), policy.action_space(spec), hidden,
                           np.random.default_rng(seed))


class ConstantPolicy(Policy):
    """A user's policy by import path: always the first action, value 0."""

    def prepare(self, params: Mapping[str, np.ndarray]) -> None:
        self.params = dict(params)

    def act(self, obs: p.Obs, rng: np.random.Generator, deterministic: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b = len(obs)
        return np.zeros(b, np.int64), np.zeros(b, np.float32), np.zeros(b, np.float32)

    def weights_problem(self, params: Mapping[str, np.ndarray]) -> str:
        return "" if not params else "takes no weights"


def not_a_policy(observation_space: object, action_space: object) -> object:
    return object()


# ---------------------------------------------------------------------------------------------
# Building a policy by name


def test_mlp_is_the_default_and_a_module_factory_path_builds_a_users_policy() -> None:
    assert policy.DEFAULT == "mlp"
    assert isinstance(make_policy(policy.DEFAULT, CARTPOLE), mlp.MLPPolicy)
    user = make_policy(f"{__name__}:ConstantPolicy", CARTPOLE)
    assert isinstance(user, ConstantPolicy) and user.action == ActionSpace("discrete", n=2)
    assert user.weights_problem({}) == "" and user.weights_problem({"w": np.ones(1)}) != ""
    user.load({}, 3)
    actions, logp, value = user.act(np.zeros((5, 4), np.float32), np.random.default_rng(0))
    assert actions.shape == logp.shape == value.shape == (5,) and user.version == 3


@pytest.mark.parametrize(("name", "error"), [
    ("cnn", "unknown model 'cnn'"),
    (f"{__name__}:not_a_policy", "made a object, not a Policy"),
    (f"{__name__}:no_such_factory", "no_such_factory"),
])
def test_a_model_name_that_gives_no_policy_is_refused_naming_it(name: str, error: str) -> None:
    with pytest.raises((ValueError, AttributeError), match=error):
        make_policy(name, CARTPOLE)


# ---------------------------------------------------------------------------------------------
# The MLP as a Policy


def test_a_policy_acts_only_once_it_has_loaded_weights_and_keeps_their_version() -> None:
    pol = make_policy("mlp", CARTPOLE)
    assert not pol.loaded and pol.version == -1 and pol.fingerprint == ""
    with pytest.raises(NoWeights):
        pol.act(np.zeros((1, 4), np.float32), np.random.default_rng(0))
    params = mlp_params(CARTPOLE)
    pol.load(params, 0)
    assert pol.loaded and pol.version == 0 and pol.fingerprint == policy.fingerprint(params)
    obs = np.random.default_rng(1).normal(size=(32, 4)).astype(np.float32)
    actions, logp, value = pol.act(obs, np.random.default_rng(2))
    assert actions.dtype == np.int64 and actions.shape == (32,)
    assert logp.dtype == value.dtype == np.float32 and np.all(logp <= 0)
    pol.load(mlp_params(CARTPOLE, seed=1), 5)
    assert pol.version == 5


def test_a_box_policy_acts_with_float_actions_of_the_declared_shape() -> None:
    pol = make_policy("mlp", PENDULUM)
    params = mlp_params(PENDULUM, (16, 16))
    assert pol.weights_problem(params) == ""
    pol.load(params, 1)
    actions, logp, value = pol.act(np.zeros((6, 3), np.float32), np.random.default_rng(0))
    assert actions.dtype == np.float32 and actions.shape == (6, 1)
    assert np.isfinite(logp).all() and np.isfinite(value).all()


GOOD = mlp_params(CARTPOLE)
WEIGHTS_REFUSALS = [
    ("weights for other observations", mlp_params(p.SpaceSpec([5], "<f4", "discrete",
                                                              action_n=2)),
     "pi.0.w of shape (5, 8), the spaces need (4, 8)"),
    ("weights for other actions", mlp_params(p.SpaceSpec([4], "<f4", "discrete", action_n=3)),
     "pi.1.w of shape (8, 3), the spaces need (8, 2)"),
    ("weights for box actions", mlp_params(p.SpaceSpec([4], "<f4", "box", action_shape=[2],
                                                       action_low=[0.0, 0.0],
                                                       action_high=[1.0, 1.0])),
     "unexpected ['log_std']"),
    ("no value head", {k: v for k, v in GOOD.items() if not k.startswith("vf.")},
     "no pi.0.w or vf.0.w"),
    ("a missing bias", {k: v for k, v in GOOD.items() if k != "vf.1.b"}, "missing ['vf.1.b']"),
    ("an extra array", {**GOOD, "pi.9.b": np.zeros(2)}, "unexpected ['pi.9.b']"),
    ("names of another model", {"conv.0.w": np.ones((3, 3))}, "no pi.0.w or vf.0.w"),
    ("integer weights", {**GOOD, "pi.0.b": np.zeros(8, np.int64)}, "float arrays"),
    ("a NaN", {**GOOD, "vf.0.w": np.full((4, 8), np.nan)}, "non-finite parameters"),
    ("an infinite bias", {**GOOD, "pi.1.b": np.array([np.inf, 0.0])}, "non-finite"),
    ("a 1-d weight", {**GOOD, "pi.0.w": np.ones(4)}, "IndexError"),
    ("logits that overflow", {**GOOD, "pi.0.b": np.ones(8), "pi.1.w": np.full((8, 2), 1e308)},
     "non-finite log-prob or value"),
    ("no weights at all", {}, "no pi.0.w or vf.0.w"),
]


@pytest.mark.parametrize(("params", "problem"), [case[1:] for case in WEIGHTS_REFUSALS],
                         ids=[case[0] for case in WEIGHTS_REFUSALS])
def test_the_mlp_refuses_weights_that_cannot_drive_it_and_says_why(
        params: dict[str, np.ndarray], problem: str) -> None:
    found = make_policy("mlp", CARTPOLE).weights_problem(params)
    assert problem in found, found


def test_the_mlp_takes_weights_of_any_hidden_widths_for_its_spaces() -> None:
    pol = make_policy("mlp", CARTPOLE)
    for hidden in ((), (1,), (64, 64), (3, 5, 7)):
        assert pol.weights_problem(mlp_params(CARTPOLE, hidden)) == "", hidden


# ---------------------------------------------------------------------------------------------
# Fingerprints


def test_a_fingerprint_tells_architectures_apart_not_values_or_precision() -> None:
    a, b = mlp_params(CARTPOLE, (8,), seed=1), mlp_params(CARTPOLE, (8,), seed=2)
    assert policy.fingerprint(a) == policy.fingerprint(b)
    assert policy.fingerprint(a) == policy.fingerprint({k: v.astype(np.float32)
                                                        for k, v in a.items()})
    assert policy.fingerprint(a) == policy.fingerprint(dict(reversed(list(a.items()))))
    assert policy.fingerprint(a) != policy.fingerprint(mlp_params(CARTPOLE, (9,)))
    renamed = {k.replace("pi.", "actor."): v for k, v in a.items()}
    assert policy.fingerprint(a) != policy.fingerprint(renamed)


# ---------------------------------------------------------------------------------------------
# Spaces and the checks


def test_the_spaces_give_the_action_head_and_observation_size() -> None:
    assert policy.action_space(CARTPOLE) == ActionSpace("discrete", n=2)
    assert policy.action_space(PENDULUM) == ActionSpace("box", shape=(1,), low=(-2.0,),
                                                        high=(2.0,))
    assert policy.obs_shape(p.SpaceSpec([84, 84, 4], "|u1", "discrete", action_n=6)) == (
        84, 84, 4)
    assert policy.obs_dim(p.SpaceSpec([84, 84, 4], "|u1", "discrete", action_n=6)) == 28_224


def test_the_checks_judge_weights_through_the_policy() -> None:
    action = policy.action_space(CARTPOLE)
    assert checks.weights_problem(GOOD, CARTPOLE, action) == ""
    bad = mlp_params(p.SpaceSpec([5], "<f4", "discrete", action_n=2))
    assert checks.weights_problem(bad, CARTPOLE, action) == make_policy(
        "mlp", CARTPOLE).weights_problem(bad) != ""
    assert checks.weights_problem(bad, None, None) == "", "judged once spaces are known"
    assert checks.weights_problem({}, CARTPOLE, action, f"{__name__}:ConstantPolicy") == ""


SPEC_REFUSALS = [
    ("an object dtype", {"obs_dtype": "|O"}, "obs_dtype |O"),
    ("a big-endian dtype", {"obs_dtype": ">f4"}, "obs_dtype >f4"),
    ("a zero dim", {"obs_shape": [4, 0]}, "obs_shape [4, 0]"),
    ("a negative dim", {"obs_shape": [-4]}, "obs_shape [-4]"),
    ("too many dims", {"obs_shape": [1] * p.MAX_NDIM}, "obs_shape"),
    ("an unknown action kind", {"action_kind": "multi"}, "ActionSpace.kind"),
    ("no discrete actions", {"action_n": 0}, "n >= 1"),
    ("box bounds of another size", {"action_kind": "box", "action_shape": [2],
                                    "action_low": [0.0], "action_high": [1.0, 1.0]},
     "box actions of shape (2,) with 1 lows and 2 highs"),
    ("a box of no dims", {"action_kind": "box", "action_shape": [0]}, "box actions"),
    ("a NaN reward threshold", {"reward_threshold": float("nan")}, "reward_threshold nan"),
    ("an infinite reward threshold", {"reward_threshold": float("inf")}, "reward_threshold inf"),
]


@pytest.mark.parametrize(("changes", "problem"), [case[1:] for case in SPEC_REFUSALS],
                         ids=[case[0] for case in SPEC_REFUSALS])
def test_declared_spaces_no_policy_could_serve_are_refused(changes: dict, problem: str) -> None:
    found = checks.spec_problem(dataclasses.replace(CARTPOLE, **changes))
    assert problem in found, found


def test_declared_spaces_a_policy_can_serve_pass() -> None:
    assert checks.spec_problem(CARTPOLE) == checks.spec_problem(PENDULUM) == ""


def test_every_bus_module_and_the_policy_seam_load_nothing_from_the_trainer() -> None:
    code = """
import importlib, json, pkgutil, sys
import stepbus.bus
bus = sorted(m.name for m in pkgutil.iter_modules(stepbus.bus.__path__, "stepbus.bus."))
for name in [*bus, "stepbus.policy", "stepbus.models.mlp"]:
    importlib.import_module(name)
print(json.dumps([bus, sorted(m for m in sys.modules if m.startswith("stepbus.trainer"))]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    bus, trainer = json.loads(out.stdout)
    assert {"stepbus.bus.broker", "stepbus.bus.checks", "stepbus.bus.controller",
            "stepbus.bus.protocol"} <= set(bus), bus
    assert trainer == []
