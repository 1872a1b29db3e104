"""Observation normalisation that broker and learner agree on, and return-based reward scaling.

The statistics are part of the policy: the learner folds the running mean and variance of the
observations it took in into new statistics only when it writes a checkpoint, and they apply
from the next policy version it publishes; each version's weights carry its statistics
(`obs_norm/<leaf>/mean`, `/var`), which the broker acts with (`Normalizing`), and the learner
normalises every step it learns from with the statistics of the version that acted it
(`Normalizer.normalize`). Since statistics change only in a checkpoint, a successor that
resumes it (after a kill or a swap) knows those of every version its predecessor published.

As Gymnasium's NormalizeObservation and SB3's VecNormalize: (x - mean) / sqrt(var + 1e-8),
clipped to +-clip (10); Box leaves of floating dtype only (images and categorical leaves are
left as they are). Rewards are divided by the standard deviation of the discounted return
(VecNormalize's `norm_reward`), clipped likewise; they never reach the broker.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stepbus.bus import protocol as p
from stepbus.models.base import Policy, State

PREFIX = "obs_norm/"
EPS = 1e-8
DEFAULT_CLIP = 10.0
SINGLE = "obs"  # the key of a Box observation that travels as one array
MAX_EPOCHS = 64  # statistics kept for older versions (steps older than the lag bound are dropped)
MAX_AGENTS = 1 << 16  # discounted returns tracked per agent for reward scaling


def leaves(spec: p.SpaceSpec) -> dict[str, tuple[int, ...]]:
    """The observation leaves that are normalised, by key, with their shapes."""
    if not spec.obs_leaves:
        floating = spec.obs_dtype and np.dtype(spec.obs_dtype).kind == "f"
        return {SINGLE: tuple(spec.obs_shape)} if floating else {}
    return {leaf.key: tuple(leaf.shape) for leaf in spec.obs_leaves
            if leaf.kind == "box" and np.dtype(leaf.dtype).kind == "f"}


@dataclass
class Moments:
    """Running mean and variance of a batch of rows (Chan et al.'s parallel update, as
    Gymnasium's RunningMeanStd), starting from SB3's count of 1e-4."""

    mean: np.ndarray
    var: np.ndarray
    count: float = 1e-4

    @classmethod
    def zeros(cls, shape: tuple[int, ...]) -> Moments:
        return cls(np.zeros(shape), np.ones(shape))

    def update(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows, np.float64)
        if rows.shape[0]:
            self.merge(rows.mean(axis=0), rows.var(axis=0), rows.shape[0])

    def merge(self, mean: np.ndarray, var: np.ndarray, count: float) -> None:
        delta, total = mean - self.mean, self.count + count
        m2 = self.var * self.count + var * count + delta ** 2 * self.count * count / total
        self.mean, self.var, self.count = self.mean + delta * count / total, m2 / total, total


@dataclass(frozen=True)
class Stats:
    """What one policy version normalises observations with: mean and variance by leaf."""

    mean: Mapping[str, np.ndarray]
    var: Mapping[str, np.ndarray]
    clip: float = DEFAULT_CLIP

    @classmethod
    def identity(cls, shapes: Mapping[str, tuple[int, ...]], clip: float) -> Stats:
        return cls({k: np.zeros(s) for k, s in shapes.items()},
                   {k: np.ones(s) for k, s in shapes.items()}, clip)

    def arrays(self) -> dict[str, np.ndarray]:
        """As they travel with the weights (none: observations acted on as they are)."""
        if not self.mean:
            return {}
        out = {f"{PREFIX}{k}/mean": np.asarray(v, np.float64) for k, v in self.mean.items()}
        out |= {f"{PREFIX}{k}/var": np.asarray(v, np.float64) for k, v in self.var.items()}
        out[f"{PREFIX}clip"] = np.array([self.clip])
        return out

    def leaf(self, key: str, x: np.ndarray) -> np.ndarray:
        if key not in self.mean:  # the raw statistics: as acted on, before any were folded
            return np.asarray(x, np.float32)
        scaled = (np.asarray(x, np.float64) - self.mean[key]) / np.sqrt(self.var[key] + EPS)
        return np.clip(scaled, -self.clip, self.clip).astype(np.float32)

    def apply(self, obs: p.Obs) -> p.Obs:
        """A batch of observations (rows first) normalised; leaves not normalised as they
        were."""
        if not self.mean:
            return obs
        if isinstance(obs, dict):
            return {k: self.leaf(k, v) if k in self.mean else v for k, v in obs.items()}
        return self.leaf(SINGLE, obs)

    def to_json(self) -> dict[str, Any]:
        return {"mean": {k: np.asarray(v).tolist() for k, v in self.mean.items()},
                "var": {k: np.asarray(v).tolist() for k, v in self.var.items()},
                "clip": self.clip}


RAW = Stats({}, {})  # no statistics yet: observations as they are


def split(params: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray],
                                                      dict[str, np.ndarray]]:
    """(normalisation arrays, the model's own) of weights off the wire."""
    norm = {k: v for k, v in params.items() if k.startswith(PREFIX)}
    return norm, {k: v for k, v in params.items() if not k.startswith(PREFIX)}


def stats_problem(spec: p.SpaceSpec, arrays: Mapping[str, np.ndarray]) -> str:
    """Why normalisation arrays off the wire cannot be used ("" if they can, or are none)."""
    if not arrays:
        return ""
    shapes = leaves(spec)
    want = {f"{PREFIX}clip": (1,)} | {f"{PREFIX}{k}/{part}": s for k, s in shapes.items()
                                      for part in ("mean", "var")}
    if set(arrays) != set(want):
        return f"normalisation arrays {sorted(arrays)[:4]}, these spaces need {sorted(want)[:4]}"
    for name, shape in want.items():
        value = arrays[name]
        if value.shape != shape or value.dtype.kind != "f" or not np.isfinite(value).all():
            return f"{name}: {value.dtype} {value.shape}, not finite floats of shape {shape}"
        if (name.endswith("/var") or name.endswith("clip")) and (value < 0).any():
            return f"{name} is negative"
    return ""


def stats_of(arrays: Mapping[str, np.ndarray]) -> Stats | None:
    """The statistics in checked normalisation arrays (None: there are none)."""
    if not arrays:
        return None
    keys = {name[len(PREFIX):].rpartition("/")[0] for name in arrays if name.endswith("/mean")}
    return Stats({k: arrays[f"{PREFIX}{k}/mean"] for k in keys},
                 {k: arrays[f"{PREFIX}{k}/var"] for k in keys},
                 float(arrays[f"{PREFIX}clip"][0]))


class Normalizing(Policy):
    """The broker's model behind the normalisation its weights carry: observations are
    normalised with the statistics of the version acting, then the model acts."""

    def __init__(self, inner: Policy) -> None:
        super().__init__(inner.spec)
        self.inner = inner
        self.stats: Stats | None = None
        self.version = inner.version

    def load(self, params: Mapping[str, np.ndarray], version: int) -> None:
        arrays, own = split(params)
        self.inner.load(own, version)
        self.stats = stats_of(arrays)
        super().load(params, version)

    def prepare(self, params: Mapping[str, np.ndarray]) -> None:
        """`load` gave the model its own weights already."""

    def normalized(self, obs: p.Obs) -> p.Obs:
        return obs if self.stats is None else self.stats.apply(obs)

    def act(self, obs: p.Obs, rng: np.random.Generator, deterministic: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.inner.act(self.normalized(obs), rng, deterministic)

    @property
    def recurrent(self) -> bool:
        return self.inner.recurrent

    def initial_state(self, n: int) -> State:
        return self.inner.initial_state(n)

    def act_recurrent(self, obs: p.Obs, state: State, rng: np.random.Generator,
                      deterministic: bool = False
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, State]:
        return self.inner.act_recurrent(self.normalized(obs), state, rng, deterministic)

    def weights_problem(self, params: Mapping[str, np.ndarray]) -> str:
        arrays, own = split(params)
        return stats_problem(self.spec, arrays) or self.inner.weights_problem(own)


class Normalizer:
    """The learner's side: moments of the observations it took in, folded into new
    statistics at each checkpoint (`fold`), and the statistics each version acted with."""

    def __init__(self, spec: p.SpaceSpec, clip: float = DEFAULT_CLIP) -> None:
        self.shapes = leaves(spec)
        self.moments = {k: Moments.zeros(s) for k, s in self.shapes.items()}
        self.pending = {k: Moments(np.zeros(s), np.zeros(s), 0.0) for k, s in self.shapes.items()}
        # (first version, statistics): each applies from its version until the next one's.
        # Until the first fold, observations are acted on as they are (RAW).
        self.epochs: list[tuple[int, Stats]] = [(0, RAW)]
        self.clip = clip

    def take_in(self, t: p.Trajectory) -> None:
        """A trajectory's raw observations, for the statistics of versions to come."""
        for key in self.shapes:
            self.pending[key].update(_leaf(t.obs, key))

    def fold(self, next_version: int, oldest_needed: int) -> None:
        """New statistics from everything taken in, for `next_version` on (a checkpoint is
        being written); epochs no version from `oldest_needed` on uses are forgotten."""
        if not self.shapes or not any(m.count for m in self.pending.values()):
            return
        for key, pending in self.pending.items():
            self.moments[key].merge(pending.mean, pending.var, pending.count)
            self.pending[key] = Moments(np.zeros(self.shapes[key]), np.zeros(self.shapes[key]),
                                        0.0)
        stats = Stats({k: m.mean.copy() for k, m in self.moments.items()},
                      {k: m.var.copy() for k, m in self.moments.items()}, self.clip)
        self.epochs = [e for e in self.epochs if e[0] < next_version] + [(next_version, stats)]
        while len(self.epochs) > 1 and (self.epochs[1][0] <= oldest_needed
                                        or len(self.epochs) > MAX_EPOCHS):
            self.epochs.pop(0)

    def stats_for(self, version: int) -> Stats:
        found = self.epochs[0][1]
        for first, stats in self.epochs:
            if first > version:
                break
            found = stats
        return found

    def normalize(self, t: p.Trajectory) -> p.Trajectory:
        """The trajectory as the learner learns from it: each step's observation normalised
        with the statistics of the version that acted it (the bootstrap with the last's)."""
        if not self.shapes:
            return t
        versions = t.policy_versions.astype(np.int64)
        obs = _float_copy(t.obs, self.shapes)
        for version in np.unique(versions):
            rows = versions == version
            stats = self.stats_for(int(version))
            for key in self.shapes:
                _leaf(obs, key)[rows] = stats.leaf(key, _leaf(t.obs, key)[rows])
        bootstrap = self.stats_for(int(versions[-1])).apply(_batch_of_one(t.bootstrap_obs))
        return dataclasses.replace(t, obs=obs, bootstrap_obs=_row(bootstrap))

    def to_json(self) -> list[Any]:
        """For the checkpoint's progress record: the epochs, and the moments to go on from."""
        return [{"first": first, **stats.to_json()} for first, stats in self.epochs] + [
            {"moments": {k: [m.count, m.mean.tolist(), m.var.tolist()]
                         for k, m in self.moments.items()}}]

    def restore(self, saved: list[Any]) -> None:
        """What `to_json` wrote. Raises ValueError when it does not fit these spaces."""
        if not saved:
            return
        *epochs, last = saved
        moments = {k: Moments(_fit(v[1], s), _fit(v[2], s), float(v[0]))
                   for k, s in self.shapes.items() for v in [last["moments"][k]]}
        self.epochs = [(int(e["first"]), _stats_of_json(e, self.shapes)) for e in epochs]
        if not self.epochs:
            raise ValueError("no statistics")
        self.moments = moments


class RewardScale:
    """Rewards divided by the running standard deviation of the discounted return, per agent
    in the order its trajectories come (SB3's VecNormalize `norm_reward`), clipped."""

    def __init__(self, gamma: float, clip: float = DEFAULT_CLIP) -> None:
        self.gamma, self.clip = gamma, clip
        self.returns = Moments(np.zeros(()), np.ones(()))
        self.running: dict[str, float] = {}  # agent -> its discounted return so far

    def scale(self, t: p.Trajectory) -> p.Trajectory:
        ret = self.running.pop(t.agent, 0.0)
        discounted = np.empty(len(t.rewards))
        for i, reward in enumerate(t.rewards.astype(np.float64)):
            ret = ret * self.gamma + reward
            discounted[i] = ret
        if not (t.terminated or t.truncated):
            if len(self.running) >= MAX_AGENTS:
                self.running.pop(next(iter(self.running)))
            self.running[t.agent] = ret
        self.returns.update(discounted)
        scaled = np.clip(t.rewards / math.sqrt(float(self.returns.var) + EPS),
                         -self.clip, self.clip)
        return dataclasses.replace(t, rewards=scaled.astype(t.rewards.dtype))

    def to_json(self) -> list[float]:
        return [self.returns.count, float(self.returns.mean), float(self.returns.var)]

    def restore(self, saved: list[Any]) -> None:
        if saved:
            count, mean, var = (float(x) for x in saved)
            if not (count > 0 and var >= 0 and math.isfinite(mean + var + count)):
                raise ValueError(f"reward statistics {saved[:3]}")
            self.returns = Moments(np.array(mean), np.array(var), count)


def _stats_of_json(saved: dict[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Stats:
    """An epoch's statistics as `Stats.to_json` wrote them (no means: RAW)."""
    if not saved["mean"]:
        return RAW
    return Stats({k: _fit(saved["mean"][k], s) for k, s in shapes.items()},
                 {k: _fit(saved["var"][k], s) for k, s in shapes.items()}, float(saved["clip"]))


def _fit(values: Any, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(values, np.float64)
    if array.shape != shape or not np.isfinite(array).all():
        raise ValueError(f"statistics of shape {array.shape}, these spaces need {shape}")
    return array


def _leaf(obs: p.Obs, key: str) -> np.ndarray:
    return obs[key] if isinstance(obs, dict) else obs


def _float_copy(obs: p.Obs, keys: Mapping[str, object]) -> p.Obs:
    """`obs` with a float32 copy of each leaf to be normalised (the message's own untouched)."""
    if isinstance(obs, dict):
        return {k: v.astype(np.float32) if k in keys else v for k, v in obs.items()}
    return obs.astype(np.float32)


def _batch_of_one(obs: p.Obs) -> p.Obs:
    return {k: v[None] for k, v in obs.items()} if isinstance(obs, dict) else obs[None]


def _row(obs: p.Obs) -> p.Obs:
    return {k: v[0] for k, v in obs.items()} if isinstance(obs, dict) else obs[0]
