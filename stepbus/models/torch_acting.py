"""A policy's greedy acting path as one torch module of tensors in, actions out: what
`stepbus export` traces into an ONNX graph (`stepbus.export`).

Each piece does on tensors what the acting path does on numpy arrays, in the same order and
precision: `Normalise` is `normalize.Stats.apply` (float64, then float32), `mask_of` is
`spaces.mask`, `MLPActing` is the numpy MLP's `act(..., deterministic=True)` (float64, as
`stepbus.models.mlp` computes it; its weights are the policy's own), and `TorchActing` drives a
torch model's module as `TorchPolicy` does, through its `get_action_and_value(...,
deterministic=True)`. Box actions are clipped to the space's bounds (`ActionSpace.clipped`).

Importing this module imports torch: only an export does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from stepbus import spaces
from stepbus.bus import protocol as p
from stepbus.models import mlp, torch_policy
from stepbus.models.base import ActionSpace, Policy, action_space
from stepbus.models.torch_policy import TorchPolicy
from stepbus.normalize import EPS, Stats

Obs = dict[str, torch.Tensor] | torch.Tensor
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int8): torch.int8,
                 np.dtype(np.float32): torch.float32}


def buffer(module: nn.Module, name: str) -> torch.Tensor:
    """One of the module's buffers by name (they are named by index, as layers and leaves)."""
    return module.get_buffer(name)


class Normalise(nn.Module):
    """`Stats.apply` on tensors: each normalised leaf in float64, clipped, as float32."""

    def __init__(self, stats: Stats | None) -> None:
        super().__init__()
        self.keys = sorted(stats.mean) if stats is not None else []
        self.clip = stats.clip if stats is not None else 0.0
        for i, key in enumerate(self.keys):
            assert stats is not None
            self.register_buffer(f"mean_{i}", torch.from_numpy(
                np.asarray(stats.mean[key], np.float64)))
            self.register_buffer(f"std_{i}", torch.from_numpy(
                np.sqrt(np.asarray(stats.var[key], np.float64) + EPS)))

    def leaf(self, i: int, x: torch.Tensor) -> torch.Tensor:
        scaled = (x.double() - buffer(self, f"mean_{i}")) / buffer(self, f"std_{i}")
        return scaled.clamp(-self.clip, self.clip).float()

    def forward(self, obs: Obs) -> Obs:
        if not self.keys:
            return obs
        if isinstance(obs, torch.Tensor):
            return self.leaf(0, obs)
        out = dict(obs)
        for i, key in enumerate(self.keys):
            out[key] = self.leaf(i, obs[key])
        return out


def observations(spec: p.SpaceSpec, inputs: Sequence[torch.Tensor]) -> Obs:
    """The leading inputs as a batch of observations, as `stepbus.spaces` lays them out."""
    if not spec.obs_leaves:
        return inputs[0]
    return {leaf.key: x for leaf, x in zip(spec.obs_leaves, inputs, strict=False)}


def mask_of(spec: p.SpaceSpec, obs: Obs) -> torch.Tensor | None:
    """`spaces.mask` on tensors: (B, categories) bool, a dimension with nothing allowed in a
    row allowed all; None without a mask."""
    if not isinstance(obs, dict) or spaces.MASK not in obs:
        return None
    given = obs[spaces.MASK]
    allowed = given.reshape(given.shape[0], -1) != 0
    parts = [part | ~part.any(dim=1, keepdim=True)
             for part in torch.split(allowed, list(spec.action_nvec or [spec.action_n]), dim=1)]
    return torch.cat(parts, dim=1)


class Choose(nn.Module):
    """The action a head's output stands for: a Box's mean clipped to the space's bounds, as
    float32 in the space's shape; a categorical action's type and shape from indices."""

    def __init__(self, action: ActionSpace) -> None:
        super().__init__()
        self.action = action
        self.bounded = action.kind == "box" and bool(action.low)
        if self.bounded:
            self.register_buffer("low", torch.tensor(action.low, dtype=torch.float32))
            self.register_buffer("high", torch.tensor(action.high, dtype=torch.float32))

    def box(self, mean: torch.Tensor) -> torch.Tensor:
        b = mean.shape[0]
        flat = mean.reshape(b, -1).float()
        if self.bounded:
            flat = torch.minimum(torch.maximum(flat, buffer(self, "low")), buffer(self, "high"))
        return flat.reshape(b, *self.action.shape)

    def categories(self, taken: torch.Tensor) -> torch.Tensor:
        dtype = _TORCH_DTYPES[np.dtype(self.action.dtype)]
        return taken.reshape(taken.shape[0], *self.action.batch_shape).to(dtype)


class MLPActing(nn.Module):
    """The numpy MLP's greedy act on its own weights: observations flattened as
    `spaces.flatten` does (categorical leaves one-hot), tanh (or ReLU) layers, the (masked)
    log-softmax's argmax per dimension or the Gaussian's mean."""

    def __init__(self, spec: p.SpaceSpec, params: Mapping[str, np.ndarray],
                 stats: Stats | None) -> None:
        super().__init__()
        self.spec, self.action = spec, action_space(spec)
        self.normalise, self.choose = Normalise(stats), Choose(self.action)
        self.layers = mlp._n_layers(params, "pi")
        self.relu = mlp.RELU in params
        for i in range(self.layers):
            for part in ("w", "b"):
                self.register_buffer(f"{part}{i}", torch.from_numpy(
                    np.array(params[f"pi.{i}.{part}"])))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        obs = self.normalise(observations(self.spec, inputs))
        h = flatten(self.spec, obs, buffer(self, "w0").dtype)
        for i in range(self.layers):
            z = (h @ buffer(self, f"w{i}")).double() + buffer(self, f"b{i}")
            h = (torch.relu(z) if self.relu else torch.tanh(z)) if i < self.layers - 1 else z
        if not self.action.categorical:
            return self.choose.box(h)
        mask = mask_of(self.spec, obs)
        logits = h if mask is None else torch.where(mask, h, torch.full_like(h, mlp.MASKED_LOGIT))
        taken = [torch.log_softmax(part, dim=1).argmax(dim=1)
                 for part in torch.split(logits, list(self.action.categories), dim=1)]
        return self.choose.categories(torch.stack(taken, dim=1))


def flatten(spec: p.SpaceSpec, obs: Obs, dtype: torch.dtype) -> torch.Tensor:
    """`spaces.flatten` on tensors: (B, flat_dim) of `dtype`, the mask leaf left out."""
    if isinstance(obs, torch.Tensor):
        return obs.reshape(obs.shape[0], -1).to(dtype)
    parts = []
    for leaf in spec.obs_leaves:
        if leaf.key == spaces.MASK:
            continue
        x = obs[leaf.key]
        b = x.shape[0]
        if leaf.kind not in ("discrete", "multi_discrete"):
            parts.append(x.reshape(b, -1).to(dtype))
            continue
        codes = x.reshape(b, -1).long() - torch.tensor(leaf.start, dtype=torch.int64)
        for j, n in enumerate(leaf.nvec):
            inside = ((codes[:, j] >= 0) & (codes[:, j] < n)).unsqueeze(1)
            hot = nn.functional.one_hot(codes[:, j].clamp(0, n - 1), n)
            parts.append((hot * inside).to(dtype))
    return torch.cat(parts, dim=1)


class TorchActing(nn.Module):
    """A torch model's module acting greedily as `TorchPolicy.greedy` drives it: floats as
    float32, other leaves as they are, nested as the env's space (`spaces.structured`), the
    mask as `action_mask=`; a recurrent module from each row's state (its initial state where
    `episode_start`), giving the next state too, batch first."""

    def __init__(self, policy: TorchPolicy, stats: Stats | None) -> None:
        super().__init__()
        self.policy, self.spec, self.module = policy, policy.spec, policy.module
        self.normalise, self.choose = Normalise(stats), Choose(policy.action)
        self.memory = policy.memory
        self.parts = len(self.memory.axes) if self.memory is not None else 0
        if self.memory is not None:
            for key, value in policy.initial_state(1).items():
                self.register_buffer(f"initial_{key}", torch.from_numpy(value))

    def forward(self, *inputs: torch.Tensor) -> Any:
        n_obs = len(inputs) - (1 + self.parts if self.parts else 0)
        obs = self.normalise(observations(self.spec, inputs[:n_obs]))
        mask = mask_of(self.spec, obs)
        state = (None if self.memory is None
                 else self.module_state(inputs[n_obs], inputs[n_obs + 1:]))
        x = _float32(obs)
        call = TensorCall(self.module, x if isinstance(x, torch.Tensor)
                          else spaces.structured(self.spec, x),
                          {} if mask is None else {"action_mask": mask}, state,
                          inputs[0].shape[0])
        taken, _, _, after = self.policy.greedy(call)
        action = (self.choose.categories(taken) if self.choose.action.categorical
                  else self.choose.box(taken))
        if self.memory is None:
            return action
        parts = list(after) if self.memory.nested else [after]
        return (action, *(t.movedim(axis, 0)
                          for t, axis in zip(parts, self.memory.axes, strict=True)))

    def module_state(self, start: torch.Tensor, rows: Sequence[torch.Tensor]) -> Any:
        """Rows of state (the initial state where `start`) laid out as the module takes it."""
        assert self.memory is not None
        parts = []
        for i, (row, axis) in enumerate(zip(rows, self.memory.axes, strict=True)):
            first = start.reshape(-1, *([1] * (row.dim() - 1))).to(torch.bool)
            parts.append(torch.where(first, buffer(self, f"initial_{i}"), row).movedim(0, axis))
        return tuple(parts) if self.memory.nested else parts[0]


class TensorCall(torch_policy._Call):
    """`TorchPolicy`'s one forward of its module, on tensors already made (a traced graph's
    inputs) rather than numpy observations."""

    def __init__(self, module: nn.Module, x: Any, mask: dict[str, torch.Tensor], state: Any,
                 rows: int) -> None:
        self.module, self.state, self.x, self.mask, self.rows = module, state, x, mask, rows
        self.done = torch.zeros(rows, dtype=torch.bool)


def _float32(obs: Obs) -> Obs:
    """Float leaves as float32, as `torch_policy.as_input` gives them; others as they are."""
    if isinstance(obs, torch.Tensor):
        return _leaf_float32(obs)
    return {key: _leaf_float32(x) for key, x in obs.items()}


def _leaf_float32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.is_floating_point() else x


def acting_module(policy: Policy, stats: Stats | None) -> nn.Module:
    """The greedy acting path of a loaded policy (the numpy MLP or a torch model) behind the
    normalisation `stats` (None: none).

    Raises:
        ValueError: a model of another kind (a `Policy` class of your own), which has no
            torch form to export, or one that cannot act greedily (`greedy_problem`).
    """
    if isinstance(policy, mlp.MLPPolicy):
        return MLPActing(policy.spec, policy.params, stats).eval()
    if isinstance(policy, TorchPolicy):
        if policy.greedy_problem:
            raise ValueError(policy.greedy_problem)
        return TorchActing(policy, stats).eval()
    raise ValueError(f"a {type(policy).__name__} model cannot be exported: only the numpy MLP "
                     "and torch models (built in, or module:factory) can")


def example_inputs(policy: Policy, n: int) -> list[torch.Tensor]:
    """A batch of `n` inputs for tracing: zero observations (every action allowed), and for a
    recurrent model episode starts and its initial state."""
    zeros = spaces.zeros(policy.spec, n)
    found = list(zeros.values()) if isinstance(zeros, dict) else [zeros]
    if policy.recurrent:
        found.append(np.ones(n, bool))
        found += list(policy.initial_state(n).values())
    return [torch.from_numpy(np.ascontiguousarray(x)) for x in found]

