"""The chaos soak's own ledger (benchmarks/chaos.py), independent of stepbus's counters.

`make` is a CartPole-v1 whose observations carry six more numbers: a stream id (random per env
instance, so a restarted worker or a recreated env starts new streams), the step's index in
its stream (the number of `step` calls before this observation, so the observation an action
is taken in names that step, and consecutive trajectories of a stream meet without a hole),
and the wall time in ms. Each is a 48-bit integer split into two 24-bit halves, each sent as
k * 2**-24: exact in float32 and below 1, so the MLP sees small inputs. With CHAOS_LEDGER_DIR
set, every env instance also keeps its stream's step count in a 16-byte file there (mmap,
written at each step, so it survives a SIGKILL): what was produced.

`LedgerPPO` is the numpy PPO that records, for every trajectory it learns from, (stream, first
step, last step, their times), and keeps the record in `optimizer_state()`, so a checkpoint
holds exactly what the learning it holds learned from, and a successor resumes it with the
weights. Rows of a stream that meet end to start are merged: an hour is a few thousand rows.

`LedgerConsume` keeps the same record and learns nothing (trainer/consume.py's ConsumeOnly), for
a harness measuring throughput that must not be bounded by PPO's updates (bad_network.py).

`account` is the harness's arithmetic on that record: per stream, steps learned once, learned
twice, never learned (holes before the last learned step) and the tail after it.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from stepbus.policy import ActionSpace
from stepbus.trainer.algorithm import PPOConfig, Trajectory
from stepbus.trainer.consume import ConsumeOnly
from stepbus.trainer.ppo import PPO

DIR_ENV = "CHAOS_LEDGER_DIR"  # where each env instance keeps its stream's step count
HALF_BITS = 24
HALF = 1 << HALF_BITS
UNIT = 2.0 ** -HALF_BITS
COLUMNS = 6  # stream, step index, time in ms: two halves each
ROW_FIELDS = ("stream", "first", "last", "first_ms", "last_ms")
STATE_KEY = "ledger/rows"  # in optimizer_state(), so in the checkpoint
COUNT_KEY = "ledger/trajectories"


def split(values: Sequence[int]) -> np.ndarray:
    """48-bit integers as float32 (hi, lo) pairs, each k * 2**-24: exact."""
    out = []
    for value in values:
        out += [(value >> HALF_BITS) % HALF * UNIT, value % HALF * UNIT]
    return np.array(out, np.float32)


def joined(columns: np.ndarray) -> np.ndarray:
    """The integers `split` made, from its columns (..., 2 * n) -> (..., n) int64."""
    k = np.rint(np.asarray(columns, np.float64) / UNIT).astype(np.int64)
    return k[..., 0::2] * HALF + k[..., 1::2]


class LedgerEnv(gym.Wrapper):
    """The wrapped env's observation plus the ledger's columns (see the module docstring)."""

    def __init__(self, env: gym.Env, record_dir: str | None) -> None:
        super().__init__(env)
        inner = env.observation_space
        assert isinstance(inner, gym.spaces.Box)
        self.observation_space = gym.spaces.Box(
            np.concatenate([inner.low, np.zeros(COLUMNS, np.float32)]),
            np.concatenate([inner.high, np.ones(COLUMNS, np.float32)]), dtype=np.float32)
        self.stream = int.from_bytes(os.urandom(6), "little")
        self.steps = 0
        self.count: mmap.mmap | None = None
        if record_dir:
            path = Path(record_dir) / f"{self.stream:012x}"
            with open(path, "w+b") as f:
                f.truncate(16)
                self.count = mmap.mmap(f.fileno(), 16)

    def observe(self, obs: np.ndarray) -> np.ndarray:
        ms = int(time.time() * 1000)
        if self.count is not None:
            self.count[:] = np.array([self.steps, ms], np.int64).tobytes()
        tags = split([self.stream, self.steps, ms])
        return np.concatenate([np.asarray(obs, np.float32), tags])

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict]:
        obs, info = self.env.reset(**kwargs)
        return self.observe(obs), info

    def step(self, action: Any) -> tuple[np.ndarray, Any, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        return self.observe(obs), reward, terminated, truncated, info


def make() -> gym.Env:
    """`--env benchmarks.chaos_ledger:make`."""
    return LedgerEnv(gym.make("CartPole-v1"), os.environ.get(DIR_ENV))


def produced(record_dir: Path) -> dict[int, tuple[int, int]]:
    """{stream: (steps taken, ms of the last)} from the env instances' count files."""
    out = {}
    for path in record_dir.iterdir():
        data = path.read_bytes()
        if len(data) == 16:
            steps, ms = np.frombuffer(data, np.int64)
            out[int(path.name, 16)] = (int(steps), int(ms))
    return out


@dataclass
class Ledger:
    """Rows (stream, first, last, first_ms, last_ms) of learned steps; a row is extended when
    the next trajectory of its stream starts right after it, else a new row begins (so an
    overlap, learning twice, stays visible)."""

    rows: list[list[int]] = field(default_factory=list)
    trajectories: int = 0
    ends: dict[int, int] = field(default_factory=dict)  # stream -> its row with the latest end

    def add(self, stream: int, first: int, last: int, first_ms: int, last_ms: int) -> None:
        self.trajectories += 1
        at = self.ends.get(stream)
        if at is not None and self.rows[at][2] + 1 == first:
            self.rows[at][2], self.rows[at][4] = last, last_ms
            return
        self.rows.append([stream, first, last, first_ms, last_ms])
        if at is None or self.rows[at][2] < last:
            self.ends[stream] = len(self.rows) - 1

    def add_trajectory(self, t: Trajectory) -> None:
        obs = np.asarray(t.obs)
        if len(obs) == 0:
            return
        tags = joined(obs.reshape(len(obs), -1)[:, -COLUMNS:])
        self.add(int(tags[0, 0]), int(tags[0, 1]), int(tags[-1, 1]), int(tags[0, 2]),
                 int(tags[-1, 2]))

    def to_arrays(self) -> dict[str, np.ndarray]:
        rows = np.array(self.rows, np.int64).reshape(-1, len(ROW_FIELDS))
        return {STATE_KEY: rows, COUNT_KEY: np.array(self.trajectories, np.int64)}

    @classmethod
    def from_arrays(cls, state: dict[str, Any]) -> Ledger:
        ledger = cls()
        rows = np.asarray(state.get(STATE_KEY, np.zeros((0, 5), np.int64))).reshape(-1, 5)
        for row in rows.tolist():
            ledger.rows.append(row)
            at = ledger.ends.get(row[0])
            if at is None or ledger.rows[at][2] < row[2]:
                ledger.ends[row[0]] = len(ledger.rows) - 1
        ledger.trajectories = int(np.asarray(state.get(COUNT_KEY, 0)))
        return ledger


class Recording:
    """Mixed into an algorithm (before it): what each update learns from is recorded in its
    optimizer state, so the checkpoint holds it with the weights."""

    ledger: Ledger

    def __init__(self, obs_dim: int, action: ActionSpace, config: PPOConfig,
                 rng: np.random.Generator) -> None:
        super().__init__(obs_dim, action, config, rng)  # type: ignore[call-arg]
        self.ledger = Ledger()

    def update(self, batch: Sequence[Trajectory],
               tick: Callable[[], object] | None = None) -> dict[str, float]:
        for t in batch:
            self.ledger.add_trajectory(t)
        stats: dict[str, float] = super().update(batch, tick)  # type: ignore[misc]
        return stats

    def optimizer_state(self) -> dict[str, np.ndarray]:
        state: dict[str, np.ndarray] = super().optimizer_state()  # type: ignore[misc]
        return state | self.ledger.to_arrays()

    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        super().load_optimizer_state(state)  # type: ignore[misc]
        self.ledger = Ledger.from_arrays(state)


class LedgerPPO(Recording, PPO):
    """The numpy PPO, recording what each update learns from in its optimizer state."""


class LedgerConsume(Recording, ConsumeOnly):
    """ConsumeOnly, recording what each batch would have been learned from as LedgerPPO
    does: steps it takes in count as learned."""


# ----------------------------------------------------------------------------- accounting

@dataclass
class Hole:
    """Steps `first`..`last` of a stream never learned, between learned steps stepped at
    `after_ms` and `before_ms` (0: the stream's start)."""

    stream: int
    first: int
    last: int
    after_ms: int
    before_ms: int

    @property
    def steps(self) -> int:
        return self.last - self.first + 1


@dataclass
class Accounting:
    """Steps by how often they were learned, over every stream."""

    streams: int = 0
    produced: int = 0  # steps the envs took (the count files), or learned-up-to without them
    once: int = 0  # steps learned at least once
    twice: int = 0  # learnings beyond the first (a step learned three times counts 2)
    twice_ranges: list[tuple[int, int, int]] = field(default_factory=list)  # stream, first, last
    never: int = 0
    holes: list[Hole] = field(default_factory=list)
    tail: int = 0  # after a stream's last learned step: in flight, or died with its env


def account(rows: np.ndarray, produced_steps: dict[int, int] | None = None) -> Accounting:
    """Accounting of ledger rows (n, 5) as `Ledger.to_arrays` gives them; `produced_steps`:
    {stream: steps taken}, for the tails (a stream never learned from is all tail)."""
    produced_steps = produced_steps or {}
    result = Accounting()
    rows = np.asarray(rows, np.int64).reshape(-1, 5)
    streams = set(rows[:, 0].tolist()) | set(produced_steps)
    result.streams = len(streams)
    for stream in sorted(streams):
        mine = rows[rows[:, 0] == stream]
        mine = mine[np.lexsort((mine[:, 2], mine[:, 1]))]
        learned_to = _account_stream(result, stream, mine)
        taken = max(produced_steps.get(stream, 0), learned_to + 1)
        result.produced += taken
        result.tail += taken - (learned_to + 1)
    return result


def _account_stream(result: Accounting, stream: int, rows: np.ndarray) -> int:
    """Adds one stream's sorted rows to `result`; the last step learned (-1: none)."""
    covered, covered_ms = -1, 0
    for _, first, last, first_ms, last_ms in rows.tolist():
        if first > covered + 1:
            hole = Hole(stream, covered + 1, first - 1, covered_ms, first_ms)
            result.holes.append(hole)
            result.never += hole.steps
        if first <= covered:
            again_to = min(last, covered)
            result.twice += again_to - first + 1
            result.twice_ranges.append((stream, first, again_to))
        if last > covered:
            result.once += last - max(first, covered + 1) + 1
            covered, covered_ms = last, last_ms
    return covered
