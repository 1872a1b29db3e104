"""The policy's view of the spaces a worker declared (a `SpaceSpec` map off the wire)."""

from __future__ import annotations

import math
from typing import Any

from stepbus.trainer.model import ActionSpace


def action_space(spec: dict[str, Any]) -> ActionSpace:
    if spec["action_kind"] == "discrete":
        return ActionSpace("discrete", n=int(spec["action_n"]))
    return ActionSpace("box", shape=tuple(spec["action_shape"]), low=tuple(spec["action_low"]),
                       high=tuple(spec["action_high"]))


def obs_dim(spec: dict[str, Any]) -> int:
    return math.prod(spec["obs_shape"])
