"""Correctness of the numpy actor-critic: backward pass, GAE bootstrapping, sampling."""

from __future__ import annotations

import numpy as np
import pytest

from stepbus.models.mlp import (
    ACTIVATIONS,
    RELU,
    Adam,
    Net,
    act,
    clip_grad_norm,
    forward,
    hidden_sizes,
    init_params,
    layout,
    log_prob_entropy,
    log_softmax,
    ppo_loss_and_grads,
)
from stepbus.policy import ActionSpace
from stepbus.trainer import algorithm
from stepbus.trainer.ppo import PPOConfig, Trajectory, compute_gae, ppo_update

SPACES = {
    "discrete": ActionSpace("discrete", n=3),
    "box": ActionSpace("box", shape=(2,), low=(-1.0, -1.0), high=(1.0, 1.0)),
}


# --------------------------------------------------------------------------------------------
# Gradients vs central finite differences
# --------------------------------------------------------------------------------------------


def finite_differences(params: dict[str, np.ndarray], args: tuple) -> dict[str, np.ndarray]:
    """The PPO loss's gradient by central differences (step 1e-6), parameter by parameter."""
    eps, out = 1e-6, {}
    for key, p in params.items():
        if key == RELU:  # a marker, not a weight
            continue
        fd = np.empty_like(p)
        for idx in np.ndindex(p.shape):
            orig = p[idx]
            p[idx] = orig + eps
            up = ppo_loss_and_grads(params, *args)[0]["loss"]
            p[idx] = orig - eps
            down = ppo_loss_and_grads(params, *args)[0]["loss"]
            p[idx] = orig
            fd[idx] = (up - down) / (2 * eps)
        out[key] = fd
    return out


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("kind", ["discrete", "box"])
def test_ppo_grads_match_finite_differences(kind: str, activation: str) -> None:
    space = SPACES[kind]
    rng = np.random.default_rng(1)
    params = init_params(4, space, (6, 5), rng, Net(activation))
    # random, non-degenerate params: the real init's 0.01 head gain would make pi grads tiny
    params = {k: rng.normal(0.0, 0.6, v.shape) for k, v in params.items()}
    b = 24
    obs = rng.normal(size=(b, 4))
    actions, logp, _ = act(params, obs, space, rng)
    # behaviour log-probs far from current ones: many ratios land outside [0.8, 1.2]
    old_logp = logp.astype(np.float64) + rng.normal(0.0, 0.4, b)
    advantages = rng.normal(size=b)
    returns = rng.normal(size=b)
    args = (space, obs, actions, old_logp, advantages, returns, 0.2, 0.05, 0.5)

    stats, grads = ppo_loss_and_grads(params, *args)
    ratio = np.exp(logp - old_logp)
    assert (ratio > 1.2).any() and (ratio < 0.8).any()
    # clipped-and-inactive samples exist in both directions, so the min() branch is exercised
    assert ((ratio > 1.2) & (advantages > 0)).any() and ((ratio < 0.8) & (advantages < 0)).any()
    assert 0.0 < stats["clip_fraction"] < 1.0
    assert set(grads) == set(params) - {RELU}
    assert (RELU in params) == (activation == "relu")

    for key, fd in finite_differences(params, args).items():
        p = params[key]
        assert grads[key].shape == p.shape
        rel = float(np.linalg.norm(grads[key] - fd)) / max(float(np.linalg.norm(fd)), 1e-8)
        assert rel < 1e-4, f"{kind} {key}: relative error {rel:.2e}"
        np.testing.assert_allclose(grads[key], fd, rtol=1e-4, atol=1e-8, err_msg=key)


def test_loss_stats_at_ratio_one() -> None:
    """On fresh data the ratio is 1: no clipping, zero KL, policy loss = -mean(A)."""
    space = SPACES["discrete"]
    rng = np.random.default_rng(2)
    params = init_params(4, space, rng=rng)
    obs = rng.normal(size=(32, 4))
    actions, logp, _ = act(params, obs, space, rng)
    adv = rng.normal(size=32)
    stats, _ = ppo_loss_and_grads(params, space, obs, actions, logp, adv, adv, 0.2, 0.0, 0.5)
    assert stats["clip_fraction"] == 0.0
    assert abs(stats["approx_kl"]) < 1e-6
    assert stats["policy_loss"] == pytest.approx(-adv.mean(), abs=1e-6)


# --------------------------------------------------------------------------------------------
# Init, structure, optimiser
# --------------------------------------------------------------------------------------------


def test_init_layout_and_orthogonality() -> None:
    rng = np.random.default_rng(3)
    params = init_params(5, SPACES["box"], (64, 32), rng)
    assert hidden_sizes(params) == (64, 32)
    assert {k: v.shape for k, v in params.items()} == layout(5, SPACES["box"], (64, 32))
    assert params["pi.0.w"].shape == (5, 64) and params["pi.2.w"].shape == (32, 2)
    assert params["vf.2.w"].shape == (32, 1) and params["log_std"].shape == (2,)
    assert all(v.dtype == np.float64 for v in params.values())
    w = params["pi.1.w"]  # (64, 32): columns orthogonal with norm sqrt(2)
    np.testing.assert_allclose(w.T @ w, 2.0 * np.eye(32), atol=1e-10)
    np.testing.assert_allclose(np.linalg.norm(params["pi.2.w"], axis=0), 0.01, rtol=1e-10)
    assert not any(params[k].any() for k in params if k.endswith(".b") or k == "log_std")


def test_a_relu_net_with_torch_init_and_its_own_log_std() -> None:
    """SB3's policy_kwargs for rl-zoo's MuJoCo settings: ReLU, ortho_init=False, log_std_init;
    the activation rides in the weights, so `forward` needs nothing else."""
    rng = np.random.default_rng(3)
    net = Net("relu", log_std_init=-2.0, ortho_init=False)
    params = init_params(5, SPACES["box"], (64, 32), rng, net)
    assert {k: v.shape for k, v in params.items()} == layout(5, SPACES["box"], (64, 32), True)
    np.testing.assert_array_equal(params["log_std"], [-2.0, -2.0])
    bound = 1 / np.sqrt(64)  # torch.nn.Linear's for fan_in 64
    assert np.abs(params["pi.1.w"]).max() <= bound and params["pi.1.b"].any()
    obs = rng.normal(size=(7, 5))
    h = np.maximum(obs @ params["pi.0.w"] + params["pi.0.b"], 0)
    h = np.maximum(h @ params["pi.1.w"] + params["pi.1.b"], 0)
    np.testing.assert_allclose(forward(params, obs)[0], h @ params["pi.2.w"] + params["pi.2.b"])
    with pytest.raises(ValueError, match="'gelu'"):
        Net("gelu")
    # the flag's check (the algorithm interface imports no model) names the same ones
    assert algorithm.ACTIVATIONS == ACTIVATIONS


def test_forward_flattens_obs_and_accepts_float32() -> None:
    rng = np.random.default_rng(4)
    params = init_params(6, SPACES["discrete"], rng=rng)
    obs = rng.normal(size=(7, 2, 3)).astype(np.float32)
    out, v = forward(params, obs)
    out_flat, v_flat = forward(params, obs.reshape(7, 6).astype(np.float64))
    assert out.shape == (7, 3) and v.shape == (7,)
    np.testing.assert_array_equal(out, out_flat)
    np.testing.assert_array_equal(v, v_flat)


def test_adam_and_grad_clipping() -> None:
    grads = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}
    assert clip_grad_norm(grads, 1.0) == pytest.approx(5.0)
    norm = np.sqrt(sum((g**2).sum() for g in grads.values()))
    assert norm == pytest.approx(1.0, rel=1e-5)
    # first Adam step moves every coordinate by ~lr in the -sign(g) direction
    params = {"a": np.zeros(2), "b": np.zeros((1, 1))}
    Adam(lr=0.1).step(params, {"a": np.array([2.0, -3.0]), "b": np.array([[1.0]])})
    np.testing.assert_allclose(params["a"], [-0.1, 0.1], rtol=1e-4)
    np.testing.assert_allclose(params["b"], [[-0.1]], rtol=1e-4)


# --------------------------------------------------------------------------------------------
# GAE: terminated vs truncated vs horizon cut
# --------------------------------------------------------------------------------------------


def _constant_value_params(c: float) -> dict[str, np.ndarray]:
    """A critic that outputs ``c`` everywhere, so GAE can be worked out by hand."""
    params = init_params(2, SPACES["discrete"], (3,), np.random.default_rng(0))
    params["vf.1.w"][:] = 0.0
    params["vf.1.b"][:] = c
    return params


def _traj(rewards: list[float], terminated: bool, truncated: bool) -> Trajectory:
    t = len(rewards)
    return Trajectory(
        obs=np.zeros((t, 2), dtype=np.float32),
        actions=np.zeros(t, dtype=np.int64),
        logp=np.zeros(t, dtype=np.float32),
        values=np.full(t, 123.0, dtype=np.float32),  # stale behaviour values: must be ignored
        rewards=np.asarray(rewards, dtype=np.float32),
        terminated=terminated,
        truncated=truncated,
        bootstrap_obs=np.ones(2, dtype=np.float32),
    )


def test_gae_hand_computed() -> None:
    gamma, lam, v = 0.5, 0.5, 2.0
    cfg = PPOConfig(gamma=gamma, gae_lambda=lam)
    params = _constant_value_params(v)
    rewards = [1.0, 2.0]
    trajs = [_traj(rewards, True, False), _traj(rewards, False, True), _traj(rewards, False, False)]
    adv, ret = compute_gae(trajs, params, cfg)

    # terminated: delta1 = r1 - V = 0, delta0 = r0 + g V - V = 0   -> A = [0, 0]
    # bootstrapped: delta1 = r1 + g V - V = 1, delta0 = 0 -> A = [g l * 1, 1] = [0.25, 1]
    terminated = np.array([0.0, 0.0])
    bootstrapped = np.array([0.25, 1.0])
    np.testing.assert_allclose(adv, np.concatenate([terminated, bootstrapped, bootstrapped]))
    np.testing.assert_allclose(ret, adv + v)
    # truncated and horizon cut bootstrap identically; terminated differs by g V at the end
    np.testing.assert_allclose(ret[2:4] - ret[0:2], [gamma * lam * gamma * v, gamma * v])


def test_gae_single_step_and_order() -> None:
    cfg = PPOConfig(gamma=0.9, gae_lambda=0.7)
    params = _constant_value_params(1.0)
    trajs = [_traj([5.0], False, False), _traj([1.0, 1.0, 1.0], True, False)]
    adv, _ = compute_gae(trajs, params, cfg)
    # delta = r + g V' - V with V = 1; the 2nd trajectory's last step is terminal (V' = 0)
    d = [5.0 + 0.9 - 1.0, 1.0 + 0.9 - 1.0, 1.0 + 0.9 - 1.0, 1.0 + 0.0 - 1.0]
    gl = 0.63
    expected = [d[0], d[1] + gl * d[2] + gl**2 * d[3], d[2] + gl * d[3], d[3]]
    np.testing.assert_allclose(adv, expected)


def test_gae_matches_reference_loop_on_random_data() -> None:
    rng = np.random.default_rng(5)
    params = init_params(3, SPACES["discrete"], (8,), rng)
    cfg = PPOConfig()
    trajs = []
    for length in (1, 7, 32, 4):
        t = _traj(list(rng.normal(size=length)), bool(rng.random() < 0.5), False)
        t.obs = rng.normal(size=(length, 3))
        t.bootstrap_obs = rng.normal(size=3)
        trajs.append(t)
    adv, _ = compute_gae(trajs, params, cfg)
    expected = []
    for t in trajs:
        assert isinstance(t.obs, np.ndarray) and isinstance(t.bootstrap_obs, np.ndarray)
        _, values = forward(params, t.obs)
        next_v = 0.0 if t.terminated else forward(params, t.bootstrap_obs[None])[1][0]
        a, out = 0.0, []
        for i in reversed(range(len(t))):
            delta = t.rewards[i] + cfg.gamma * next_v - values[i]
            a = delta + cfg.gamma * cfg.gae_lambda * a
            out.append(a)
            next_v = values[i]
        expected.extend(reversed(out))
    np.testing.assert_allclose(adv, expected, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------
# act(): log-probs and sampling distribution
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["discrete", "box"])
def test_act_logp_and_value_match_forward(kind: str) -> None:
    space = SPACES[kind]
    rng = np.random.default_rng(6)
    params = init_params(4, space, rng=rng)
    params = {k: v + rng.normal(0.0, 0.3, v.shape) for k, v in params.items()}
    obs = rng.normal(size=(50, 4)).astype(np.float32)
    actions, logp, v = act(params, obs, space, rng)
    assert logp.dtype == np.float32 and v.dtype == np.float32 and logp.shape == (50,)
    if kind == "discrete":
        assert actions.dtype == np.int64 and actions.shape == (50,)
    else:
        assert actions.dtype == np.float32 and actions.shape == (50, 2)
    out, v_ref = forward(params, obs)
    logp_ref, _ = log_prob_entropy(out, params, space, actions)
    np.testing.assert_allclose(logp, logp_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v, v_ref, rtol=1e-6, atol=1e-6)


def test_discrete_action_frequencies_match_softmax() -> None:
    space = ActionSpace("discrete", n=4)
    rng = np.random.default_rng(7)
    params = init_params(3, space, rng=rng)
    params["pi.2.b"] = np.array([1.0, -1.0, 0.0, 0.5])  # a clearly non-uniform policy
    obs = np.repeat(rng.normal(size=(3, 3)), 20_000, axis=0)
    actions, _, _ = act(params, obs, space, rng)
    probs = np.exp(log_softmax(forward(params, obs[::20_000])[0]))
    for row in range(3):
        freq = np.bincount(actions[row * 20_000 : (row + 1) * 20_000], minlength=4) / 20_000
        sigma = np.sqrt(probs[row] * (1 - probs[row]) / 20_000)
        assert np.all(np.abs(freq - probs[row]) < 5 * sigma), (freq, probs[row])


def test_box_action_moments() -> None:
    space = SPACES["box"]
    rng = np.random.default_rng(8)
    params = init_params(3, space, rng=rng)
    params["pi.2.b"] = np.array([0.5, -2.0])  # mean outside the bounds: act must not clip
    params["log_std"] = np.array([-1.0, 0.5])
    obs = np.zeros((40_000, 3))
    actions, _, _ = act(params, obs, space, rng)
    np.testing.assert_allclose(actions.mean(0), [0.5, -2.0], atol=0.03)
    np.testing.assert_allclose(actions.std(0), np.exp([-1.0, 0.5]), rtol=0.02)


@pytest.mark.parametrize("kind", ["discrete", "box"])
def test_act_in_blocks_equals_row_by_row(kind: str) -> None:
    """Large batches are processed in row blocks; that must not change what is sampled."""
    space = SPACES[kind]
    params = init_params(4, space, rng=np.random.default_rng(9))
    params = {k: v + np.random.default_rng(10).normal(0.0, 0.3, v.shape) for k, v in params.items()}
    obs = np.random.default_rng(11).normal(size=(1000, 4))
    actions, logp, v = act(params, obs, space, np.random.default_rng(12))
    rng = np.random.default_rng(12)
    rows = [act(params, obs[i : i + 1], space, rng) for i in range(len(obs))]
    if kind == "discrete":
        np.testing.assert_array_equal(actions, np.concatenate([r[0] for r in rows]))
    else:
        np.testing.assert_allclose(actions, np.concatenate([r[0] for r in rows]), rtol=1e-6)
    np.testing.assert_allclose(logp, np.concatenate([r[1] for r in rows]), rtol=1e-5)
    np.testing.assert_allclose(v, np.concatenate([r[2] for r in rows]), rtol=1e-5)


def test_ppo_update_box_ragged_batch() -> None:
    """A batch that overshoots minibatch_size (as off the bus) trains in equal minibatches."""
    space = ActionSpace("box", shape=(2,))
    rng = np.random.default_rng(13)
    params = init_params(3, space, (16,), rng)
    before = {k: v.copy() for k, v in params.items()}
    trajs = []
    for length in (100, 100, 100, 7):  # 307 steps: one minibatch of 307, not 256 + 51
        obs = rng.normal(size=(length, 3)).astype(np.float32)
        actions, logp, values = act(params, obs, space, rng)
        trajs.append(
            Trajectory(obs, actions, logp, values, rng.normal(size=length), False, True, obs[-1])
        )
    cfg = PPOConfig(n_epochs=3)
    stats = ppo_update(params, Adam(), trajs, cfg, rng, action=space)
    assert stats["n_samples"] == 307 and stats["n_grad_steps"] == 3
    assert all(np.isfinite(v) for v in stats.values())
    assert set(params) == set(before)
    assert all(not np.array_equal(params[k], before[k]) for k in params)


# --------------------------------------------------------------------------------------------
# Multi-discrete and multi-binary heads, with and without action masks
# --------------------------------------------------------------------------------------------


def _categorical_mask(space: ActionSpace, b: int, rng: np.random.Generator) -> np.ndarray:
    """A random mask leaving at least one category of every dimension allowed."""
    mask = rng.random((b, space.dim)) < 0.6
    start = 0
    for n in space.categories:
        part = mask[:, start:start + n]
        part[np.arange(b), rng.integers(n, size=b)] = True
        start += n
    return mask


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("space", [
    ActionSpace("multi_discrete", shape=(3,), nvec=(3, 2, 4)),
    ActionSpace("multi_discrete", shape=(2, 2), nvec=(2, 3, 1, 2)),
    ActionSpace("multi_binary", shape=(3,), nvec=(2, 2, 2)),
    ActionSpace("discrete", n=5),
], ids=["md", "md2x2", "mb", "discrete"])
def test_categorical_ppo_grads_match_finite_differences(space: ActionSpace, masked: bool) -> None:
    """Per-dimension log-softmax, summed log-probs and entropies, and masked logits (which get
    no gradient) are differentiated exactly."""
    rng = np.random.default_rng(21)
    params = init_params(4, space, (6, 5), rng)
    params = {k: rng.normal(0.0, 0.6, v.shape) for k, v in params.items()}
    b = 24
    obs = rng.normal(size=(b, 4))
    mask = _categorical_mask(space, b, rng) if masked else None
    actions, logp, _ = act(params, obs, space, rng, mask)
    assert actions.shape == (b, *space.batch_shape)
    if mask is not None:
        flat = actions.reshape(b, -1) + np.concatenate([[0], np.cumsum(space.categories)[:-1]])
        assert mask[np.arange(b)[:, None], flat].all(), "a masked action was sampled"
    old_logp = logp.astype(np.float64) + rng.normal(0.0, 0.4, b)
    advantages, returns = rng.normal(size=b), rng.normal(size=b)
    args = (space, obs, actions, old_logp, advantages, returns, 0.2, 0.05, 0.5, mask)
    stats, grads = ppo_loss_and_grads(params, *args)
    assert 0.0 < stats["clip_fraction"] < 1.0 and set(grads) == set(params)
    for key, fd in finite_differences(params, args).items():
        np.testing.assert_allclose(grads[key], fd, rtol=1e-4, atol=1e-8, err_msg=key)
    if mask is not None:
        out, _ = forward(params, obs)
        logp_now, _ = log_prob_entropy(out, params, space, actions, mask)
        np.testing.assert_allclose(logp_now, logp, rtol=1e-5, atol=1e-5)
