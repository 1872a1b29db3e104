"""The one interface the broker, the checks and the learner have of a model.

A `Policy` is built from the spaces the workers declare (`SpaceSpec`), takes versioned weights
(a flat map of named numpy arrays, as WEIGHTS carries them), says why weights cannot be used
before anyone uses them, and acts on a batch of observations. `make_policy(name, spec)` builds
one by name: "mlp" (the numpy MLP of `stepbus.models.mlp`, the default) or "module:factory", a
callable of the spec that returns a Policy. Names come from configuration, never from a message.
Weights are told apart by `fingerprint`, a digest of their names and shapes.
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
from stepbus.imports import load_object

Params = dict[str, np.ndarray]
"""Flat parameter (or gradient) map: a name per array, as WEIGHTS carries them."""

DEFAULT = "mlp"
BUILT_IN = {"mlp": "stepbus.models.mlp:MLPPolicy"}
"""Policies known by a short name, each the import path of its factory."""


@dataclass(frozen=True)
class ActionSpace:
    """What the policy head emits: ``n`` categories, or a float box of ``shape``."""

    kind: str  # "discrete" or "box"
    n: int = 0
    shape: tuple[int, ...] = ()
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("discrete", "box"):
            raise ValueError(f"ActionSpace.kind must be 'discrete' or 'box', got {self.kind!r}")
        if self.kind == "discrete" and self.n < 1:
            raise ValueError("a discrete ActionSpace needs n >= 1")

    @property
    def dim(self) -> int:
        """Width of the policy head: number of logits, or number of Gaussian means."""
        return self.n if self.kind == "discrete" else math.prod(self.shape)

    @classmethod
    def from_gymnasium(cls, space: Any) -> ActionSpace:
        """Build from a ``gymnasium.spaces.Discrete`` or ``Box`` (duck-typed, no import)."""
        if hasattr(space, "n"):
            return cls("discrete", n=int(space.n))
        low = np.broadcast_to(np.asarray(space.low, dtype=np.float64), space.shape)
        high = np.broadcast_to(np.asarray(space.high, dtype=np.float64), space.shape)
        return cls(
            "box",
            shape=tuple(int(s) for s in space.shape),
            low=tuple(low.ravel().tolist()),
            high=tuple(high.ravel().tolist()),
        )


def action_space(spec: p.SpaceSpec) -> ActionSpace:
    """The action head the spaces call for.

    Raises:
        ValueError: an action kind other than "discrete" or "box", or fewer than 1 action.
    """
    if spec.action_kind == "discrete":
        return ActionSpace("discrete", n=spec.action_n)
    return ActionSpace(spec.action_kind, shape=tuple(spec.action_shape),
                       low=tuple(spec.action_low), high=tuple(spec.action_high))


def obs_shape(spec: p.SpaceSpec) -> tuple[int, ...]:
    """One observation's shape (a batch adds a leading dimension)."""
    return tuple(spec.obs_shape)


def obs_dim(spec: p.SpaceSpec) -> int:
    """Numbers in one observation, flattened."""
    return math.prod(spec.obs_shape)


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
        self.obs_shape = obs_shape(spec)
        self.obs_dtype = np.dtype(spec.obs_dtype)
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

    @abc.abstractmethod
    def act(self, obs: np.ndarray, rng: np.random.Generator
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Actions for a batch of observations ``(B, *obs_shape)``.

        Returns:
            (actions, logp, value): actions int64 ``(B,)`` (discrete) or float32
            ``(B, *action shape)`` (box); log-probs and values float32 ``(B,)``.

        Raises:
            NoWeights: before the first `load`.
        """

    @abc.abstractmethod
    def weights_problem(self, params: Mapping[str, np.ndarray]) -> str:
        """Why these weights cannot drive this policy ("" if they can). Never raises: weights
        come off the wire."""


def make_policy(name: str, spec: p.SpaceSpec) -> Policy:
    """The policy `name` for these spaces: a built-in name ("mlp") or "module:factory".

    Raises:
        ValueError: a name that is neither, or a factory that returns no Policy.
    """
    path = BUILT_IN.get(name, name)
    if ":" not in path:
        raise ValueError(f"unknown model {name!r}: use one of {sorted(BUILT_IN)} or "
                         "module:factory")
    policy = load_object(path)(spec)
    if not isinstance(policy, Policy):
        raise ValueError(f"model {name!r} made a {type(policy).__name__}, not a Policy")
    return policy
