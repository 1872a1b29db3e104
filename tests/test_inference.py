"""The broker's inference (`mlp.for_inference` params, as `MLPPolicy.load` makes them) against
the learner's float64 pass."""

from __future__ import annotations

import numpy as np
import pytest

from stepbus.bus import protocol as p
from stepbus.models import mlp
from stepbus.policy import ActionSpace, make_policy
from stepbus.workers.bench_envs import FRAME_SHAPE, _frame_pool

SPACE = ActionSpace("discrete", n=4)


@pytest.mark.parametrize("hidden", [(1,), (64, 64)])
def test_wide_inputs_act_in_float32_within_float32_rounding_of_the_learners_log_probs(
        hidden: tuple[int, ...]) -> None:
    """PPO's ratio is exp(learner logp - broker logp): it must start at 1 within float32
    rounding, not drift because the broker's first layer ran in float32."""
    rng = np.random.default_rng(0)
    params = mlp.init_params(int(np.prod(FRAME_SHAPE)), SPACE, hidden, rng)
    params = {k: v + rng.normal(0.0, 0.1 * (v.std() + 1e-3), v.shape) for k, v in params.items()}
    fast = mlp.for_inference(params)
    assert fast["pi.0.w"].dtype == np.float32 and fast["vf.0.w"].dtype == np.float32
    assert all(fast[k].dtype == np.float64 for k in params if not k.endswith(".0.w"))
    obs = _frame_pool()[rng.integers(0, len(_frame_pool()), 128)]
    actions, logp, value = mlp.act(fast, obs, SPACE, np.random.default_rng(1))
    out, value_ref = mlp.forward(params, obs)
    logp_ref, _ = mlp.log_prob_entropy(out, params, SPACE, actions)
    np.testing.assert_allclose(logp, logp_ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(value, value_ref, rtol=1e-5, atol=1e-5)


def test_narrow_inputs_act_exactly_as_before() -> None:
    """CartPole-sized inputs keep float64 everywhere: same samples, bit for bit."""
    params = mlp.init_params(4, SPACE, rng=np.random.default_rng(2))
    fast = mlp.for_inference(params)
    assert all(fast[k].dtype == params[k].dtype for k in params)
    obs = np.random.default_rng(3).normal(size=(64, 4)).astype(np.float32)
    ours = mlp.act(fast, obs, SPACE, np.random.default_rng(4))
    ref = mlp.act(params, obs, SPACE, np.random.default_rng(4))
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_mlp_policy_acts_with_the_inference_params_of_the_version_it_loaded() -> None:
    """The broker's path: `load` prepares the weights once, `act` uses them; a wide input's
    first layer is float32 there, and the samples are `act` on `for_inference` params."""
    spec = p.SpaceSpec(list(FRAME_SHAPE), "|u1", "discrete", action_n=4)
    params = mlp.init_params(int(np.prod(FRAME_SHAPE)), SPACE, (8,), np.random.default_rng(5))
    policy = make_policy("mlp", spec)
    assert policy.weights_problem(params) == ""
    policy.load(params, 7)
    assert policy.version == 7 and isinstance(policy, mlp.MLPPolicy)
    assert policy.params["pi.0.w"].dtype == np.float32
    obs = _frame_pool()[:16]
    ours = policy.act(obs, np.random.default_rng(6))
    ref = mlp.act(mlp.for_inference(params), obs, SPACE, np.random.default_rng(6))
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_array_equal(a, b)
