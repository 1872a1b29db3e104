"""A trained policy you can hold: `load_policy(path)` reads a run's checkpoint into a
`TrainedPolicy` whose `predict` has Stable-Baselines3's shape, for a plain Gymnasium loop with
no stepbus process running.

It acts through the very code the broker acts with (`stepbus.policy.make_policy` behind
`stepbus.normalize.Normalizing`): the checkpoint's weights, the observation statistics its
version acted with, the model's action distribution (or its mode, `deterministic=True`),
masks and recurrent state. The checkpoint names its spaces and model (the learner writes them
into its progress record); one that does not is refused in one line. A checkpoint is read as
the learner reads it (trainer/checkpoint.py: never a pickle, every value checked), and its
weights are judged by the model before it acts with them. A checkpoint of your own model
(``--model module:factory``) imports that module, as the run did: load runs you trust, or name
the model yourself (``model=``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from stepbus import normalize, policy, spaces
from stepbus.bus import protocol as p
from stepbus.bus.exits import SettingError
from stepbus.models.base import State
from stepbus.trainer import checkpoint
from stepbus.trainer.algorithm import CannotStart

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_FILE = "config.toml"
POLICY_DIR_PREFIX = "policy-"  # a run's policy other than the default keeps its own checkpoint


class TrainedPolicy:
    """A run's policy, loaded: `predict` as SB3's, on one observation or a batch of them.

    Attributes:
        observation_space, action_space: the env's Gymnasium spaces, as its workers declared
            them (Box bounds of observations do not travel: those of the dtype).
        spec: the same as stepbus holds them (`SpaceSpec`).
        config: the run's configuration (RUN_DIR/config.toml) as a dict, {} without one:
            ``env`` and ``env_kwargs`` (a JSON object's text, "" for none) among it.
        run_dir: the run directory (None for a checkpoint file outside one).
        checkpoint: the checkpoint file read.
        policy_version: the version of the weights.
        model: the model's name (``mlp``, ``torch``, ``torch-lstm`` or ``module:factory``).
        policy: the acting model, normalisation included (`policy.inner`: the model alone).
        obs_stats: the observation statistics it acts with (None: observations as they are).
    """

    def __init__(self, acting: normalize.Normalizing, *, checkpoint: Path, run_dir: Path | None,
                 config: dict[str, Any], model: str) -> None:
        self.policy = acting
        self.spec = acting.spec
        self.observation_space = spaces.observation_space(self.spec)
        self.action_space = spaces.action_space(self.spec)
        self.checkpoint, self.run_dir, self.config, self.model = (checkpoint, run_dir, config,
                                                                  model)
        self.policy_version = acting.version
        self.obs_stats = acting.stats
        self.rng = np.random.default_rng()
        # what every call needs of the spaces, worked out once
        self.layout = spaces.row_layout(self.spec)
        self.leaves = [leaf for leaf in self.spec.obs_leaves if leaf.kind != "mask"]
        self.state_shapes = ({k: v.shape[1:] for k, v in acting.initial_state(1).items()}
                             if acting.recurrent else {})

    @property
    def recurrent(self) -> bool:
        """Whether the model carries a memory: then `predict` takes and returns `state`."""
        return self.policy.recurrent

    @property
    def greedy_problem(self) -> str:
        """Why the model cannot act deterministically ("" if it can)."""
        return self.policy.inner.greedy_problem

    def initial_state(self, n: int) -> State:
        """The memory `n` episodes start with (arrays by name, one row per episode); {} for a
        model without one."""
        return self.policy.initial_state(n) if self.recurrent else {}

    def set_random_seed(self, seed: int | None) -> None:
        """Seed the draws of stochastic actions (`deterministic=False`)."""
        self.rng = np.random.default_rng(seed)

    def predict(self, observation: Any, state: State | None = None,
                episode_start: Any = None, deterministic: bool = False,
                action_masks: Any = None) -> tuple[Any, State | None]:
        """Actions for one observation (as the env gives it) or a batch of them (each leaf
        with a leading batch dimension, as a vector env gives them).

        Args:
            observation: of `observation_space`, or a batch of such.
            state: a recurrent model's memory from the last call (None: episodes start now);
                ignored and returned as given for a model without one.
            episode_start: one bool per row (or one for a single observation): True where an
                episode starts, whose memory is reset first.
            deterministic: the mode of the action distribution instead of a draw from it.
            action_masks: one bool per category of each action dimension (or a batch of
                such), for an env whose masks come in `info`; a mask inside a Dict
                observation is read from it.

        Returns:
            (action or batch of actions, the memory to pass next time).

        Raises:
            ValueError: an observation or mask that does not fit the spaces.
            ModelUnavailable: `deterministic` for a model that has no mode (`greedy_problem`).
        """
        obs, n, single = self.batch(observation, action_masks)
        if not self.recurrent:
            actions, _, _ = self.policy.act(obs, self.rng, deterministic)
            return (actions[0] if single else actions), state
        memory = self.memory(state, episode_start, n)
        actions, _, _, after = self.policy.act_recurrent(obs, memory, self.rng, deterministic)
        return (actions[0] if single else actions), after

    def memory(self, state: State | None, episode_start: Any, n: int) -> State:
        """The memory to act from: `state` (or a fresh one), reset where episodes start."""
        if state is None:
            return self.policy.initial_state(n)
        want = {k: (n, *shape) for k, shape in self.state_shapes.items()}
        if set(state) != set(want) or any(np.shape(state[k]) != want[k] for k in want):
            raise ValueError(f"state of {_shapes(state)}, the model's for {n} rows is {want}")
        starts = (np.zeros(n, bool) if episode_start is None
                  else np.asarray(episode_start, bool).reshape(n))
        if not starts.any():
            return state
        fresh = self.policy.initial_state(n)
        return {k: np.where(starts.reshape(n, *[1] * (v.ndim - 1)), fresh[k], v)
                for k, v in state.items()}

    def batch(self, observation: Any, action_masks: Any) -> tuple[p.Obs, int, bool]:
        """The observation(s) as a batch stepbus acts on, its rows, and whether it was one."""
        layout = self.layout
        if layout is None:
            if action_masks is not None:
                raise ValueError("this run's env gave no action masks: action_masks cannot be "
                                 "applied")
            return _rows(np.asarray(observation), tuple(self.spec.obs_shape),
                         np.dtype(self.spec.obs_dtype), "observation")
        leaves = self.leaves
        first = _at(observation, leaves[0])
        _, n, single = _rows(np.asarray(first), tuple(leaves[0].shape),
                             np.dtype(leaves[0].dtype), leaves[0].key)
        out: dict[str, np.ndarray] = {}
        for leaf in self.spec.obs_leaves:
            shape, dtype = layout[leaf.key]
            if leaf.kind == "mask":
                out[leaf.key] = np.ones((n, *shape), dtype)
                continue
            value = np.asarray(_at(observation, leaf))
            out[leaf.key] = _rows(value[None] if single else value, shape, dtype, leaf.key)[0]
        if action_masks is not None:
            out[spaces.MASK] = self.masks(action_masks, n, out)
        return out, n, single

    def masks(self, action_masks: Any, n: int, obs: Mapping[str, np.ndarray]) -> np.ndarray:
        """`action_masks` as the mask leaf of `n` rows."""
        if spaces.MASK not in obs:
            raise ValueError("this run's env gave no action masks: action_masks cannot be "
                             "applied")
        width = math.prod(obs[spaces.MASK].shape[1:])
        flat = spaces.flat_mask(action_masks)  # as a worker reads one from `info`
        if flat.size != n * width:
            raise ValueError(f"action_masks of shape {flat.shape}: {n} row(s) of {width} "
                             "(one per category of each action dimension) are needed")
        return flat.reshape(obs[spaces.MASK].shape).astype(obs[spaces.MASK].dtype)


def _shapes(state: Mapping[str, Any]) -> str:
    return str({k: tuple(np.shape(v)) for k, v in state.items()})


def _at(observation: Any, leaf: p.LeafSpec) -> Any:
    """The value of `leaf` in an observation nested as the env's space (or a batch of them)."""
    value = observation
    for container, key in zip(leaf.containers, leaf.path, strict=True):
        value = value[int(key) if container == "tuple" else key]
    return value


def _rows(value: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, what: str
          ) -> tuple[np.ndarray, int, bool]:
    """`value` as rows of `shape` and `dtype`: (rows, how many, whether it was one)."""
    if value.shape == shape:
        return value[None].astype(dtype, copy=False), 1, True
    if value.shape[1:] == shape and value.ndim == len(shape) + 1:
        return value.astype(dtype, copy=False), value.shape[0], False
    raise ValueError(f"{what} of shape {value.shape}: {shape} for one, or (n, *{shape}) for a "
                     "batch")


# ---------------------------------------------------------------------------------------------
# Loading


def load_policy(path: str | Path, device: str = "cpu", *, model: str | None = None
                ) -> TrainedPolicy:
    """The policy of a run directory (``runs/latest`` too) or of a checkpoint file.

    Args:
        path: RUN_DIR, or RUN_DIR/checkpoint.npz or .safetensors (or a policy-NAME one).
        device: where a torch model runs (cpu, cuda[:N]).
        model: the model to load the weights into; None: the one the checkpoint names.

    Raises:
        SettingError: one line: a path that is no run or checkpoint, a checkpoint that cannot
            be read or does not say its spaces and model, or weights that do not fit them.
    """
    ckpt, run_dir = locate(Path(path))
    params, progress = read(ckpt)
    spec = spec_of(ckpt, progress)
    name = model or progress.get("model")
    if not isinstance(name, str) or not name:
        raise SettingError(f"checkpoint {ckpt} does not name its model: pass model=")
    try:
        acting = normalize.Normalizing(policy.make_policy(name, spec, device=device))
    except ValueError as exc:  # ModelUnavailable among them
        raise SettingError(f"checkpoint {ckpt}: {exc}") from None
    weights = params | stats_of(ckpt, spec, progress).arrays()
    problem = acting.weights_problem(weights)
    if problem:
        raise SettingError(f"checkpoint {ckpt} does not fit model {name} on its spaces: "
                           f"{problem}")
    version = progress.get("version", 0)
    acting.load(weights, version if isinstance(version, int) else 0)
    return TrainedPolicy(acting, checkpoint=ckpt, run_dir=run_dir, config=config_of(run_dir),
                         model=name)


def locate(path: Path) -> tuple[Path, Path | None]:
    """(the checkpoint file, its run directory or None) of a path to either. Raises
    SettingError."""
    if path.is_dir():
        found = [path / name for name in checkpoint.FILE_NAMES if (path / name).is_file()]
        if not found:
            raise SettingError(f"{path} holds no checkpoint ({' or '.join(checkpoint.FILE_NAMES)})"
                               ": is it a run directory, and did its learner start?")
        return max(found, key=lambda f: f.stat().st_mtime), run_dir_of(path)
    if not path.exists():
        raise SettingError(f"{path}: no such run directory or checkpoint file")
    if path.suffix not in (".npz", ".safetensors"):
        raise SettingError(f"{path} is no checkpoint (.npz or .safetensors) nor a run directory")
    return path, run_dir_of(path.parent)


def run_dir_of(folder: Path) -> Path | None:
    """The run directory a checkpoint's folder is, or is a policy's folder in; None."""
    folder = folder.resolve()
    if (folder / CONFIG_FILE).is_file():
        return folder
    if folder.name.startswith(POLICY_DIR_PREFIX) and (folder.parent / CONFIG_FILE).is_file():
        return folder.parent
    return None


def read(ckpt: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(the model's weights as numpy arrays, the progress record). Raises SettingError."""
    try:
        if ckpt.suffix == ".safetensors":
            policy.require_torch("torch")
            tensors, _, progress = checkpoint.load_torch(ckpt)
            return {k: v.numpy() for k, v in tensors.items()}, progress
        params, _, progress = checkpoint.load(ckpt)
        return params, progress
    except (CannotStart, policy.ModelUnavailable) as exc:
        raise SettingError(str(exc).partition(": start a new run")[0]) from None


def spec_of(ckpt: Path, progress: Mapping[str, Any]) -> p.SpaceSpec:
    """The spaces the checkpoint was trained on. Raises SettingError."""
    saved = progress.get("spec")
    if not saved:
        raise SettingError(f"checkpoint {ckpt} does not hold its spaces (written before "
                           "checkpoints held them): train it again to load it")
    try:
        spec = p.from_map(p.SpaceSpec, saved)
    except p.ProtocolError as exc:
        raise SettingError(f"checkpoint {ckpt} holds spaces that cannot be used: "
                           f"{exc}"[:300]) from None
    problem = spaces.spec_problem(spec)
    if problem:
        raise SettingError(f"checkpoint {ckpt} holds spaces that cannot be used: {problem}")
    return spec


def stats_of(ckpt: Path, spec: p.SpaceSpec, progress: Mapping[str, Any]) -> normalize.Stats:
    """The observation statistics the checkpoint's version acts with (RAW: none). Raises
    SettingError."""
    saved = progress.get("obs_norm") or []
    if not saved:
        return normalize.RAW
    norm = normalize.Normalizer(spec)
    try:
        norm.restore(saved)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise SettingError(f"checkpoint {ckpt} holds observation statistics that cannot be "
                           f"used ({type(exc).__name__}: {exc})"[:300]) from None
    version = progress.get("version", 0)
    return norm.stats_for(version if isinstance(version, int) else 0)


def config_of(run_dir: Path | None) -> dict[str, Any]:
    """RUN_DIR/config.toml as a dict ({} without one). Raises SettingError."""
    if run_dir is None or not (run_dir / CONFIG_FILE).is_file():
        return {}
    try:
        return tomllib.loads((run_dir / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SettingError(f"{run_dir / CONFIG_FILE} cannot be read: {exc}") from None
