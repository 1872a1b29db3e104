"""Every Gymnasium space, as it crosses the bus and as models see it.

A Box observation travels as one array, as it always has. Any other observation space
(Discrete, MultiDiscrete, MultiBinary, Tuple, Dict, nested) is cut into its leaves, and each leaf
travels as its own raw frame under a key (its path of Dict keys and Tuple indices joined by
"/", or "obs" for a space that is one leaf): nothing is flattened or one-hot encoded on the
wire, so a model gets exactly what the env gave. An action mask from ``info["action_mask"]``
(Gymnasium's convention) rides along as one more leaf, "action_mask"; a Dict observation may
hold one itself under that key (PettingZoo's convention). Either way, `mask` finds it.

Actions are Discrete, Box, MultiDiscrete or MultiBinary. Masks are for Discrete and
MultiDiscrete: one bool per category, each dimension's categories in turn (Gymnasium gives a
MultiDiscrete mask as a tuple of per-dimension arrays; it is concatenated here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from stepbus.bus import protocol as p
from stepbus.bus.rows import Obs

MASK = "action_mask"
ROOT = "obs"  # the key of an observation that is one leaf, when it travels in a map
CATEGORICAL = ("discrete", "multi_discrete", "multi_binary")
ACTION_KINDS = ("discrete", "box", *CATEGORICAL[1:])
MAX_NESTING = 32  # Dict and Tuple levels around a leaf: rebuilding the space recurses this deep
MAX_START = 1 << 62  # |start| of a category: start + count and value - start stay in int64


class SpaceError(TypeError):
    """A space stepbus cannot carry, with what to do about it."""


# ---------------------------------------------------------------------------------------------
# Describing spaces (the worker's hello)


def _leaf(space: gym.Space, path: list[str], containers: list[str]) -> p.LeafSpec:
    key = "/".join(path) or ROOT
    if isinstance(space, gym.spaces.Box):
        return p.LeafSpec(key, "box", list(space.shape), space.dtype.str, path, containers)
    if isinstance(space, gym.spaces.Discrete):
        return p.LeafSpec(key, "discrete", [], np.dtype(np.int64).str, path, containers,
                          nvec=[int(space.n)], start=[int(space.start)])
    if isinstance(space, gym.spaces.MultiDiscrete):
        start = np.broadcast_to(getattr(space, "start", 0), space.shape)
        return p.LeafSpec(key, "multi_discrete", list(space.shape), np.dtype(np.int64).str,
                          path, containers, nvec=[int(n) for n in space.nvec.ravel()],
                          start=[int(s) for s in np.ravel(start)])
    if isinstance(space, gym.spaces.MultiBinary):
        return p.LeafSpec(key, "multi_binary", list(space.shape), np.dtype(np.int8).str, path,
                          containers)
    raise SpaceError(f"observation leaf {key!r} is a {type(space).__name__}; stepbus carries "
                     "Box, Discrete, MultiDiscrete, MultiBinary, Tuple and Dict")


def leaves(space: gym.Space, path: list[str] | None = None,
           containers: list[str] | None = None) -> list[p.LeafSpec]:
    """The leaves of an observation space, depth first, Dict keys in the space's order."""
    path, containers = path or [], containers or []
    if isinstance(space, gym.spaces.Dict):
        subs = list(space.spaces.items())
        kind = "dict"
    elif isinstance(space, gym.spaces.Tuple):
        subs = [(str(i), s) for i, s in enumerate(space.spaces)]
        kind = "tuple"
    else:
        return [_leaf(space, path, containers)]
    if not subs:
        raise SpaceError(f"an empty {type(space).__name__} observation at {path or 'the root'}")
    out = []
    for key, sub in subs:
        if not isinstance(key, str) or not key or "/" in key or (key == MASK and path):
            raise SpaceError(f"Dict key {key!r} at {path or 'the root'}: keys must be non-empty "
                             f"strings without '/' ({MASK!r} only at the top)")
        out += leaves(sub, [*path, key], [*containers, kind])
    return out


def action_fields(act: gym.Space) -> dict[str, Any]:
    """The SpaceSpec fields of an action space. Raises SpaceError for one stepbus cannot take."""
    if isinstance(act, gym.spaces.Discrete):
        if act.start != 0:
            raise SpaceError(f"action space {act} starts at {act.start}; wrap the env so "
                             "actions start at 0")
        return {"action_kind": "discrete", "action_n": int(act.n)}
    if isinstance(act, gym.spaces.Box):
        return {"action_kind": "box", "action_shape": list(act.shape),
                "action_low": act.low.ravel().astype(float).tolist(),
                "action_high": act.high.ravel().astype(float).tolist()}
    if isinstance(act, gym.spaces.MultiDiscrete):
        if np.any(getattr(act, "start", 0)):
            raise SpaceError(f"action space {act} has a start; wrap the env so actions start "
                             "at 0")
        return {"action_kind": "multi_discrete", "action_shape": list(act.shape),
                "action_nvec": [int(n) for n in act.nvec.ravel()]}
    if isinstance(act, gym.spaces.MultiBinary):
        return {"action_kind": "multi_binary", "action_shape": [int(d) for d in act.shape],
                "action_nvec": [2] * math.prod(act.shape)}
    raise SpaceError(f"action space {act} is not Discrete, Box, MultiDiscrete or MultiBinary; "
                     "wrap the env (gymnasium.wrappers) to give one of these")


def describe(obs: gym.Space, act: gym.Space, *, info_mask: bool = False,
             reward_threshold: float | None = None, goal_note: str = "") -> p.SpaceSpec:
    """The spaces as a worker declares them. `info_mask`: the env gives `info["action_mask"]`.

    Raises:
        SpaceError: a space stepbus cannot carry, or a mask with Box actions.
    """
    fields = action_fields(act)
    found = leaves(obs)
    in_obs = any(leaf.key == MASK for leaf in found)
    if (info_mask or in_obs) and fields["action_kind"] not in ("discrete", "multi_discrete"):
        raise SpaceError(f"an action mask with {type(act).__name__} actions: masks are for "
                         "Discrete and MultiDiscrete actions")
    if info_mask and not in_obs:
        width = fields.get("action_n") or sum(fields["action_nvec"])
        found.append(p.LeafSpec(MASK, "mask", [width], np.dtype(bool).str))
    if isinstance(obs, gym.spaces.Box) and len(found) == 1:
        return p.SpaceSpec(list(obs.shape), obs.dtype.str, reward_threshold=reward_threshold,
                           goal_note=goal_note, **fields)
    return p.SpaceSpec([], "", obs_leaves=found, reward_threshold=reward_threshold,
                       goal_note=goal_note, **fields)


# ---------------------------------------------------------------------------------------------
# The spaces again, where models are built (broker, learner)


def _bounds(dtype: np.dtype) -> tuple[Any, Any]:
    if dtype.kind == "f":
        return -np.inf, np.inf
    if dtype.kind == "b":
        return 0, 1
    return np.iinfo(dtype).min, np.iinfo(dtype).max


def box(shape: Any, dtype: Any) -> gym.spaces.Box:
    """A Box of this shape and dtype over the dtype's whole range (bounds do not travel)."""
    dt = np.dtype(dtype)
    low, high = _bounds(dt)
    return gym.spaces.Box(low=low, high=high, shape=tuple(shape), dtype=dt)


def _leaf_space(leaf: p.LeafSpec) -> gym.Space:
    if leaf.kind == "discrete":
        return gym.spaces.Discrete(leaf.nvec[0], start=leaf.start[0])
    if leaf.kind == "multi_discrete":
        return gym.spaces.MultiDiscrete(np.reshape(leaf.nvec, leaf.shape),
                                        start=np.reshape(leaf.start, leaf.shape))
    if leaf.kind == "multi_binary":
        return _multi_binary(leaf.shape)
    return box(leaf.shape, leaf.dtype)


def _multi_binary(shape: list[int]) -> gym.spaces.MultiBinary:
    """As the env made it: MultiBinary(3) and MultiBinary((3,)) are not equal spaces."""
    return gym.spaces.MultiBinary(shape[0] if len(shape) == 1 else list(shape))


def _nest(found: list[p.LeafSpec], depth: int) -> gym.Space:
    if len(found) == 1 and len(found[0].path) == depth:
        return _leaf_space(found[0])
    groups: dict[str, list[p.LeafSpec]] = {}
    for leaf in found:
        groups.setdefault(leaf.path[depth], []).append(leaf)
    subs = {key: _nest(group, depth + 1) for key, group in groups.items()}
    if found[0].containers[depth] == "tuple":
        return gym.spaces.Tuple([subs[str(i)] for i in range(len(subs))])
    return gym.spaces.Dict(subs)


def observation_space(spec: p.SpaceSpec) -> gym.Space:
    """The env's observation space as the worker declared it (Box bounds aside); an action
    mask from `info` is not part of it."""
    if not spec.obs_leaves:
        return box(spec.obs_shape, spec.obs_dtype)
    return _nest([leaf for leaf in spec.obs_leaves if leaf.kind != "mask"], 0)


def action_space(spec: p.SpaceSpec) -> gym.Space:
    shape = tuple(spec.action_shape)
    if spec.action_kind == "discrete":
        return gym.spaces.Discrete(spec.action_n)
    if spec.action_kind == "multi_discrete":
        return gym.spaces.MultiDiscrete(np.reshape(spec.action_nvec, shape))
    if spec.action_kind == "multi_binary":
        return _multi_binary(spec.action_shape)
    return gym.spaces.Box(low=np.asarray(spec.action_low, np.float32).reshape(shape),
                          high=np.asarray(spec.action_high, np.float32).reshape(shape),
                          dtype=np.float32)


def row_layout(spec: p.SpaceSpec) -> dict[str, tuple[tuple[int, ...], np.dtype]] | None:
    """Each leaf's row shape and dtype as they travel; None for a single Box (one array)."""
    if not spec.obs_leaves:
        return None
    return {leaf.key: (tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in spec.obs_leaves}


def zeros(spec: p.SpaceSpec, n: int) -> Obs:
    """A batch of `n` zero observations (the lowest category of categorical leaves)."""
    layout = row_layout(spec)
    if layout is None:
        return np.zeros((n, *spec.obs_shape), np.dtype(spec.obs_dtype))
    out: dict[str, np.ndarray] = {key: np.zeros((n, *shape), dtype)
                                  for key, (shape, dtype) in layout.items()}
    for leaf in spec.obs_leaves:
        if leaf.start:
            out[leaf.key][...] = np.reshape(leaf.start, leaf.shape)
        if leaf.kind == "mask":
            out[leaf.key][...] = True
    return out


def obs_problem(obs: Obs, spec: p.SpaceSpec, lead: tuple[int, ...]) -> str:
    """Why `obs` is not a batch (leading dims `lead`) of these spaces' observations ("" if it
    is): the same leaves, each of the declared shape and dtype."""
    layout = row_layout(spec)
    if layout is None:
        want = (*lead, *spec.obs_shape)
        if isinstance(obs, dict) or obs.shape != want:
            return f"obs {_shape_of(obs)}, expected {want}"
        if obs.dtype != np.dtype(spec.obs_dtype):
            return f"obs of {obs.dtype}, expected {np.dtype(spec.obs_dtype)}"
        return ""
    if not isinstance(obs, dict) or obs.keys() != layout.keys():
        return f"obs leaves {_shape_of(obs)}, expected {sorted(layout)}"[:200]
    for key, (shape, dtype) in layout.items():
        if obs[key].shape != (*lead, *shape) or obs[key].dtype != dtype:
            return (f"obs leaf {key!r}: {obs[key].dtype} {obs[key].shape}, expected {dtype} "
                    f"{(*lead, *shape)}")[:200]
    return ""


def _shape_of(obs: Obs) -> str:
    return str(sorted(obs)) if isinstance(obs, dict) else str(obs.shape)


# ---------------------------------------------------------------------------------------------
# What models take: a flat vector (the numpy MLP), the structure (torch), the mask


def flat_dim(spec: p.SpaceSpec) -> int:
    """Width of `flatten`'s rows: Box leaves flattened, categorical ones one-hot."""
    if not spec.obs_leaves:
        return math.prod(spec.obs_shape)
    return sum(_flat_width(leaf) for leaf in spec.obs_leaves if leaf.key != MASK)


def _flat_width(leaf: p.LeafSpec) -> int:
    return sum(leaf.nvec) if leaf.kind in ("discrete", "multi_discrete") else math.prod(leaf.shape)


def _one_hot(values: np.ndarray, leaf: p.LeafSpec, dtype: type) -> np.ndarray:
    b = values.shape[0]
    codes = values.reshape(b, -1).astype(np.int64) - np.asarray(leaf.start, np.int64)
    out: np.ndarray = np.zeros((b, sum(leaf.nvec)), dtype)
    offsets = np.concatenate([[0], np.cumsum(leaf.nvec)[:-1]]).astype(np.int64)
    valid = (codes >= 0) & (codes < np.asarray(leaf.nvec))  # out of range: all zeros
    rows = np.broadcast_to(np.arange(b)[:, None], codes.shape)
    out[rows[valid], (codes + offsets)[valid]] = 1
    return out


def flatten(spec: p.SpaceSpec, obs: Obs, dtype: type = np.float64) -> np.ndarray:
    """A batch as (B, flat_dim) numbers for a model on vectors; the mask leaf is left out."""
    if not isinstance(obs, dict):
        obs = np.asarray(obs)
        return obs.reshape(obs.shape[0], -1).astype(dtype, copy=False)
    parts = []
    for leaf in spec.obs_leaves:
        if leaf.key == MASK:
            continue
        value = obs[leaf.key]
        if leaf.kind in ("discrete", "multi_discrete"):
            parts.append(_one_hot(value, leaf, dtype))
        else:
            parts.append(value.reshape(value.shape[0], -1).astype(dtype, copy=False))
    return np.concatenate(parts, axis=1)


def mask(spec: p.SpaceSpec, obs: Obs) -> np.ndarray | None:
    """The batch's action mask, (B, categories) bool, or None when the env gives none. A row
    that rules out every action of a dimension is taken as no mask for it."""
    if not isinstance(obs, dict) or MASK not in obs:
        return None
    allowed = np.asarray(obs[MASK]).reshape(len(obs[MASK]), -1) != 0
    nvec = spec.action_nvec or [spec.action_n]
    if allowed.shape[1] != sum(nvec):
        return None  # checked at the hello; never acted on
    start = 0
    for n in nvec:
        part = allowed[:, start:start + n]
        part[~part.any(axis=1)] = True
        start += n
    return allowed


def structured(spec: p.SpaceSpec, obs: Obs | Mapping[str, Any]) -> Any:
    """A batch nested as the env's own space: arrays in Dicts (dict) and Tuples (tuple), the
    mask from `info` left out. What a model factory's module gets, as tensors."""
    if not isinstance(obs, Mapping):
        return obs
    found = [leaf for leaf in spec.obs_leaves if leaf.kind != "mask"]
    return _nest_values(found, obs, 0)


def _nest_values(found: list[p.LeafSpec], obs: Mapping[str, Any], depth: int) -> Any:
    if len(found) == 1 and len(found[0].path) == depth:
        return obs[found[0].key]
    groups: dict[str, list[p.LeafSpec]] = {}
    for leaf in found:
        groups.setdefault(leaf.path[depth], []).append(leaf)
    subs = {key: _nest_values(group, obs, depth + 1) for key, group in groups.items()}
    if found[0].containers[depth] == "tuple":
        return tuple(subs[str(i)] for i in range(len(subs)))
    return subs


def spec_problem(spec: p.SpaceSpec) -> str:
    """Why declared leaves cannot be used ("" if they can): keys unique and in their form,
    shapes, dtypes and categories sane, and a mask as wide as the categorical actions."""
    keys = [leaf.key for leaf in spec.obs_leaves]
    if len(set(keys)) != len(keys) or len(keys) > p.MAX_ARRAYS // 4:
        return f"{len(keys)} observation leaves, keys {keys[:4]}"[:200]
    for leaf in spec.obs_leaves:
        problem = _leaf_problem(leaf)
        if problem:
            return f"observation leaf {leaf.key!r}: {problem}"[:200]
    try:
        observation_space(spec)
    except (KeyError, IndexError, ValueError, TypeError, AssertionError, ArithmeticError,
            RecursionError) as exc:
        return f"observation leaves do not nest: {type(exc).__name__}: {exc}"[:200]
    if MASK in keys:
        width = spec.action_n if spec.action_kind == "discrete" else sum(spec.action_nvec)
        leaf = spec.obs_leaves[keys.index(MASK)]
        if spec.action_kind not in CATEGORICAL or math.prod(leaf.shape) != width:
            return f"an action mask of shape {leaf.shape} for {spec.action_kind} actions"
    return ""


def _leaf_problem(leaf: p.LeafSpec) -> str:
    """What a worker's own `describe` could not have made of a leaf ("" if it could)."""
    if leaf.dtype not in p.ALLOWED_DTYPES or len(leaf.shape) >= p.MAX_NDIM:
        return f"{leaf.dtype} {leaf.shape}"
    if not all(d > 0 for d in leaf.shape) or len(leaf.path) != len(leaf.containers):
        return f"shape {leaf.shape}, path {leaf.path}"
    if len(leaf.path) > MAX_NESTING:
        return f"nested {len(leaf.path)} deep, over {MAX_NESTING}"
    if leaf.kind == "mask" and (leaf.key != MASK or leaf.path or leaf.dtype != "|b1"):
        return f"a mask leaf {leaf.key!r} at {leaf.path[:4]} of {leaf.dtype}"
    if leaf.key != ("/".join(leaf.path) or ROOT) and leaf.kind != "mask":
        return f"key {leaf.key!r} for path {leaf.path}"
    if not set(leaf.containers) <= {"dict", "tuple"}:
        return f"containers {leaf.containers}"
    if leaf.kind in ("discrete", "multi_discrete"):
        return _categories_problem(leaf)
    if leaf.kind not in ("box", "multi_binary", "mask"):
        return f"kind {leaf.kind!r}"
    if leaf.nvec or leaf.start:
        return f"category counts or starts for a {leaf.kind} leaf"
    return ""


def _categories_problem(leaf: p.LeafSpec) -> str:
    """A Discrete (shape []) or MultiDiscrete leaf: integers, one count and start per value."""
    if leaf.kind == "discrete" and leaf.shape:
        return f"a discrete leaf of shape {leaf.shape}"
    categories = math.prod(leaf.shape)
    if len(leaf.nvec) != categories or len(leaf.start) != categories:
        return f"{len(leaf.nvec)} category counts for {categories} values"
    if not all(1 <= n <= 1 << 20 for n in leaf.nvec) or sum(leaf.nvec) > 1 << 20:
        return f"category counts {leaf.nvec[:4]}"
    if not all(-MAX_START <= s <= MAX_START for s in leaf.start):
        return f"category starts {leaf.start[:4]}"
    if np.dtype(leaf.dtype).kind not in "iu":
        return f"categories of dtype {leaf.dtype}"
    return ""


# ---------------------------------------------------------------------------------------------
# Writing an env's observations into a batch (the worker)


class RowWriter:
    """Puts one env's (or agent's) observation, and the action mask its `info` gives, into a
    row of a batch laid out as `spec` says. A Box observation is one assignment."""

    def __init__(self, spec: p.SpaceSpec) -> None:
        self.plain = not spec.obs_leaves
        self.leaves = [(leaf.key, leaf.kind == "mask",
                        [int(k) if c == "tuple" else k for c, k in zip(leaf.containers,
                                                                       leaf.path, strict=True)])
                       for leaf in spec.obs_leaves]

    def __call__(self, batch: Obs, i: int, obs: Any, info: Mapping[str, Any] | None) -> None:
        if isinstance(batch, np.ndarray):
            batch[i] = obs
            return
        for key, from_info, path in self.leaves:
            if from_info:
                batch[key][i] = True if not info or MASK not in info else flat_mask(info[MASK])
                continue
            value = obs
            for step in path:
                value = value[step]
            batch[key][i] = value

    def row(self, obs: Any, info: Mapping[str, Any] | None, like: Obs) -> Obs:
        """One observation as a single row shaped like row 0 of the batch `like`."""
        one = {k: np.empty_like(v[:1]) for k, v in like.items()} if isinstance(like, dict) \
            else np.empty_like(like[:1])
        self(one, 0, obs, info)
        return {k: v[0] for k, v in one.items()} if isinstance(one, dict) else one[0]


def flat_mask(value: Any) -> np.ndarray:
    """A mask as Gymnasium gives it (an array; for MultiDiscrete a tuple of each dimension's
    arrays, nested as the space's nvec for more than one axis) as one flat array."""
    if isinstance(value, tuple | list):
        return np.concatenate([flat_mask(v) for v in value])
    return np.ravel(value)


def actions_problem(spec: p.SpaceSpec, actions: np.ndarray, n: int) -> str:
    """Why `actions` are not `n` actions of these spaces ("" if they are)."""
    kind = spec.action_kind
    if kind == "box":
        want = (n, *spec.action_shape)
        if actions.shape != want or actions.dtype.kind != "f":
            return f"expected float actions of shape {want}, got {actions.dtype} {actions.shape}"
        return ""
    want = (n,) if kind == "discrete" else (n, *spec.action_shape)
    if actions.shape != want or actions.dtype.kind not in "iu":
        return f"expected integer actions of shape {want}, got {actions.dtype} {actions.shape}"
    if not actions.size:
        return ""
    high = (spec.action_n if kind == "discrete"
            else np.reshape(spec.action_nvec, spec.action_shape))
    # Signed as unsigned of the same width: a negative action becomes one of at least 2**(bits
    # - 1), above every action the signed type holds, so one comparison checks both bounds
    # (two reductions cost more than a small batch's step).
    unsigned = actions
    if actions.dtype.kind == "i":
        unsigned = actions.view(f"u{actions.itemsize}")
        if actions.itemsize < 8:
            high = np.minimum(high, 1 << (8 * actions.itemsize - 1))
    if np.count_nonzero(unsigned >= high):
        return f"actions outside [0, {spec.action_n if kind == 'discrete' else 'nvec'})"
    return ""
