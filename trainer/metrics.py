"""What the learner writes about a run: `metrics.jsonl` and TensorBoard scalars from the same
records, at most one a second (`RecordCadence`), the intake figures that go in them (policy
lag, episode length, link throughput), and the progress line in the log.

One record feeds both files, so they never disagree and the learner keeps one dict, not two
kinds of bookkeeping. TensorBoard event files are written with tensorboardX, which needs neither
TensorFlow nor torch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from stepbus.bus import protocol as p

FLUSH_S = 5  # TensorBoard events reach the disk at least this often (metrics.jsonl: each line)
# One metrics record a second at most by default: about 1.8 KB of the two files a second
# whatever the update rate (PPO on CartPole makes up to 30 updates a second, one record each
# was 180 MB an hour; docs/performance.md); see RecordCadence.
RECORD_INTERVAL_S = 1.0
PROGRESS_INTERVAL_S = 5.0  # one progress line in the log this often, whatever the update rate

# metrics.jsonl key -> TensorBoard tag. Other numeric keys (an --algo's own stats) go under
# "algo/"; SKIPPED ones are the x axis, identities or not numbers worth a curve.
TAGS = {
    "mean_return": "episode/return_mean",
    "interval_mean_return": "episode/return_mean_interval",
    "mean_length": "episode/length_mean",
    "episodes": "episode/count",
    "policy_loss": "loss/policy",
    "value_loss": "loss/value",
    "loss": "loss/total",
    "grad_norm": "loss/grad_norm",
    "entropy": "policy/entropy",
    "approx_kl": "policy/approx_kl",
    "clip_fraction": "policy/clip_fraction",
    "explained_variance": "value/explained_variance",
    "steps_per_second": "throughput/env_steps_per_s",
    "policy_lag_p50": "policy_lag/p50",
    "policy_lag_p99": "policy_lag/p99",
    "trajectories_per_second": "link/assembler_to_learner/trajectories_per_s",
    "intake_bytes_per_second": "link/assembler_to_learner/bytes_per_s",
    "policy_version": "run/policy_version",
    "generation": "run/generation",
    "stale_dropped": "run/stale_dropped",
    "eval_return": "eval/return_mean",  # an evaluator's greedy episodes (processor/evaluator.py)
    "eval_return_std": "eval/return_std",
    "eval_length": "eval/length_mean",
    "eval_episodes": "eval/episodes",
    "eval_version": "eval/policy_version",
}
SKIPPED = {"time", "wall_s", "env_steps", "digest", "n_samples", "n_grad_steps", "updates"}


class MetricsFiles:
    """`metrics.jsonl` (one JSON object per line, written through at once) and a TensorBoard
    event file in the same directory (`tensorboard --logdir RUN_DIR`). Each learner generation
    opens a new event file; TensorBoard shows them as one run, on the env-steps axis."""

    @staticmethod
    def preload() -> None:
        """Import the TensorBoard writer (over a second on a busy machine) before the learner
        registers with the controller, which would otherwise take the silence for death.
        tensorboardX imports torch if it can, only to accept its tensors (2-3.5 s of CPU and
        180 MiB here, at every learner start); we give it floats, so unless an algorithm
        imported torch already, that import is kept from finding it (later ones work)."""
        keep_out = "torch" not in sys.modules and "tensorboardX" not in sys.modules
        if keep_out:
            sys.modules["torch"] = None  # type: ignore[assignment]  # "import torch" fails
        try:
            import tensorboardX  # noqa: F401
        finally:
            if keep_out:
                del sys.modules["torch"]

    def __init__(self, directory: Path) -> None:
        MetricsFiles.preload()  # here: the CLI imports this module, too
        from tensorboardX import SummaryWriter

        self.jsonl = (directory / "metrics.jsonl").open("ab", buffering=0)
        # A file of its own per learner process: the name is otherwise the second and the
        # host, and a successor started within the same second would write over its file.
        self.events = SummaryWriter(logdir=str(directory), flush_secs=FLUSH_S,
                                    filename_suffix=f".{os.getpid()}")

    def write(self, record: dict[str, Any]) -> bool:
        """The record's line and scalars; False if the disk refused the line (full), which
        is then not in the file at all. Scalars go to TensorBoard only while its writer lives
        (`events_alive`)."""
        if not append_whole(self.jsonl.fileno(), (json.dumps(record) + "\n").encode()):
            return False
        if self.events_alive():
            step, walltime = int(record["env_steps"]), record.get("time")
            for _key, tag, value in scalars(record):
                self.events.add_scalar(tag, value, global_step=step, walltime=walltime)
        return True

    def events_alive(self) -> bool:
        """tensorboardX writes from a thread of its own that dies on a write error (a full
        disk), after which each scalar waits for room in its bounded queue for ever, and so
        would the learner: from then on its scalars are left out (metrics.jsonl has them)."""
        writer = getattr(getattr(self.events, "file_writer", None), "event_writer", None)
        worker = getattr(writer, "_worker", None)  # tensorboardX 2.6's EventFileWriter
        return worker is None or worker.is_alive()

    def close(self) -> None:
        self.jsonl.close()
        if self.events_alive():  # closing a dead writer waits on its queue too
            with contextlib.suppress(OSError):
                self.events.close()


def append_whole(fd: int, line: bytes) -> bool:
    """`line` at the end of the file, whole or not at all: a write a full disk cuts short is
    taken back, so a reader never finds a torn line. False if it was not written."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        if os.write(fd, line) == len(line):
            return True
    except OSError:
        pass
    with contextlib.suppress(OSError):
        os.ftruncate(fd, start)
    return False


def scalars(record: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(key, TensorBoard tag, value) for each finite number in a metrics record."""
    out = []
    for key, value in record.items():
        if key in SKIPPED or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if math.isfinite(value):
            out.append((key, TAGS.get(key, f"algo/{key}"), float(value)))
    return out


class RecordCadence:
    """When the next metrics record is due, and what it holds of the policy updates since the
    last one: at most one record every `interval_s` (0: one per update), so metrics.jsonl and
    the event file grow with time, not with the update rate.

    A record's algorithm figures (losses, entropy, KL, ...) are the mean over its updates:
    every update counts, and the curve is the smoothed one a TensorBoard user would look at
    anyway, not one update picked out of thirty. Counts, versions and the goal's mean return
    (the last --target-episodes episodes) are as they stand at the record; the return of every
    episode that ended since the last record counts in `interval_mean_return`, so none is
    lost when more than --target-episodes end in one interval."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = max(interval_s, 0.0)
        self.last = -math.inf  # when the last record was made: the first update's is at once
        self.updates = 0
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.return_sum, self.episodes = 0.0, 0

    @property
    def due(self) -> float:
        """When a record of the updates waiting may be made."""
        return self.last + self.interval_s

    def add(self, stats: dict[str, float]) -> None:
        """An update's figures (an algorithm may report different ones per update)."""
        self.updates += 1
        for key, value in stats.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
            self.counts[key] = self.counts.get(key, 0) + 1

    def episode(self, episode_return: float) -> None:
        self.return_sum += episode_return
        self.episodes += 1

    def take(self, now: float) -> tuple[dict[str, float | None], dict[str, float]]:
        """(`updates` and `interval_mean_return`, the algorithm's figures averaged) for the
        record made at `now`; counting starts afresh."""
        counts: dict[str, float | None] = {
            "updates": self.updates,
            "interval_mean_return": (round(self.return_sum / self.episodes, 4)
                                     if self.episodes else None)}
        means = {key: round(total / self.counts[key], 6) for key, total in self.sums.items()}
        self.last, self.updates, self.sums, self.counts = now, 0, {}, {}
        self.return_sum, self.episodes = 0.0, 0
        return counts, means


class IntakeStats:
    """Figures about what the learner took in between two metrics records: the policy lag of
    its steps, finished episodes' lengths, and the assembler-to-learner link's throughput.

    Policy lag of a step: the version the update it was taken in for started from minus the
    version that chose the step, over every step of the record's updates (stale trajectories
    too, which --max-policy-lag then drops), as p50 and p99. 0: acted with the very policy
    being updated.
    """

    def __init__(self, episodes: int, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.lengths: collections.deque[int] = collections.deque(maxlen=max(episodes, 1))
        self.versions: list[np.ndarray] = []  # of steps taken in since the last update
        self.lags: list[np.ndarray] = []  # of the steps of the updates since the last record
        self.trajectories = self.nbytes = 0
        self.since = clock()
        self.last: dict[str, float] = {}  # the last update's lag, for `stepbus status`

    def add(self, t: p.Trajectory) -> None:
        self.versions.append(t.policy_versions)
        self.trajectories += 1
        self.nbytes += sum(v.nbytes for v in (getattr(t, f.name) for f in dataclasses.fields(t))
                           if isinstance(v, np.ndarray))
        if t.episode_length is not None:
            self.lengths.append(t.episode_length)

    def updated(self, updated_from: int) -> None:
        """An update that started from policy version `updated_from` learned from the steps
        taken in since the last one: their lag."""
        if self.versions:
            lag = updated_from - np.concatenate(self.versions).astype(np.int64)
            self.versions = []
            self.lags.append(lag)
            self.last = _lag_percentiles(lag)

    def take(self, updated_from: int | None = None) -> dict[str, float | None]:
        """The figures for the next record (`updated_from`: an update to count first); starts
        counting afresh."""
        if updated_from is not None:
            self.updated(updated_from)
        now = self.clock()
        seconds = max(now - self.since, 1e-9)
        out: dict[str, float | None] = {
            "mean_length": round(float(np.mean(self.lengths)), 2) if self.lengths else None,
            "trajectories_per_second": round(self.trajectories / seconds, 1),
            "intake_bytes_per_second": round(self.nbytes / seconds),
        }
        if self.lags:
            out.update(self.last if len(self.lags) == 1
                       else _lag_percentiles(np.concatenate(self.lags)))
        self.lags, self.trajectories, self.nbytes, self.since = [], 0, 0, now
        return out


def _lag_percentiles(lag: np.ndarray) -> dict[str, float]:
    p50, p99 = np.percentile(lag, [50, 99], method="inverted_cdf")
    return {"policy_lag_p50": int(p50), "policy_lag_p99": int(p99)}


class ProgressLog:
    """One progress line every PROGRESS_INTERVAL_S on a fixed schedule (a slow update delays
    a line, it does not shift the ones after it), with the step rate over that interval."""

    def __init__(self, log: logging.Logger, steps: int, clock: Any = time.monotonic,
                 interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.log, self.clock, self.interval_s = log, clock, interval_s
        self.due = clock() + interval_s
        self.last_t, self.last_steps = clock(), steps

    def maybe(self, steps: int, mean_return: float | None, version: int) -> None:
        now = self.clock()
        if now < self.due:
            return
        # the next line is due one interval after this one was; after a long stall, restart
        self.due = max(self.due + self.interval_s, now + self.interval_s / 2)
        rate = (steps - self.last_steps) / max(now - self.last_t, 1e-9)
        self.last_t, self.last_steps = now, steps
        self.log.info("progress: %d env steps, %.0f steps/s, mean return %s, policy version %d",
                      steps, rate, "-" if mean_return is None else f"{mean_return:.1f}",
                      version)
