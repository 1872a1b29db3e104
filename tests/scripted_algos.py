"""Learning algorithms for `--algo` in tests: small, observable variations of PPO."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stepbus.trainer.algorithm import Trajectory
from stepbus.trainer.ppo import PPO


class NoUpdatePPO(PPO):
    """Publishes new versions without changing the policy: proves `--algo` took effect (its
    updates report `no_update` in metrics.jsonl) while the run goes on."""

    def update(self, batch: Sequence[Trajectory],
               tick: Callable[[], object] | None = None) -> dict[str, float]:
        return {"no_update": 1.0}


class RefusesToStart:
    """Raises when built: a swap to it must be reverted."""

    def __init__(self, *args: object) -> None:
        raise RuntimeError("this algorithm refuses to start")


class CurriculumPPO(PPO):
    """PPO that asks, after its second update, for a reset barrier to level 2 (once)."""

    updates = 0

    def curriculum(self, stats: dict) -> dict | None:
        self.updates += 1
        return {"level": 2} if self.updates == 2 else None


class RecordsLearned(PPO):
    """Learns nothing, taking UPDATE_S per update (so the learner, not stepping, sets the
    pace, as PPO does, without spending CPU), and remembers which trajectories it learned
    from: in its optimiser state, so in the checkpoint and lost with a kill exactly as real
    learning is; and, for a test to watch, one line per update (pid and numbers) in the file
    STEPBUS_TEST_LEARNED_LOG names."""

    UPDATE_S = 0.05
    KEY = "learned_seq"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.learned = np.zeros(0, np.int64)
        self.log_path = os.environ.get("STEPBUS_TEST_LEARNED_LOG", "")

    def update(self, batch: Sequence[Trajectory],
               tick: Callable[[], object] | None = None) -> dict[str, float]:
        time.sleep(self.UPDATE_S)
        seqs = np.array([t.seq for t in batch], np.int64)
        self.learned = np.concatenate([self.learned, seqs])
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(f"{os.getpid()} {' '.join(map(str, seqs.tolist()))}\n")
        return {"no_update": 1.0}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {**super().optimizer_state(), self.KEY: self.learned}

    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        super().load_optimizer_state(state)
        self.learned = state.get(self.KEY, np.zeros(0, np.int64))
