"""A vector env's `call`, `get_attr` and `set_attr` as data, and a worker's answer to them.

Nothing is pickled, ever: arguments and results travel as JSON (None, bool, int, float, str,
lists, maps with str keys, nested at most MAX_DEPTH deep) and numeric or bool numpy arrays,
each array in the message's array map with {"__ndarray__": key} in its place. Tuples arrive
as lists and numpy scalars as Python numbers. Anything else is a `NotData` TypeError on the
side that has it, said in one line, before anything is sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stepbus.bus import protocol as p

ARRAY_KEY = "__ndarray__"
MAX_DEPTH = 3  # containers within a value: the codec's bound, with room for its list
NOT_DATA = "NotData"  # the error type of a result that is not data


class NotData(TypeError):
    """A value that cannot cross the bus: only JSON and numeric arrays do (no pickle)."""


def to_data(value: Any, arrays: dict[str, np.ndarray], depth: int = 0) -> Any:
    """`value` as it travels; its arrays added to `arrays`.

    Raises:
        NotData: for anything but JSON data and numeric or bool arrays.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic) and value.dtype.str in p.ALLOWED_DTYPES:
        return value.item()
    if isinstance(value, np.ndarray) and value.dtype.str in p.ALLOWED_DTYPES:
        key = f"a{len(arrays)}"
        arrays[key] = np.asarray(value, order="C")  # a 0-d array stays 0-d
        return {ARRAY_KEY: key}
    if depth >= MAX_DEPTH:
        raise NotData(f"values nest at most {MAX_DEPTH} containers deep on the bus")
    if isinstance(value, (list, tuple)):
        return [to_data(v, arrays, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: to_data(v, arrays, depth + 1) for k, v in value.items()}
    raise NotData(f"a {type(value).__name__} cannot cross the bus: values must be JSON data "
                  "or numeric numpy arrays (stepbus pickles nothing)")


def from_data(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """The value `to_data` encoded (arrays as writable copies)."""
    if isinstance(value, list):
        return [from_data(v, arrays) for v in value]
    if isinstance(value, dict):
        if value.keys() == {ARRAY_KEY} and isinstance(value[ARRAY_KEY], str):
            return np.array(arrays[value[ARRAY_KEY]])
        return {k: from_data(v, arrays) for k, v in value.items()}
    return value


def answer(envs: list[Any], msg: p.EnvCall, worker: str) -> p.EnvCallResult:
    """Do an ENV_CALL on each env, as SyncVectorEnv's call/get_attr/set_attr do; an error
    (the env's, or a result that is not data) comes back as `error`."""
    try:
        values = _do(envs, msg)
        arrays: dict[str, np.ndarray] = {}
        data = [to_data(v, arrays) for v in values]
    except NotData as exc:
        return p.EnvCallResult(worker=worker, call_id=msg.call_id, values=[],
                               error=f"{NOT_DATA}: {exc}")
    except Exception as exc:
        return p.EnvCallResult(worker=worker, call_id=msg.call_id, values=[],
                               error=f"{type(exc).__name__}: {exc}"[:p.MAX_ERROR_TEXT])
    return p.EnvCallResult(worker=worker, call_id=msg.call_id, values=data, error="",
                           arrays=arrays)


def _do(envs: list[Any], msg: p.EnvCall) -> list[Any]:
    args = from_data(msg.args, msg.arrays)
    kwargs = from_data(msg.kwargs, msg.arrays)
    if msg.op == "set_attr":
        values = from_data(msg.values, msg.arrays)
        if len(values) != len(envs):
            raise ValueError(f"{len(values)} values for {len(envs)} envs")
        for env, value in zip(envs, values, strict=True):
            env.set_wrapper_attr(msg.name, value)
        return [None] * len(envs)
    if msg.op not in ("call", "get_attr"):
        raise ValueError(f"unknown op {msg.op[:20]!r}")
    results = []
    for env in envs:
        found = env.get_wrapper_attr(msg.name)
        results.append(found(*args, **kwargs) if callable(found) else found)
    return results
