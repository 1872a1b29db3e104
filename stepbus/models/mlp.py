"""A small numpy MLP actor-critic with a hand-written PPO backward pass.

Pure numpy so the broker can run inference and the trainer can learn without torch. The
network mirrors SB3's ``MlpPolicy``: separate policy and value MLPs with tanh (or ReLU) hidden
layers and orthogonal (or PyTorch's default) init, so rl-zoo hyperparameters carry over
unchanged.

Parameters live in a flat ``dict[str, np.ndarray]`` (float64) that can be shipped over the wire
as-is: ``pi.{i}.w`` / ``pi.{i}.b`` and ``vf.{i}.w`` / ``vf.{i}.b`` for layer ``i`` (the last
index is the output head), plus ``log_std`` for box actions, plus ``RELU`` (one zero) when the
hidden layers are ReLU. Weights are stored ``(in, out)`` so a layer is ``x @ w + b``. The
network is recovered from the keys alone, so the broker needs no setting of the learner's.

`MLPPolicy` is this network as a `stepbus.policy.Policy` (the broker's default model); the
learner's PPO uses the functions directly (`init_params`, `ppo_loss_and_grads`, `Adam`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from stepbus import spaces
from stepbus.bus import protocol as p
from stepbus.models.base import ActionSpace, NoWeights, Params, Policy

_LOG_2PI = math.log(2.0 * math.pi)
ACTIVATIONS = ("tanh", "relu")
"""The hidden layers' activations this network offers (`--activation`)."""
RELU = "activation/relu"
"""Present (one zero, never trained) in the weights of a network with ReLU hidden layers: the
activation travels with the weights, as the widths do in the shapes."""


# --------------------------------------------------------------------------------------------
# Init and structure
# --------------------------------------------------------------------------------------------


def _orthogonal(rng: np.random.Generator, n_in: int, n_out: int, gain: float) -> np.ndarray:
    """Orthogonal ``(n_in, n_out)`` matrix, drawn like ``torch.nn.init.orthogonal_``."""
    rows, cols = n_out, n_in  # torch's (out, in) layout, transposed at the end
    a = rng.standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(a)
    q *= np.where(np.diag(r) < 0, -1.0, 1.0)  # sign fix makes the draw uniform (Haar)
    if rows < cols:
        q = q.T
    return np.ascontiguousarray(gain * q.T)


@dataclass(frozen=True)
class Net:
    """How a network is made, beyond its widths (SB3's policy_kwargs of the same names)."""

    activation: str = "tanh"
    """Of the hidden layers: one of ACTIVATIONS."""
    log_std_init: float = 0.0
    """A Gaussian head's log-std at the start."""
    ortho_init: bool = True
    """Orthogonal init with SB3's gains; else PyTorch's default for a Linear layer."""

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: one of {', '.join(ACTIVATIONS)}")


def init_params(
    obs_dim: int,
    action: ActionSpace,
    hidden: tuple[int, ...] = (64, 64),
    rng: np.random.Generator | None = None,
    net: Net | None = None,
) -> Params:
    """SB3-style init: gain sqrt(2) hidden, 0.01 policy head, 1.0 value head, zero biases (or,
    without ``net.ortho_init``, PyTorch's default for a Linear layer, as SB3's
    ``ortho_init=False``); ``log_std`` at ``net.log_std_init``.

    The tiny policy-head gain starts the policy near uniform / zero-mean, which is a large part
    of why SB3's PPO is sample-efficient on CartPole.
    """
    rng = np.random.default_rng() if rng is None else rng
    net = Net() if net is None else net
    params: Params = {}
    for prefix, out_dim, out_gain in (("pi", action.dim, 0.01), ("vf", 1, 1.0)):
        sizes = (obs_dim, *hidden, out_dim)
        for i in range(len(sizes) - 1):
            w, b = f"{prefix}.{i}.w", f"{prefix}.{i}.b"
            if net.ortho_init:
                gain = out_gain if i == len(sizes) - 2 else math.sqrt(2.0)
                params[w] = _orthogonal(rng, sizes[i], sizes[i + 1], gain)
                params[b] = np.zeros(sizes[i + 1])
            else:  # torch.nn.Linear's: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for both
                bound = 1.0 / math.sqrt(sizes[i])
                params[w] = rng.uniform(-bound, bound, (sizes[i], sizes[i + 1]))
                params[b] = rng.uniform(-bound, bound, sizes[i + 1])
    if action.kind == "box":
        params["log_std"] = np.full(action.dim, float(net.log_std_init))
    if net.activation == "relu":
        params[RELU] = np.zeros(1)
    return params


def layout(
    obs_dim: int, action: ActionSpace, hidden: tuple[int, ...], relu: bool = False
) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape for these spaces, hidden widths and activation, as
    `init_params` makes them."""
    shapes: dict[str, tuple[int, ...]] = {}
    for prefix, out_dim in (("pi", action.dim), ("vf", 1)):
        sizes = (obs_dim, *hidden, out_dim)
        for i in range(len(sizes) - 1):
            shapes[f"{prefix}.{i}.w"] = (sizes[i], sizes[i + 1])
            shapes[f"{prefix}.{i}.b"] = (sizes[i + 1],)
    if action.kind == "box":
        shapes["log_std"] = (action.dim,)
    if relu:
        shapes[RELU] = (1,)
    return shapes


def _n_layers(params: Mapping[str, np.ndarray], prefix: str) -> int:
    """Number of dense layers under ``prefix`` (output head included)."""
    i = 0
    while f"{prefix}.{i}.w" in params:
        i += 1
    if i == 0:
        raise KeyError(f"no '{prefix}.0.w' in params")
    return i


def hidden_sizes(params: Mapping[str, np.ndarray]) -> tuple[int, ...]:
    """Hidden widths of the policy MLP, recovered from the param dict."""
    n = _n_layers(params, "pi")
    return tuple(int(params[f"pi.{i}.w"].shape[1]) for i in range(n - 1))


def infer_action_space(
    params: Mapping[str, np.ndarray], shape: tuple[int, ...] | None = None
) -> ActionSpace:
    """Best-effort ActionSpace from params alone (box shape defaults to flat, no bounds; a
    categorical head is taken as one Discrete)."""
    dim = int(params[f"pi.{_n_layers(params, 'pi') - 1}.w"].shape[1])
    if "log_std" in params:
        return ActionSpace("box", shape=shape if shape is not None else (dim,))
    return ActionSpace("discrete", n=dim)


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def _flat_obs(obs: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """(B, *obs_shape) of any numeric dtype -> (B, obs_dim) float64 (or `dtype`)."""
    obs = np.asarray(obs)
    return obs.reshape(obs.shape[0], math.prod(obs.shape[1:])).astype(dtype, copy=False)


WIDE_INPUT = 1024
"""Inputs at least this wide (pixels: 84x84x4 is 28,224) meet the first layer in float32 when
acting with ``for_inference`` params. There that one matrix product is nearly all of the cost
(a uint8 frame converts to half the bytes, and sgemm runs about twice as fast as dgemm); every
later layer, the log-softmax and the sampling stay float64. The outputs leave as float32 anyway,
and on Atari-sized frames the learner's float64 log-probs differ from the broker's by under 1e-6
(``tests/test_inference.py``), far inside PPO's clip range."""


def for_inference(params: Mapping[str, np.ndarray]) -> Params:
    """``params`` as ``act`` should get them where it runs often (the broker): the first layers'
    weights in float32 when the input is at least WIDE_INPUT wide, the rest as they are. Made once
    per weights version, not per call."""
    out = dict(params)
    if params["pi.0.w"].shape[0] >= WIDE_INPUT:
        for prefix in ("pi", "vf"):
            out[f"{prefix}.0.w"] = np.ascontiguousarray(params[f"{prefix}.0.w"], np.float32)
    return out


def _input_dtype(params: Mapping[str, np.ndarray]) -> type:
    """float32 for ``for_inference`` params of a wide input, else float64."""
    return np.float32 if params["pi.0.w"].dtype == np.float32 else np.float64


def _mlp(
    params: Mapping[str, np.ndarray],
    prefix: str,
    x: np.ndarray,
    inputs: list[np.ndarray] | None = None,
) -> np.ndarray:
    """tanh (or ReLU) MLP with a linear last layer; appends each layer's input to ``inputs``
    if given."""
    n = _n_layers(params, prefix)
    relu = RELU in params
    h = x
    for i in range(n):
        if inputs is not None:
            inputs.append(h)
        z = h @ params[f"{prefix}.{i}.w"]
        if z.dtype != np.float64:  # a float32 first layer (for_inference): float64 from here on
            z = z.astype(np.float64)
        z += params[f"{prefix}.{i}.b"]
        h = (np.maximum(z, 0.0, out=z) if relu else np.tanh(z, out=z)) if i < n - 1 else z
    return h


def _mlp_backward(
    params: Mapping[str, np.ndarray],
    prefix: str,
    inputs: list[np.ndarray],
    g_out: np.ndarray,
    grads: Params,
) -> None:
    """Backprop ``g_out`` (dLoss/d output) through the MLP whose layer inputs were recorded."""
    g = g_out
    relu = RELU in params
    for i in reversed(range(len(inputs))):
        h_in = inputs[i]
        grads[f"{prefix}.{i}.w"] = h_in.T @ g
        grads[f"{prefix}.{i}.b"] = g.sum(axis=0)
        if i > 0:  # h_in is layer i-1's output: tanh' = 1 - h_in^2, relu' = [h_in > 0]
            g = g @ params[f"{prefix}.{i}.w"].T
            g *= (h_in > 0.0) if relu else (1.0 - h_in * h_in)


def forward(params: Mapping[str, np.ndarray], obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """obs (B, *obs_shape) -> (logits or Gaussian mean (B, dim), value (B,)), float64."""
    x = _flat_obs(obs, _input_dtype(params))
    return _mlp(params, "pi", x), _mlp(params, "vf", x)[:, 0]


def value(params: Mapping[str, np.ndarray], obs: np.ndarray) -> np.ndarray:
    """Critic only, (B,) float64: half the cost of ``forward`` when the policy isn't needed."""
    return _mlp(params, "vf", _flat_obs(obs, _input_dtype(params)))[:, 0]


# --------------------------------------------------------------------------------------------
# Distributions
# --------------------------------------------------------------------------------------------


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax over the last axis."""
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _none() -> np.ndarray:
    return np.empty(0)


@dataclass(frozen=True)
class _HeadTerms:
    """The action distribution's forward terms on a batch, kept for the backward pass: the
    log-prob of the actions taken and the entropy, (B,) each; for a discrete head every
    action's log-prob and probability (B, n) and the actions as indices (B,); for a box head
    the standardised actions z = (a - mean) / std (B, dim) and log_std (dim,)."""

    logp: np.ndarray
    entropy: np.ndarray
    logp_all: np.ndarray = field(default_factory=_none)
    probs: np.ndarray = field(default_factory=_none)
    taken: np.ndarray = field(default_factory=_none)
    z: np.ndarray = field(default_factory=_none)
    log_std: np.ndarray = field(default_factory=_none)


MASKED_LOGIT = -1e9
"""The logit of an action the mask rules out: its probability is exactly 0, its log-prob finite
(so 0 * log p stays 0 in the entropy), and no gradient reaches it."""


def _offsets(action: ActionSpace) -> np.ndarray:
    """Where each categorical dimension's logits start in the head's output."""
    return np.concatenate([[0], np.cumsum(action.categories)[:-1]]).astype(np.intp)


def categorical_log_probs(out: np.ndarray, action: ActionSpace,
                          mask: np.ndarray | None) -> np.ndarray:
    """Each dimension's log-softmax over its own logits, masked actions at MASKED_LOGIT."""
    logits = out if mask is None else np.where(mask, out, MASKED_LOGIT)
    if len(action.categories) == 1:
        return log_softmax(logits)
    logp_all = np.empty_like(logits)
    for start, n in zip(_offsets(action), action.categories, strict=True):
        logp_all[:, start:start + n] = log_softmax(logits[:, start:start + n])
    return logp_all


def _head_terms(
    params: Mapping[str, np.ndarray], action: ActionSpace, out: np.ndarray, actions: np.ndarray,
    mask: np.ndarray | None = None,
) -> _HeadTerms:
    """Log-prob and entropy of ``actions`` under the head output ``out`` (logits or means):
    for categorical heads, summed over the dimensions (they are independent)."""
    if action.categorical:
        b = out.shape[0]
        logp_all = categorical_log_probs(out, action, mask)
        probs = np.exp(logp_all)
        taken = np.asarray(actions).reshape(b, -1).astype(np.intp) + _offsets(action)
        logp = np.take_along_axis(logp_all, taken, axis=1).sum(axis=1)
        entropy = -(probs * logp_all).sum(axis=1)
        return _HeadTerms(logp, entropy, logp_all=logp_all, probs=probs, taken=taken)
    log_std = params["log_std"]
    a_box = np.asarray(actions, dtype=np.float64).reshape(out.shape)
    z = (a_box - out) * np.exp(-log_std)
    logp = -0.5 * (z * z).sum(axis=1) - log_std.sum() - 0.5 * _LOG_2PI * out.shape[1]
    entropy = np.full(out.shape[0], log_std.sum() + 0.5 * (1.0 + _LOG_2PI) * out.shape[1])
    return _HeadTerms(logp, entropy, z=z, log_std=log_std)


def log_prob_entropy(
    out: np.ndarray, params: Mapping[str, np.ndarray], action: ActionSpace, actions: np.ndarray,
    mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Log-prob of ``actions`` and entropy under the policy head output ``out``, both (B,)."""
    terms = _head_terms(params, action, out, actions, mask)
    return terms.logp, terms.entropy


_ACT_BLOCK_ELEMS = 16_384
"""act() works in row blocks whose widest activation is <= 128 KiB of float64. Bigger
temporaries are mmap'd by glibc and page-faulted afresh on every call, which doubled the cost
per row at B >= 512 (measured); small blocks stay on the heap and in L2."""


def act(
    params: Mapping[str, np.ndarray],
    obs: np.ndarray,
    action: ActionSpace,
    rng: np.random.Generator,
    mask: np.ndarray | None = None,
    deterministic: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample a batch: (actions, logp float32 (B,), value float32 (B,)).

    Categorical actions are `action.dtype` (B, *batch_shape), each dimension drawn by inverse
    CDF (one uniform per row and dimension), never one that `mask` (B, action.dim) rules out.
    Box actions are float32 (B, *shape), unclipped; logp is computed on the float32 values
    actually returned so the learner's recomputed log-prob matches at ratio 1.
    `deterministic`: each dimension's most likely category, or the Gaussian's mean clipped to
    the space's bounds (its log-prob the mean's), and no draw from `rng`.
    """
    obs = np.asarray(obs)
    b = obs.shape[0]
    widest = max(w.shape[1] for k, w in params.items() if k.endswith(".w"))
    block = max(1, _ACT_BLOCK_ELEMS // widest)
    if b <= block:
        return _act_block(params, obs, action, rng, mask, deterministic)
    actions: np.ndarray = np.empty((b, *action.batch_shape), dtype=action.dtype)
    logp = np.empty(b, dtype=np.float32)
    v = np.empty(b, dtype=np.float32)
    for start in range(0, b, block):
        rows = slice(start, start + block)
        actions[rows], logp[rows], v[rows] = _act_block(
            params, obs[rows], action, rng, None if mask is None else mask[rows], deterministic)
    return actions, logp, v


def _pick_categorical(logp_all: np.ndarray, action: ActionSpace,
                      rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray]:
    """(actions (B, dims) int64, their summed log-prob (B,)): sampled by inverse CDF per
    dimension, or without `rng` each dimension's most likely category (greedy acting)."""
    b = logp_all.shape[0]
    taken = np.empty((b, len(action.categories)), np.int64)
    logp = np.zeros(b)
    for j, (start, n) in enumerate(zip(_offsets(action), action.categories, strict=True)):
        part = logp_all[:, start:start + n]
        if rng is None:
            taken[:, j] = part.argmax(axis=1)
        else:
            cdf = np.cumsum(np.exp(part), axis=1)
            u = rng.random((b, 1)) * cdf[:, -1:]  # scaled by the total: rounding can't overflow n
            # A masked action's CDF step is zero wide: `<=` passes over it, never lands on it.
            taken[:, j] = (cdf[:, :-1] <= u).sum(axis=1)
        logp += np.take_along_axis(part, taken[:, j:j + 1], axis=1)[:, 0]
    return taken, logp


def _act_block(
    params: Mapping[str, np.ndarray],
    obs: np.ndarray,
    action: ActionSpace,
    rng: np.random.Generator,
    mask: np.ndarray | None = None,
    deterministic: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``act`` on one block of rows."""
    out, v = forward(params, obs)
    b = out.shape[0]
    if action.categorical:
        logp_all = categorical_log_probs(out, action, mask)
        taken, logp = _pick_categorical(logp_all, action, None if deterministic else rng)
        actions: np.ndarray = taken.reshape(b, *action.batch_shape).astype(action.dtype)
    else:
        noise = 0.0 if deterministic else np.exp(params["log_std"]) * rng.standard_normal(
            out.shape)
        sample = (out + noise).astype(np.float32)
        logp, _ = log_prob_entropy(out, params, action, sample)
        actions = sample.reshape(b, *action.shape)
        if deterministic:
            actions = action.clipped(actions)
    return actions, logp.astype(np.float32), v.astype(np.float32)


# --------------------------------------------------------------------------------------------
# PPO loss with a hand-written backward pass
# --------------------------------------------------------------------------------------------


def _surrogate(
    logp: np.ndarray, old_logp: np.ndarray, adv: np.ndarray, clip_range: float
) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """PPO's clipped surrogate loss and its gradient by ``logp``:
    (loss, ratio, log_ratio, dLoss/dlogp)."""
    b = len(logp)
    log_ratio = logp - np.asarray(old_logp, dtype=np.float64)
    ratio = np.exp(log_ratio)
    clipped = np.clip(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = -float(np.minimum(ratio * adv, clipped * adv).mean())
    # the min() passes gradient only where the unclipped term is the smaller one
    active = ~(((adv > 0) & (ratio > 1.0 + clip_range)) | ((adv < 0) & (ratio < 1.0 - clip_range)))
    g_logp = np.where(active, -adv * ratio / b, 0.0)  # dLoss/dlogp via dr/dlogp = r
    return policy_loss, ratio, log_ratio, g_logp


def _entropy_cols(terms: _HeadTerms, action: ActionSpace) -> np.ndarray:
    """Each logit's own dimension's entropy, (B, dim) (or (B, 1) for one dimension)."""
    if len(action.categories) == 1:
        return terms.entropy[:, None]
    per_logit = -(terms.probs * terms.logp_all)
    ends = np.cumsum(action.categories)
    per_dim = np.add.reduceat(per_logit, ends - np.asarray(action.categories), axis=1)
    return np.repeat(per_dim, action.categories, axis=1)


def _head_grads(
    terms: _HeadTerms, action: ActionSpace, g_logp: np.ndarray, ent_coef: float, grads: Params
) -> np.ndarray:
    """dLoss/d(head output) from dLoss/dlogp and the entropy bonus; a box head's ``log_std``
    gradient goes straight into ``grads``."""
    b = len(g_logp)
    if action.categorical:
        g_out = -terms.probs * g_logp[:, None]  # dlogp/dlogits = onehot(a) - p, per dimension
        g_out[np.arange(b)[:, None], terms.taken] += g_logp[:, None]
        # dH_j/dlogits_j = -p (log p + H_j) within dimension j; loss has -ent_coef/b * H per row
        g_out += (ent_coef / b) * terms.probs * (terms.logp_all + _entropy_cols(terms, action))
        return g_out
    z = terms.z
    g_out = (g_logp[:, None] * z) * np.exp(-terms.log_std)  # dlogp/dmean = z / std
    # dlogp/dlog_std = z^2 - 1 per dim; dH/dlog_std = 1 per dim
    grads["log_std"] = g_logp @ (z * z - 1.0) - ent_coef
    return g_out


def ppo_loss_and_grads(
    params: Mapping[str, np.ndarray],
    action: ActionSpace,
    obs: np.ndarray,
    actions: np.ndarray,
    old_logp: np.ndarray,
    advantages: np.ndarray,
    returns: np.ndarray,
    clip_range: float,
    ent_coef: float,
    vf_coef: float,
    mask: np.ndarray | None = None,
    old_values: np.ndarray | None = None,
    clip_range_vf: float | None = None,
) -> tuple[dict[str, float], Params]:
    """SB3's clipped PPO loss and its exact gradient.

    loss = -mean(min(r A, clip(r, 1-c, 1+c) A)) + vf_coef mean((R - V)^2) - ent_coef mean(H),
    with r = exp(logp - old_logp). ``advantages`` are used as given (normalise before calling).
    With ``clip_range_vf`` the value term is mean(max((R - V)^2, (R - V_clip)^2)), V_clip the
    ``old_values`` moved at most that far towards V (SB3's clip_range_vf, CleanRL's clip_vloss).
    Returns (stats, grads) with grads keyed exactly like ``params`` (RELU aside: untrained).
    """
    x = _flat_obs(obs)
    b = x.shape[0]
    adv = np.asarray(advantages, dtype=np.float64)
    ret = np.asarray(returns, dtype=np.float64)
    pi_inputs: list[np.ndarray] = []
    vf_inputs: list[np.ndarray] = []
    out = _mlp(params, "pi", x, pi_inputs)
    v = _mlp(params, "vf", x, vf_inputs)[:, 0]
    terms = _head_terms(params, action, out, actions, mask)
    policy_loss, ratio, log_ratio, g_logp = _surrogate(terms.logp, old_logp, adv, clip_range)
    value_sq, value_grad = _value_terms(v, ret, old_values, clip_range_vf)
    value_loss = float(value_sq.mean())
    entropy_mean = float(terms.entropy.mean())
    loss = policy_loss + vf_coef * value_loss - ent_coef * entropy_mean

    grads: Params = {}
    g_out = _head_grads(terms, action, g_logp, ent_coef, grads)
    _mlp_backward(params, "pi", pi_inputs, g_out, grads)
    _mlp_backward(params, "vf", vf_inputs, (vf_coef / b) * value_grad[:, None], grads)
    stats = {
        "policy_loss": policy_loss,
        "value_loss": value_loss,
        "entropy": entropy_mean,
        "approx_kl": float(((ratio - 1.0) - log_ratio).mean()),
        "clip_fraction": float((np.abs(ratio - 1.0) > clip_range).mean()),
        "loss": float(loss),
    }
    return stats, grads


# --------------------------------------------------------------------------------------------
# Optimisation
# --------------------------------------------------------------------------------------------


def _value_terms(v: np.ndarray, ret: np.ndarray, old: np.ndarray | None,
                 clip: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's value loss and its derivative by V: (V - R)^2 and 2 (V - R); with a clip,
    where the clipped value's error is the larger, (V_clip - R)^2 and its derivative, which
    is 2 (V_clip - R) inside the clip range and 0 outside, where V_clip does not move."""
    err = v - ret
    if old is None or clip is None:
        return err * err, 2.0 * err
    moved = v - old
    clipped_err = old + np.clip(moved, -clip, clip) - ret
    use_clipped = clipped_err * clipped_err > err * err
    loss = np.where(use_clipped, clipped_err * clipped_err, err * err)
    grad = np.where(use_clipped, 2.0 * clipped_err * (np.abs(moved) < clip), 2.0 * err)
    return loss, grad


def clip_grad_norm(grads: Params, max_norm: float) -> float:
    """Scale ``grads`` in place to global L2 norm <= max_norm (torch semantics); return the
    norm before clipping."""
    norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))
    if norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads.values():
            g *= scale
    return norm


class Adam:
    """torch.optim.Adam with SB3's eps=1e-5; moments are created lazily per param key."""

    def __init__(
        self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-5
    ) -> None:
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.t = 0
        self.m: Params = {}
        self.v: Params = {}
        self._work: Params = {}

    def step(
        self, params: Params, grads: Mapping[str, np.ndarray], lr: float | None = None
    ) -> None:
        """One update of ``params`` in place; ``lr`` overrides ``self.lr`` (for schedules)."""
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.t += 1
        step_size = lr / (1.0 - b1**self.t)
        sqrt_bc2 = math.sqrt(1.0 - b2**self.t)
        for key, g in grads.items():
            m = self.m.get(key)
            if m is None:
                m = self.m[key] = np.zeros_like(params[key])
                self.v[key] = np.zeros_like(params[key])
            v = self.v[key]
            work = self._work.get(key)
            if work is None or work.shape != (2, *m.shape):
                work = self._work[key] = np.empty((2, *m.shape))
            # In place through scratch arrays, the same operations in the same order as
            # `step_size * m / (sqrt(v) / sqrt_bc2 + eps)`: a temporary of a 256x256 layer is
            # mmap'd and page-faulted afresh on every step, which made this half an update.
            a, b = work[0], work[1]
            m *= b1
            m += np.multiply(1.0 - b1, g, out=a)
            v *= b2
            v += np.multiply(1.0 - b2, np.multiply(g, g, out=a), out=a)
            np.sqrt(v, out=a)
            a /= sqrt_bc2
            a += self.eps
            np.divide(np.multiply(step_size, m, out=b), a, out=a)
            params[key] -= a


# --------------------------------------------------------------------------------------------
# The MLP as a Policy
# --------------------------------------------------------------------------------------------


class MLPPolicy(Policy):
    """This network as the broker's model: weights of any hidden widths, read from their names,
    acted with in the broker's precision (`for_inference`)."""

    def __init__(self, spec: p.SpaceSpec) -> None:
        super().__init__(spec)
        self.params: Params = {}

    def prepare(self, params: Mapping[str, np.ndarray]) -> None:
        self.params = for_inference(params)

    def act(self, obs: p.Obs, rng: np.random.Generator, deterministic: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.params:
            raise NoWeights("the MLP policy has no weights yet")
        return self._act(self.params, obs, rng, deterministic)

    def _act(self, params: Mapping[str, np.ndarray], obs: p.Obs, rng: np.random.Generator,
             deterministic: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Categorical leaves one-hot, the rest flattened (`spaces.flatten`), then `act`."""
        x = spaces.flatten(self.spec, obs, _input_dtype(params))
        return act(params, x, self.action, rng, spaces.mask(self.spec, obs), deterministic)

    def weights_problem(self, params: Mapping[str, np.ndarray]) -> str:
        """Names and shapes of an MLP for these spaces, float and finite values, and one trial
        step with finite outputs of the right shapes."""
        try:
            with np.errstate(all="ignore"):  # hostile values: judged, not warned about
                return self._weights_problem(params)
        except Exception as exc:  # any malformed parameter set
            return f"{type(exc).__name__}: {exc}"[:200]

    def _weights_problem(self, params: Mapping[str, np.ndarray]) -> str:
        if not all(isinstance(v, np.ndarray) and v.dtype.kind == "f" for v in params.values()):
            return "parameters must be float arrays"
        if "pi.0.w" not in params or "vf.0.w" not in params:
            return "not MLP parameters: no pi.0.w or vf.0.w"
        want = layout(spaces.flat_dim(self.spec), self.action, hidden_sizes(params),
                      RELU in params)
        missing = [name for name in want if name not in params]
        unexpected = [name for name in params if name not in want]
        if missing or unexpected:
            return f"parameters missing {missing[:3]}, unexpected {unexpected[:3]}"[:200]
        for name, shape in want.items():
            if params[name].shape != shape:
                return f"{name} of shape {params[name].shape}, the spaces need {shape}"
        if not all(np.isfinite(v).all() for v in params.values()):
            return "non-finite parameters"
        actions, logp, value = self._act(params, self.zeros(1), np.random.default_rng(0))
        expected = (1, *self.action.batch_shape)
        if actions.shape != expected:
            return f"actions of shape {actions.shape}, expected {expected}"
        if not (np.isfinite(logp).all() and np.isfinite(value).all()):
            return "non-finite log-prob or value"
        return ""
