"""The one interface the broker, the checks and the learner have of a model, and the choice
of a model by name.

The interface itself lives in `stepbus.models.base`, which the implementations import, and is
imported here under the same names. A `Policy` is built from the spaces the workers declare
(`SpaceSpec`), takes versioned weights (a flat map of named numpy arrays, as WEIGHTS carries
them), says why weights cannot be used before anyone uses them, and acts on a batch of
observations. `make_policy(name, spec)` builds one by name: "mlp" (the numpy MLP of
`stepbus.models.mlp`, the default), "torch" (the built-in PyTorch agents of
`stepbus.models.torch_agents`), or "module:attr": a `Policy` subclass, built from the spec, or
a factory `(observation_space, action_space) -> torch.nn.Module` shaped like CleanRL's agents,
which `stepbus.models.torch_policy.TorchPolicy` drives. Names come from configuration
(`--model`, STEPBUS_MODEL; `ModelConfig`), never from a message. Weights are told apart by
`fingerprint`, a digest of their names and shapes.

Nothing here imports torch: only a torch model, once named, does (`check_model` first says
in one line how to install it when it is missing).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any

from stepbus.bus import protocol as p
from stepbus.imports import load_object
from stepbus.models.base import ActionSpace as ActionSpace
from stepbus.models.base import ModelUnavailable as ModelUnavailable
from stepbus.models.base import NoWeights as NoWeights
from stepbus.models.base import Params as Params
from stepbus.models.base import Policy as Policy
from stepbus.models.base import State as State
from stepbus.models.base import action_space as action_space
from stepbus.models.base import fingerprint as fingerprint
from stepbus.models.base import obs_dim as obs_dim
from stepbus.models.base import obs_shape as obs_shape

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
    set). The numpy MLP's module is imported now, while every process starts, rather than on
    the first worker's spaces, when the pipeline waits for it.

    Raises:
        ModelUnavailable: its one-line reason.
    """
    if not is_torch_model(cfg.model):
        if cfg.model == DEFAULT:
            resolve(DEFAULT)
        return False
    require_torch(cfg.model)
    from stepbus.models import torch_policy

    torch_policy.configure(cfg.device, cfg.torch_threads)
    return True


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
