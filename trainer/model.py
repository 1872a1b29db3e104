"""The model a learner trains, in one place: the learning algorithm (`--algo module:Class`,
trainer/ppo.py's PPO by default), its params, which the broker acts with, and the spaces that
trajectories are checked against. The learner knows the model through `Model` only, and
`Model` knows the spaces and parameters through `stepbus.policy`; a torch model's is
trainer/torch_model.py's `TorchModel`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stepbus import policy, spaces
from stepbus.bus import checks, rows
from stepbus.bus import protocol as p
from stepbus.trainer import checkpoint
from stepbus.trainer.algorithm import Algorithm, AlgorithmClass, CannotStart, PPOConfig, Trajectory


class Model:
    """The algorithm and what it was built for: the spaces of the run's env spec."""

    def __init__(self, algo_class: AlgorithmClass, env_spec: p.EnvSpec,
                 config: PPOConfig, seed: int, *, name: str = "") -> None:
        """Raises CannotStart when the algorithm fails to start (user code: one clear line)."""
        self.spec, self.config = env_spec.spec, config
        self.action = policy.action_space(self.spec)
        self.rng = np.random.default_rng(seed)
        try:
            self.algo: Algorithm = algo_class(policy.obs_dim(self.spec), self.action, config,
                                              self.rng)
        except Exception as exc:
            raise CannotStart(f"--algo {name} failed to start: {type(exc).__name__}: "
                              f"{exc}") from exc
        self.params = self.algo.params

    def problem(self, msg: p.Trajectory | p.Trajectories) -> str:
        """Why trajectories cannot be trained on (empty if they can)."""
        if isinstance(msg, p.Trajectory):
            return checks.trajectory_problem(msg, self.spec, self.action)
        return checks.trajectories_problem(msg, self.spec, self.action)

    def record(self, t: p.Trajectory) -> Trajectory:
        """What the algorithm learns from, of a trajectory off the bus: observations as flat
        rows (categorical leaves one-hot, `spaces.flatten`), and the action mask."""
        obs, bootstrap = t.obs, t.bootstrap_obs
        if isinstance(obs, dict):
            obs = spaces.flatten(self.spec, obs, np.float32)
            bootstrap = spaces.flatten(self.spec, rows.stack([bootstrap]), np.float32)[0]
        return self.trajectory(t, obs, bootstrap)

    def trajectory(self, t: p.Trajectory, obs: p.Obs, bootstrap: p.Obs) -> Trajectory:
        return Trajectory(obs=obs, actions=t.actions, logp=t.logp, values=t.values,
                          rewards=t.rewards, terminated=t.terminated, truncated=t.truncated,
                          bootstrap_obs=bootstrap, assembler=t.assembler, seq=t.seq,
                          action_mask=spaces.mask(self.spec, t.obs), state=t.state or None,
                          bootstrap_from_last=t.bootstrap_from_last)

    def update(self, batch: Sequence[Trajectory],
               tick: Callable[[], object]) -> dict[str, float]:
        return self.algo.update(batch, tick=tick)

    def algorithm(self) -> object:
        """The algorithm object, whose optional hooks (`set_learning_rate`, `curriculum`) are
        looked up on it."""
        return self.algo

    def set_learning_rate(self, lr: float) -> None:
        """A schedule's rate for the next updates, to an algorithm that takes one (else it
        keeps its own: a plug-in without `set_learning_rate`)."""
        hook = getattr(self.algorithm(), "set_learning_rate", None)
        if callable(hook):
            hook(lr)

    def curriculum(self, stats: dict[str, float]) -> dict | None:
        """Env options for a reset barrier, if the algorithm asks for one after this update."""
        hook = getattr(self.algorithm(), "curriculum", None)
        return hook(stats) if callable(hook) else None

    def rng_state(self) -> dict[str, Any]:
        """The algorithm's generator's state, as JSON (a checkpoint holds no pickle)."""
        return dict(self.rng.bit_generator.state)

    def restore_rng(self, state: dict[str, Any], path: Path) -> None:
        """Go on with the generator where the checkpoint at `path` left it (an empty state:
        a checkpoint without one, the seed's). Raises CannotStart for one that is no state
        of this generator."""
        if not state:
            return
        try:
            self.rng.bit_generator.state = state
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CannotStart(f"checkpoint {path} has a generator state this learner cannot "
                              f"use ({type(exc).__name__}: {exc})"[:300]) from None

    def weights(self) -> dict[str, np.ndarray]:
        """Copies: frames are sent zero-copy and the next update changes the params in place."""
        return {k: v.copy() for k, v in self.params.items()}

    def save(self, path: Path, progress: dict[str, Any]) -> None:
        checkpoint.save(path, self.params, self.algo.optimizer_state(), progress)

    def resume(self, path: Path) -> dict[str, Any]:
        """Params and optimiser state from the checkpoint at `path`; the progress it carries.
        Raises CannotStart when its params do not fit this model."""
        saved, optimizer, progress = checkpoint.load(path)
        params = self.params
        if policy.fingerprint(saved) != policy.fingerprint(params):
            mismatch = sorted(k for k in params.keys() | saved.keys() if k not in saved
                              or k not in params or saved[k].shape != params[k].shape)
            raise CannotStart(
                f"checkpoint {path} does not fit this policy ({', '.join(mismatch[:4])}; spaces "
                f"{self.spec}, hidden {self.config.hidden}): start a new run or use the old "
                "settings")
        params.update(saved)
        self.algo.load_optimizer_state(optimizer)
        return progress
