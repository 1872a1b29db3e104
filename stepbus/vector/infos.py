"""The envs' infos as a vector env hands them over: Gymnasium's vector layout (per key an
array over the batch's envs and a `_key` bool mask, nested dicts as nested layouts), built as
SyncVectorEnv builds it, from the per-env infos the workers sent (stepbus.workers.infos)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stepbus.bus import protocol as p
from stepbus.workers import infos as wire

LOG = logging.getLogger("stepbus.vector")


@dataclass
class EnvInfos:
    """The last batch's infos per env, in batch order: `rows` each env's info (None: none),
    `finals` the info its episode ended with (None: it did not end within the step)."""

    rows: list[dict[str, Any] | None] = field(default_factory=list)
    finals: list[dict[str, Any] | None] = field(default_factory=list)


class InfoDecoder:
    """Per-env infos out of STEP_RESULTs; one that does not decode is logged and counted and
    reads as no info (the worker's bytes are untrusted)."""

    def __init__(self) -> None:
        self.refused = 0

    def env_infos(self, results: Sequence[p.StepResult]) -> EnvInfos:
        out = EnvInfos()
        for r in results:
            rows, finals = self.decode(r)
            ended = np.flatnonzero(r.terminated | r.truncated)
            out.rows += rows
            row_finals: list[dict[str, Any] | None] = [None] * len(rows)
            for j, i in enumerate(ended):
                row_finals[i] = finals[j] if j < len(finals) else {}
            out.finals += row_finals
        return out

    def decode(self, r: p.StepResult) -> tuple[list[dict[str, Any] | None], list[dict[str, Any]]]:
        n = len(r.reward)
        if not r.infos and not r.final_infos:  # a worker sends none when no row has one
            return [None] * n, []
        try:
            rows = [None if i is None else _info(wire.decode(i, r.info_arrays)) for i in r.infos]
            finals = [_info(wire.decode(i, r.info_arrays)) for i in r.final_infos]
        except (ValueError, TypeError) as exc:
            self.refused += 1
            LOG.warning("infos from worker %s refused (%s); read as none", r.worker[:64], exc)
            return [None] * n, []
        return (rows or [None] * n), finals


def _info(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"an env's info must be a map, got {type(value).__name__}")
    return value


def layout(infos: EnvInfos, final_obs: Sequence[Any] | None) -> dict[str, Any]:
    """Gymnasium's vector info of one batch; with `final_obs` (SAME_STEP: each env's final
    observation, None where nothing ended) the `final_obs`/`final_info` entries first, as
    SyncVectorEnv adds them."""
    n = len(infos.rows)
    out: dict[str, Any] = {}
    if final_obs is None and not any(infos.rows):
        return out
    for i in range(n):
        final = infos.finals[i] if final_obs is not None and i < len(infos.finals) else None
        if final is not None and final_obs is not None:
            out = add_info(out, {"final_obs": final_obs[i], "final_info": final}, i, n)
        row = infos.rows[i]
        if row is not None:
            out = add_info(out, row, i, n)
    return out


def add_info(vector_infos: dict[str, Any], env_info: dict[str, Any], i: int, n: int
             ) -> dict[str, Any]:
    """Gymnasium's `VectorEnv._add_info` for a batch of `n` envs (a `recv` returns fewer
    than num_envs), the same arrays and masks for the same values."""
    for key, value in env_info.items():
        if key == "final_obs":
            array = vector_infos.get(key, np.full(n, None, dtype=object))
            array[i] = value
        elif isinstance(value, dict):
            array = add_info(vector_infos.get(key, {}), value, i, n)
        else:
            array = vector_infos[key] if key in vector_infos else _empty(value, n)
            array[i] = value
        mask = vector_infos.get(f"_{key}", np.zeros(n, dtype=np.bool_))
        mask[i] = True
        vector_infos[key], vector_infos[f"_{key}"] = array, mask
    return vector_infos


def _empty(value: Any, n: int) -> np.ndarray:
    if type(value) in (int, float, bool) or issubclass(type(value), np.number):
        return np.zeros(n, dtype=type(value))
    if isinstance(value, np.ndarray):
        return np.zeros((n, *value.shape), dtype=value.dtype)
    return np.full(n, None, dtype=object)
