"""A learning algorithm that takes every batch in and learns nothing: `--algo
stepbus.trainer.consume:ConsumeOnly`, for throughput benchmarks.

Measuring how fast the pipeline collects experience needs a trainer process that consumes
trajectories without becoming the bottleneck itself: PPO's 20 epochs per 256 steps would cap
the pipeline at the update's speed. The learner around it still does everything else it always
does (checks, receipts, versioned weights, checkpoints), and the broker still runs inference on
a real MLP, of the size `--hidden` gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from stepbus.models.mlp import init_params
from stepbus.policy import ActionSpace, Params
from stepbus.trainer.algorithm import PPOConfig, Trajectory
from stepbus.trainer.ppo import net_of


class ConsumeOnly:
    """trainer/algorithm.py's `Algorithm` with an update that only counts the batch."""

    def __init__(self, obs_dim: int, action: ActionSpace, config: PPOConfig,
                 rng: np.random.Generator) -> None:
        self.params: Params = init_params(obs_dim, action, config.hidden, rng, net_of(config))

    def update(self, batch: Sequence[Trajectory],
               tick: Callable[[], object] | None = None) -> dict[str, float]:
        return {"consumed_steps": float(sum(len(t) for t in batch))}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {}

    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        """Nothing to restore: there is no optimiser."""
