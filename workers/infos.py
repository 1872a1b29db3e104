"""Env infos on the bus, for a vector env client that asked for them (RESET's `infos`).

Nothing is pickled: an info travels as JSON (None, bool, int, float, str, lists, str-keyed
maps) with numeric or bool numpy arrays as frames (`{"__ndarray__": key}` in their place, as
`calls` carries them) and numpy scalars as `{"__npscalar__": [dtype, value]}`, so their dtype
survives and Gymnasium's vector layout comes out as SyncVectorEnv's. A key whose value cannot
travel is left out, named once in the worker's log and counted, never dropped silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stepbus.bus import protocol as p
from stepbus.workers.calls import ARRAY_KEY, NotData, from_data, to_data

SCALAR_KEY = "__npscalar__"
MAX_TEXT = 1024  # a longer string in an info cannot travel (headers are bounded)
MAX_ARRAYS = 64  # arrays of one step's infos, within the codec's frames per message
MAX_VALUES = 1024  # values of one step's infos, within the codec's containers per header
MAX_INT = 2**64  # msgpack's integers


@dataclass
class StepInfos:
    """One batch's infos as the envs gave them: per row (None: no info, a row not reset)
    and per ended row, in the order of `final_obs` (SAME_STEP's final infos)."""

    rows: list[dict[str, Any] | None]
    finals: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Budget:
    """What one message's infos may still hold."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    values: int = 0


class InfoEncoder:
    """Encodes infos for the wire; names each key that cannot travel once and counts them."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.named: set[str] = set()
        self.dropped = 0  # values left out (figure `info_values_dropped`)

    def fields(self, infos: StepInfos) -> dict[str, Any]:
        """StepResult's `infos`, `final_infos` and `info_arrays` for `infos` (none at all
        when every row's is empty and there are no final infos: the common step costs nothing
        here)."""
        if not infos.finals and not any(infos.rows):
            return {"infos": [], "final_infos": [], "info_arrays": {}}
        budget = Budget()
        rows = [None if i is None else self.encode(i, budget, "") for i in infos.rows]
        finals = [self.encode(i, budget, "") for i in infos.finals]
        return {"infos": rows, "final_infos": finals, "info_arrays": budget.arrays}

    def encode(self, info: dict[str, Any], budget: Budget, path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in info.items():
            name = f"{path}{key}"
            if not isinstance(key, str):
                self.drop(repr(key)[:80], "its key is not a str")
            elif isinstance(value, dict) and path.count(".") < 2:
                out[key] = self.encode(value, budget, f"{name}.")
            else:
                try:
                    out[key] = _value(value, budget)
                except NotData as exc:
                    self.drop(name, str(exc))
        return out

    def drop(self, name: str, why: str) -> None:
        self.dropped += 1
        if name not in self.named:
            self.named.add(name)
            self.log.warning("info key %r cannot travel to the vector env (%s): left out of "
                             "every step's infos", name, why)


def _value(value: Any, budget: Budget) -> Any:
    """One info value as it travels.

    Raises:
        NotData: a value msgpack and raw arrays cannot carry, or over the message's budget.
    """
    budget.values += 1
    if budget.values > MAX_VALUES:
        raise NotData(f"over {MAX_VALUES} values in one step's infos")
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise NotData(f"a str over {MAX_TEXT} characters")
    if isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT < value < MAX_INT:
        raise NotData("an int over 64 bits")
    if isinstance(value, np.generic) and value.dtype.str in p.ALLOWED_DTYPES:
        return {SCALAR_KEY: [value.dtype.str, value.item()]}
    if isinstance(value, np.ndarray) and len(budget.arrays) >= MAX_ARRAYS:
        raise NotData(f"over {MAX_ARRAYS} arrays in one step's infos")
    return to_data(value, budget.arrays, depth=1)  # arrays of a dtype the bus carries only


def decode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """An info as `InfoEncoder` encoded it (arrays as writable copies).

    Raises:
        ValueError: a reference to no array, or a scalar of a dtype not allowed.
    """
    if isinstance(value, list):
        return [decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {SCALAR_KEY}:
        dtype, item = _scalar(value[SCALAR_KEY])
        return np.dtype(dtype).type(item)
    if value.keys() == {ARRAY_KEY}:
        if value[ARRAY_KEY] not in arrays:
            raise ValueError(f"an info names array {str(value[ARRAY_KEY])[:40]!r}, not sent")
        return from_data(value, arrays)
    return {k: decode(v, arrays) for k, v in value.items()}


def _scalar(pair: Any) -> tuple[str, Any]:
    if (not isinstance(pair, list) or len(pair) != 2 or pair[0] not in p.ALLOWED_DTYPES
            or type(pair[1]) not in (bool, int, float)):
        raise ValueError(f"a numpy scalar must be [allowed dtype, number], got {str(pair)[:60]}")
    return pair[0], pair[1]
