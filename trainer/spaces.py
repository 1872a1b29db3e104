"""The policy's view of the spaces a worker declared.

`action_space` and `obs_dim` take a `SpaceSpec`; a spec that still travels as a map (the
`spec` of WORKER_HELLO and ENV_SPEC) is read into one first, with the codec's own checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stepbus.bus import protocol as p

from stepbus import policy
from stepbus.policy import ActionSpace


def space_spec(spec: p.SpaceSpec | Mapping[str, Any]) -> p.SpaceSpec:
    """`spec` as a SpaceSpec. Raises ProtocolError for a map that is not one."""
    return spec if isinstance(spec, p.SpaceSpec) else p.from_map(p.SpaceSpec, spec)


def action_space(spec: p.SpaceSpec | Mapping[str, Any]) -> ActionSpace:
    return policy.action_space(space_spec(spec))


def obs_dim(spec: p.SpaceSpec | Mapping[str, Any]) -> int:
    return policy.obs_dim(space_spec(spec))
