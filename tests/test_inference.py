"""The broker's inference (`model.for_inference` params) against the learner's float64 pass."""

from __future__ import annotations

import numpy as np
import pytest
from stepbus.trainer import model
from stepbus.workers.bench_envs import FRAME_SHAPE, _frame_pool

SPACE = model.ActionSpace("discrete", n=4)


@pytest.mark.parametrize("hidden", [(1,), (64, 64)])
def test_wide_inputs_act_in_float32_within_float32_rounding_of_the_learners_log_probs(
        hidden: tuple[int, ...]) -> None:
    """PPO's ratio is exp(learner logp - broker logp): it must start at 1 within float32
    rounding, not drift because the broker's first layer ran in float32."""
    rng = np.random.default_rng(0)
    params = model.init_params(int(np.prod(FRAME_SHAPE)), SPACE, hidden, rng)
    params = {k: v + rng.normal(0.0, 0.1 * (v.std() + 1e-3), v.shape) for k, v in params.items()}
    fast = model.for_inference(params)
    assert fast["pi.0.w"].dtype == np.float32 and fast["vf.0.w"].dtype == np.float32
    assert all(fast[k].dtype == np.float64 for k in params if not k.endswith(".0.w"))
    obs = _frame_pool()[rng.integers(0, len(_frame_pool()), 128)]
    actions, logp, value = model.act(fast, obs, SPACE, np.random.default_rng(1))
    out, value_ref = model.forward(params, obs)
    logp_ref, _ = model.log_prob_entropy(out, params, SPACE, actions)
    np.testing.assert_allclose(logp, logp_ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(value, value_ref, rtol=1e-5, atol=1e-5)


def test_narrow_inputs_act_exactly_as_before() -> None:
    """CartPole-sized inputs keep float64 everywhere: same samples, bit for bit."""
    params = model.init_params(4, SPACE, rng=np.random.default_rng(2))
    fast = model.for_inference(params)
    assert all(fast[k].dtype == params[k].dtype for k in params)
    obs = np.random.default_rng(3).normal(size=(64, 4)).astype(np.float32)
    ours = model.act(fast, obs, SPACE, np.random.default_rng(4))
    ref = model.act(params, obs, SPACE, np.random.default_rng(4))
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_array_equal(a, b)
