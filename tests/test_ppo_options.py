"""PPO's options for continuous control as the references use them: the clipped value loss
(its exact gradient, numpy and torch alike), the target-KL stop, and the learning rate
annealed over --max-env-steps by the learner."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from test_learner_state import BATCH, Bench, trajectory
from test_ppo_gradients import SPACES, finite_differences

from stepbus.models.mlp import act, init_params, ppo_loss_and_grads
from stepbus.trainer import epochs, ppo


def test_the_clipped_value_loss_has_its_exact_gradient() -> None:
    """Samples inside and outside the clip range, some where the clipped error is the larger:
    the hand-written gradient matches central differences."""
    space = SPACES["box"]
    rng = np.random.default_rng(3)
    params = {k: rng.normal(0.0, 0.6, v.shape)
              for k, v in init_params(4, space, (6, 5), rng).items()}
    b = 32
    obs = rng.normal(size=(b, 4))
    actions, logp, value = act(params, obs, space, rng)
    old_values = value.astype(np.float64) + rng.normal(0.0, 0.5, b)
    returns = rng.normal(size=b)
    args = (space, obs, actions, logp.astype(np.float64), rng.normal(size=b), returns, 0.2,
            0.0, 0.5, None, old_values, 0.2)
    moved = value - old_values
    clipped_err = old_values + np.clip(moved, -0.2, 0.2) - returns
    larger = clipped_err ** 2 > (value - returns) ** 2
    # the clipped error is the larger only outside the range (inside, V_clip is V): its
    # gradient there is 0, and elsewhere the plain one
    assert (larger & (np.abs(moved) >= 0.2)).any() and (~larger).any()
    stats, grads = ppo_loss_and_grads(params, *args)
    plain, _ = ppo_loss_and_grads(params, *args[:-2])
    assert stats["value_loss"] > plain["value_loss"], "the clipped term raises the loss"
    for key, fd in finite_differences(params, args).items():
        np.testing.assert_allclose(grads[key], fd, rtol=1e-4, atol=1e-8, err_msg=key)


def test_the_torch_value_loss_is_clipped_as_the_numpy_one() -> None:
    torch = pytest.importorskip("torch")
    from stepbus.trainer.torch_base import Targets, _value_sq

    rng = np.random.default_rng(4)
    value, old, ret = (rng.normal(size=50) for _ in range(3))
    ours = _value_sq(torch.tensor(value), Targets(torch.zeros(50), torch.zeros(50),
                                                  torch.tensor(ret), values=torch.tensor(old)),
                     0.2).numpy()
    clipped = old + np.clip(value - old, -0.2, 0.2)
    np.testing.assert_allclose(ours, np.maximum((value - ret) ** 2, (clipped - ret) ** 2))


def test_epochs_stop_once_one_exceeds_the_target_kl() -> None:
    kls = iter([0.001] * 4 + [0.05] * 4 + [0.001] * 100)  # the second epoch's is 0.05

    def step(indices: np.ndarray) -> dict[str, float]:
        return {"approx_kl": next(kls)}

    def run(target_kl: float | None) -> dict[str, float]:
        return epochs.run(step, items=64, minibatches=4, n_epochs=10,
                          rng=np.random.default_rng(0), advantages=np.ones(64),
                          returns=np.ones(64), target_kl=target_kl)

    stopped = run(0.02)
    assert stopped["n_epochs_run"] == 2 and stopped["n_grad_steps"] == 8
    kls = iter([0.05] * 100)
    whole = run(None)
    assert whole["n_epochs_run"] == 10


def test_the_learning_rate_falls_linearly_over_max_env_steps(tmp_path: Path) -> None:
    """--anneal-lr: each update's rate is lr x (1 - env steps learned / --max-env-steps),
    the numpy PPO steps with it, and the metrics say it."""
    b = Bench(tmp_path, max_env_steps=8 * BATCH)
    b.learner.cfg = dataclasses.replace(
        b.cfg, ppo=dataclasses.replace(b.cfg.ppo, anneal_lr=True))
    for seq in range(4 * BATCH // 20):
        b.deliver(trajectory(seq, version=b.learner.progress.version))
    rates = [r["learning_rate"] for r in b.records() if "learning_rate" in r]
    assert len(rates) >= 3 and rates == sorted(rates, reverse=True) and rates[0] <= 1e-3
    algo = b.learner.model.algo
    assert isinstance(algo, ppo.PPO) and algo.lr == pytest.approx(rates[-1], rel=1e-3)
    steps = b.learner.progress.env_steps
    assert rates[-1] >= 1e-3 * (1 - steps / (8 * BATCH)) - 1e-12
    b.learner.metrics.close()
