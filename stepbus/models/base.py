"""What every model implements, and the types the rest of stepbus knows a model by: `Policy`,
its `ActionSpace`, its weights (`Params`) and memory (`State`), and their errors. The
implementations (`stepbus.models.mlp`, `stepbus.models.torch_policy`) import this module, and
`stepbus.policy`, which picks one by name, imports them: no implementation imports the
module that chooses it.
"""

from __future__ import annotations

import abc
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stepbus.bus import protocol as p

Params = dict[str, np.ndarray]
"""Flat parameter (or gradient) map: a name per array, as WEIGHTS carries them."""
State = dict[str, np.ndarray]
"""A recurrent model's memory for a batch of agents: arrays by name, one row per agent."""


class ModelUnavailable(ValueError):
    """The configured model cannot be used here: its one-line reason (the process exits 2)."""


@dataclass(frozen=True)
class ActionSpace:
    """What the policy head emits: ``n`` categories (discrete); a float box of ``shape``; or
    one categorical per element of ``shape``, element i with ``nvec[i]`` categories
    (multi_discrete, and multi_binary with two each)."""

    kind: str  # "discrete", "box", "multi_discrete" or "multi_binary"
    n: int = 0
    shape: tuple[int, ...] = ()
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()
    nvec: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("discrete", "box", "multi_discrete", "multi_binary"):
            raise ValueError("ActionSpace.kind must be 'discrete', 'box', 'multi_discrete' or "
                             f"'multi_binary', got {self.kind!r}")
        if self.kind == "discrete" and self.n < 1:
            raise ValueError("a discrete ActionSpace needs n >= 1")
        if self.kind in ("multi_discrete", "multi_binary") and (
                len(self.nvec) != math.prod(self.shape) or not all(n >= 1 for n in self.nvec)):
            raise ValueError(f"a {self.kind} ActionSpace of shape {self.shape} needs that many "
                             f"category counts >= 1, got {self.nvec[:4]}")

    @property
    def categorical(self) -> bool:
        return self.kind != "box"

    @property
    def categories(self) -> tuple[int, ...]:
        """Category counts of each categorical dimension: (n,) for discrete."""
        return (self.n,) if self.kind == "discrete" else self.nvec

    @property
    def dim(self) -> int:
        """Width of the policy head: number of logits, or number of Gaussian means."""
        return math.prod(self.shape) if self.kind == "box" else sum(self.categories)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """One action's shape in a batch: () for discrete, else the space's shape."""
        return () if self.kind == "discrete" else self.shape

    @property
    def dtype(self) -> type:
        """How actions travel: int64 categories (int8 for multi_binary), float32 boxes."""
        return {"box": np.float32, "multi_binary": np.int8}.get(self.kind, np.int64)

    def clipped(self, actions: np.ndarray) -> np.ndarray:
        """A batch of Box actions clipped to the space's bounds, as a worker clips what it
        steps with; any other kind, or a Box without bounds, as it is."""
        if self.kind != "box" or not self.low:
            return actions
        b = len(actions)
        return np.clip(actions.reshape(b, -1), np.asarray(self.low, np.float32),
                       np.asarray(self.high, np.float32)).astype(actions.dtype).reshape(
                           actions.shape)

    @classmethod
    def from_gymnasium(cls, space: Any) -> ActionSpace:
        """Build from a Gymnasium Discrete, Box, MultiDiscrete or MultiBinary space."""
        from stepbus import spaces

        return action_space(p.SpaceSpec([], "", **spaces.action_fields(space)))


def action_space(spec: p.SpaceSpec) -> ActionSpace:
    """The action head the spaces call for.

    Raises:
        ValueError: an unknown action kind, or fewer than 1 action.
    """
    if spec.action_kind == "discrete":
        return ActionSpace("discrete", n=spec.action_n)
    return ActionSpace(spec.action_kind, shape=tuple(spec.action_shape),
                       low=tuple(spec.action_low), high=tuple(spec.action_high),
                       nvec=tuple(spec.action_nvec))


def obs_shape(spec: p.SpaceSpec) -> tuple[int, ...]:
    """One Box observation's shape (a batch adds a leading dimension); () for any other."""
    return tuple(spec.obs_shape)


def obs_dim(spec: p.SpaceSpec) -> int:
    """Numbers in one observation, flattened (categorical leaves one-hot)."""
    from stepbus import spaces

    return spaces.flat_dim(spec)


def fingerprint(params: Mapping[str, np.ndarray]) -> str:
    """A short digest of the parameters' names and shapes (not values, not dtypes): equal for
    weights of one architecture, so a learner and a broker can tell they serve the same model."""
    layout = ";".join(f"{name}:{'x'.join(map(str, np.shape(params[name])))}"
                      for name in sorted(params))
    return hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()


class NoWeights(RuntimeError):
    """`act` was called before any weights were loaded."""


class Policy(abc.ABC):
    """A model that acts for the agents of one policy name.

    Implementations fill in `prepare`, `act` and `weights_problem`; everything else is here.
    `version` is -1 and `fingerprint` empty until the first `load`.
    """

    def __init__(self, spec: p.SpaceSpec) -> None:
        self.spec = spec
        self.action = action_space(spec)
        self.version = -1
        self.fingerprint = ""

    @property
    def loaded(self) -> bool:
        return self.version >= 0

    def load(self, params: Mapping[str, np.ndarray], version: int) -> None:
        """Act with these weights from now on. Only weights `weights_problem` passed."""
        self.prepare(params)
        self.version = version
        self.fingerprint = fingerprint(params)

    @abc.abstractmethod
    def prepare(self, params: Mapping[str, np.ndarray]) -> None:
        """Make `params` ready to act with (once per version, not per batch)."""

    def zeros(self, n: int) -> p.Obs:
        """A batch of `n` observations of these spaces, all zero: for trial steps."""
        from stepbus import spaces

        return spaces.zeros(self.spec, n)

    @abc.abstractmethod
    def act(self, obs: p.Obs, rng: np.random.Generator, deterministic: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Actions for a batch of observations (`stepbus.spaces`: one array for a Box, else a
        map of leaves, the action mask among them when the env gives one; a masked action
        must never be chosen).

        `deterministic` acts greedily, for evaluation: the distribution's mode, the argmax of
        each dimension's (masked) logits, or a Box's mean clipped to the space's bounds
        (`ActionSpace.clipped`); the log-prob is then the mode's, before clipping.

        Returns:
            (actions, logp, value): actions of `ActionSpace.dtype` and ``(B, *batch_shape)``;
            log-probs and values float32 ``(B,)``.

        Raises:
            NoWeights: before the first `load`.
        """

    @property
    def greedy_problem(self) -> str:
        """Why `act(..., deterministic=True)` cannot be had from this model ("" if it can)."""
        return ""

    @property
    def recurrent(self) -> bool:
        """Whether the model carries a memory from step to step (`act_recurrent`, and the
        broker keeps each agent's state); a feed-forward model does not."""
        return False

    def initial_state(self, n: int) -> State:
        """The memory `n` agents start an episode with: arrays by name, one row per agent
        (the batch dimension first, whatever the model's own layout)."""
        raise NotImplementedError(f"{type(self).__name__} is not recurrent")

    def act_recurrent(self, obs: p.Obs, state: State, rng: np.random.Generator,
                      deterministic: bool = False
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, State]:
        """`act` from each row's memory `state` (as `initial_state` lays it out): the outputs
        and each row's next state; `deterministic` as for `act`.

        Raises:
            NoWeights: before the first `load`.
        """
        raise NotImplementedError(f"{type(self).__name__} is not recurrent")

    @abc.abstractmethod
    def weights_problem(self, params: Mapping[str, np.ndarray]) -> str:
        """Why these weights cannot drive this policy ("" if they can). Never raises: weights
        come off the wire."""
