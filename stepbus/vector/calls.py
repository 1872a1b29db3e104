"""The vector env's side of `call`/`get_attr`/`set_attr`: one call out to every worker at a
time, its answers gathered in env id order (the encoding is `stepbus.workers.calls`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from stepbus.bus import protocol as p
from stepbus.workers.calls import NOT_DATA, from_data, to_data


class Calls:
    """The call in flight: who has yet to answer, and what each answered."""

    def __init__(self) -> None:
        self.call_id = 0
        self.waiting: set[str] = set()
        self.got: dict[str, list[Any]] = {}
        self.error: tuple[str, str] | None = None  # (worker, "Type: message") of a failure

    def ask(self, worker: str, op: str, name: str, args: list[Any], kwargs: dict[str, Any],
            values: list[Any]) -> p.EnvCall:
        """The message for one worker (the first of a call starts a new one).

        Raises:
            TypeError: an argument that is not data (`stepbus.workers.calls.NotData`).
        """
        if not self.waiting:
            self.call_id += 1
            self.got, self.error = {}, None
        arrays: dict[str, np.ndarray] = {}
        try:
            msg = p.EnvCall(worker=worker, call_id=self.call_id, op=op, name=name,
                            args=to_data(args, arrays), kwargs=to_data(kwargs, arrays),
                            values=to_data(values, arrays), arrays=arrays)
        except TypeError:
            self.waiting.clear()  # nothing of this call is sent
            raise
        self.waiting.add(worker)
        return msg

    def took(self, msg: p.EnvCallResult) -> None:
        if msg.call_id != self.call_id or msg.worker not in self.waiting:
            return
        self.waiting.discard(msg.worker)
        if msg.error:
            self.error = self.error or (msg.worker, msg.error)
        else:
            self.got[msg.worker] = from_data(msg.values, msg.arrays)

    def complete(self) -> bool:
        return not self.waiting

    def results(self, order: list[str]) -> tuple[Any, ...]:
        """Every env's result in env id order.

        Raises:
            TypeError: a result that is not data.
            RemoteFailure: the env raised (its type and message kept).
        """
        if self.error is not None:
            worker, error = self.error
            kind, _, message = error.partition(": ")
            if kind == NOT_DATA:
                raise TypeError(f"worker {worker}: {message}")
            raise p.RemoteFailure(worker, kind, message)
        return tuple(v for name in order for v in self.got[name])
