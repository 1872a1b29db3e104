"""What the learner keeps of the trajectories it takes in: the batch the next update learns
from, and a digest of everything taken in, so two runs can be compared."""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from dataclasses import dataclass, field

import numpy as np

from stepbus.bus import protocol as p
from stepbus.trainer import ppo


@dataclass
class Batch:
    """The trajectories the next update learns from, in the order they were taken in."""

    trajectories: list[ppo.Trajectory] = field(default_factory=list)
    ids: list[tuple[str, int]] = field(default_factory=list)  # (assembler, seq) of each
    returns: list[float | None] = field(default_factory=list)  # of each episode that ended
    steps: int = 0

    def add(self, t: p.Trajectory, record: ppo.Trajectory) -> None:
        self.ids.append((t.assembler, t.seq))
        self.trajectories.append(record)
        self.returns.append(t.episode_return)
        self.steps += t.rewards.shape[0]


class RunDigest:
    """A running digest of every trajectory taken in, in arrival order: every field, arrays as
    dtype, shape and the CRC-32 of their bytes (5x faster than hashing them: observation frames
    run to hundreds of MB/s), so equal digests mean equal data up to a CRC collision; except
    the assembler's incarnation and numbering, which name the delivery, not the data (the
    incarnation is random)."""

    def __init__(self) -> None:
        self.hash = hashlib.blake2b(digest_size=8)

    def add(self, t: p.Trajectory) -> None:
        for f in dataclasses.fields(t):
            if f.name in ("assembler", "seq"):
                continue
            value = getattr(t, f.name)
            if isinstance(value, dict):  # observations as a map of leaves, each a frame
                for key, leaf in value.items():
                    self.add_array(f"{f.name}.{key}", leaf)
            elif isinstance(value, np.ndarray):
                self.add_array(f.name, value)
            else:
                self.hash.update(f"{f.name} {value!r}".encode())

    def add_array(self, name: str, value: np.ndarray) -> None:
        crc = zlib.crc32(np.ascontiguousarray(value).data)
        self.hash.update(f"{name} {value.dtype.str} {value.shape} {crc}".encode())

    def hexdigest(self) -> str:
        return self.hash.hexdigest()
