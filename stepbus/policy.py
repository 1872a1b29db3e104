"""The one interface the broker, the checks and the learner have of a model.

A `Policy` is built from the spaces the workers declare (`SpaceSpec`), takes versioned weights
(a flat map of named numpy arrays, as WEIGHTS carries them), says why weights cannot be used
before anyone uses them, and acts on a batch of observations. `make_policy(name, spec)` builds
one by name: "mlp" (the numpy MLP of `stepbus.models.mlp`, the default), "torch" (the built-in
PyTorch agents of `stepbus.models.torch_agents`), or "module:attr": a `Policy` subclass, built
from the spec, or a factory `(observation_space, action_space) -> torch.nn.Module` shaped like
CleanRL's agents, which `stepbus.models.torch_policy.TorchPolicy` drives. Names come from
configuration (`--model`, STEPBUS_MODEL; `ModelConfig`), never from a message. Weights are
told apart by `fingerprint`, a digest of their names and shapes.

Nothing here imports torch: only a torch model, once named, does (`check_model` first says
in one line how to install it when it is missing).
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stepbus.bus import protocol as p
from stepbus.imports import load_object

Params = dict[str, np.ndarray]
"""Flat parameter (or gradient) map: a name per array, as WEIGHTS carries them."""
State = dict[str, np.ndarray]
"""A recurrent model's memory for a batch of agents: arrays by name, one row per agent."""

DEFAULT = "mlp"
TORCH = "torch"
TORCH_LSTM = "torch-lstm"
BUILT_IN = {DEFAULT: "stepbus.models.mlp:MLPPolicy",
            TORCH: "stepbus.models.torch_agents:make_agent",
            TORCH_LSTM: "stepbus.models.torch_agents:make_lstm_agent"}
"""Models known by a short name, each the import path of its `Policy` class or model factory."""
MODEL_ENV = "STEPBUS_MODEL"
INSTALL_TORCH = 'pip install -e ".[torch]"'


@dataclass
class ModelConfig:
    """The model a broker acts with and a learner trains: both are given the same one."""

    model: str = field(default_factory=lambda: os.environ.get(MODEL_ENV) or DEFAULT, metadata={
        "help": "the policy's model: mlp (numpy), torch (PyTorch: an MLP, or a Nature CNN for "
                "image observations), torch-lstm (the same encoders with an LSTM core), or "
                "module:factory, where factory(observation_space, action_space) returns a "
                "torch.nn.Module with CleanRL's get_action_and_value and get_value, and "
                "initial_state for a recurrent one (docs/models.md); broker and learner need "
                f"the same one (env {MODEL_ENV})"})
    device: str = field(default="cpu", metadata={
        "help": "torch models: where they run, cpu or cuda[:N] (refused at start if CUDA is "
                "not available)"})
    torch_threads: int = field(default=1, metadata={"min": 1,
        "help": "torch models: threads torch may use in this process (torch.set_num_threads); "
                "one keeps a broker's inference from competing with the workers for cores"})


class ModelUnavailable(ValueError):
    """The configured model cannot be used here: its one-line reason (the process exits 2)."""


def _torch_missing(exc: ImportError) -> bool:
    name = exc.name or ""
    return name == "torch" or name.startswith("torch.") or name.startswith("safetensors")


def resolve(name: str) -> Any:
    """The `Policy` class or model factory `name` stands for.

    Raises:
        ModelUnavailable: an unknown name, an import path that does not load, or a torch
            model without torch installed.
    """
    path = BUILT_IN.get(name, name)
    if ":" not in path:
        raise ModelUnavailable(f"unknown model {name!r}: use one of {sorted(BUILT_IN)} or "
                               "module:factory")
    if name in (TORCH, TORCH_LSTM):
        require_torch(name)
    try:
        return load_object(path)
    except ImportError as exc:
        if _torch_missing(exc):
            raise ModelUnavailable(f"--model {name} needs PyTorch, which is not installed: "
                                   f"{INSTALL_TORCH}") from None
        raise ModelUnavailable(f"cannot load --model {name}: {type(exc).__name__}: "
                               f"{exc}") from None
    except (AttributeError, ValueError) as exc:
        raise ModelUnavailable(f"cannot load --model {name}: {type(exc).__name__}: "
                               f"{exc}") from None


def is_policy_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, Policy)


def is_torch_model(name: str) -> bool:
    """Whether `name` is a torch model (not "mlp", nor a Policy class). Raises
    ModelUnavailable."""
    return name != DEFAULT and not is_policy_class(resolve(name))


def require_torch(name: str) -> None:
    """Raises ModelUnavailable, saying how to install them, when torch or safetensors is
    missing."""
    try:
        importlib.import_module("torch")
        importlib.import_module("safetensors")
    except ImportError:
        raise ModelUnavailable(f"--model {name} needs PyTorch, which is not installed: "
                               f"{INSTALL_TORCH}") from None


def check_model(cfg: ModelConfig) -> bool:
    """Make the configured model ready to use in this process, before anything else starts:
    whether it is a torch model (then torch is imported, its device checked and its threads
    set).

    Raises:
        ModelUnavailable: its one-line reason.
    """
    if not is_torch_model(cfg.model):
        return False
    require_torch(cfg.model)
    from stepbus.models import torch_policy

    torch_policy.configure(cfg.device, cfg.torch_threads)
    return True


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
    def act(self, obs: p.Obs, rng: np.random.Generator
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Actions for a batch of observations (`stepbus.spaces`: one array for a Box, else a
        map of leaves, the action mask among them when the env gives one; a masked action
        must never be chosen).

        Returns:
            (actions, logp, value): actions of `ActionSpace.dtype` and ``(B, *batch_shape)``;
            log-probs and values float32 ``(B,)``.

        Raises:
            NoWeights: before the first `load`.
        """

    @property
    def recurrent(self) -> bool:
        """Whether the model carries a memory from step to step (`act_recurrent`, and the
        broker keeps each agent's state); a feed-forward model does not."""
        return False

    def initial_state(self, n: int) -> State:
        """The memory `n` agents start an episode with: arrays by name, one row per agent
        (the batch dimension first, whatever the model's own layout)."""
        raise NotImplementedError(f"{type(self).__name__} is not recurrent")

    def act_recurrent(self, obs: p.Obs, state: State, rng: np.random.Generator
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, State]:
        """`act` from each row's memory `state` (as `initial_state` lays it out): the outputs
        and each row's next state.

        Raises:
            NoWeights: before the first `load`.
        """
        raise NotImplementedError(f"{type(self).__name__} is not recurrent")

    @abc.abstractmethod
    def weights_problem(self, params: Mapping[str, np.ndarray]) -> str:
        """Why these weights cannot drive this policy ("" if they can). Never raises: weights
        come off the wire."""


def make_policy(name: str, spec: p.SpaceSpec, *, device: str = "cpu") -> Policy:
    """The policy `name` for these spaces: a built-in name ("mlp", "torch") or "module:attr"
    naming a `Policy` subclass or a torch model factory (run on `device`).

    Raises:
        ValueError: a name that is none of these (`ModelUnavailable`), a factory that returns
            neither a Policy nor a torch module, or a model that does not fit the spaces.
    """
    made = resolve(name)
    if is_policy_class(made):
        built: Policy = made(spec)
        return built
    if not callable(made):
        raise ValueError(f"model {name!r} is a {type(made).__name__}, not a Policy class or a "
                         "model factory")
    from stepbus.models import torch_policy  # a torch model: torch is there (resolve)

    return torch_policy.TorchPolicy.of_factory(made, spec, name=name, device=device)
