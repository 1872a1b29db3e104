"""Batches of observations, whichever form they take: one array (a Box observation space), or
a map of leaf key to array (any other space, `stepbus.spaces`), every leaf with one row per
env or agent. Everything that slices, joins or copies observation rows goes through here, so
no process needs to know which form a run's observations take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Obs = np.ndarray | dict[str, np.ndarray]


def _each(fn: Callable[[np.ndarray], np.ndarray], obs: Obs) -> Obs:
    return {k: fn(v) for k, v in obs.items()} if isinstance(obs, dict) else fn(obs)


def count(obs: Obs) -> int:
    """Rows in the batch (0 for an empty map)."""
    if isinstance(obs, dict):
        return len(next(iter(obs.values()))) if obs else 0
    return len(obs)


def take(obs: Obs, index: Any) -> Obs:
    """Rows `index` (an int, a slice or an index array) of every leaf."""
    return obs[index] if not isinstance(obs, dict) else {k: v[index] for k, v in obs.items()}


def copy(obs: Obs) -> Obs:
    return _each(np.copy, obs)


def concat(parts: Sequence[Obs]) -> Obs:
    """The rows of every part, in order; one part is returned as it is (no copy)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, dict):
        return {k: np.concatenate([p[k] for p in parts]) for k in first}
    return np.concatenate(parts)  # type: ignore[arg-type]


def stack(items: Sequence[Obs]) -> Obs:
    """Single rows (as `take(obs, i)` gives them) as one batch."""
    first = items[0]
    if isinstance(first, dict):
        return {k: np.stack([i[k] for i in items]) for k in first}
    return np.stack(items)  # type: ignore[arg-type]


def nbytes(obs: Obs) -> int:
    return sum(v.nbytes for v in obs.values()) if isinstance(obs, dict) else obs.nbytes


def layout(obs: Obs) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """Each leaf's key, dtype and row shape: batches with the same layout can be joined."""
    if isinstance(obs, dict):
        return tuple((k, v.dtype.str, v.shape[1:]) for k, v in obs.items())
    return (("", obs.dtype.str, obs.shape[1:]),)


def empty(like_row: Obs, rows: int) -> Obs:
    """An uninitialised batch of `rows` rows shaped like the single row `like_row`."""
    return _each(lambda v: np.empty((rows, *np.shape(v)), np.asarray(v).dtype), like_row)


def put(batch: Obs, i: int, row: Obs) -> None:
    """Row i of `batch` := `row` (a single row as `take(obs, i)` gives it)."""
    if isinstance(batch, dict):
        for k, v in batch.items():
            v[i] = row[k]
    else:
        batch[i] = row


def all_finite(obs: Obs) -> bool:
    """No NaN or infinity in any float leaf."""
    leaves = obs.values() if isinstance(obs, dict) else (obs,)
    return all(v.dtype.kind != "f" or bool(np.isfinite(v).all()) for v in leaves)


def empty_like(obs: Obs) -> Obs:
    return _each(np.empty_like, obs)


def zeros_like(obs: Obs) -> Obs:
    return _each(np.zeros_like, obs)


def layout_only(obs: Obs) -> bool:
    """Whether `obs` is a batch of no rows with at least one leaf: how a message names the
    layout of rows it does not carry (a slot of shared memory holds them)."""
    leaves = list(obs.values()) if isinstance(obs, dict) else [obs]
    return bool(leaves) and all(leaf.ndim >= 1 and leaf.shape[0] == 0 for leaf in leaves)


def zero(obs: Obs) -> None:
    """Every row of every leaf := 0, in place."""
    for leaf in obs.values() if isinstance(obs, dict) else (obs,):
        leaf.fill(0)
