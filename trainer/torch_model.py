"""What the learner holds of a torch model (the numpy MLP's is trainer/model.py's `Model`):
the module the factory makes for the run's spaces, trained by TorchPPO, RecurrentPPO for a
module with `initial_state`, or --algo; its weights out as numpy arrays, its checkpoints as
safetensors. Imports torch: the learner imports it only for a torch model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stepbus import policy
from stepbus.bus import checks
from stepbus.bus import protocol as p
from stepbus.models import torch_policy
from stepbus.trainer import algorithm, checkpoint, torch_recurrent
from stepbus.trainer.algorithm import CannotStart, PPOConfig, Trajectory
from stepbus.trainer.model import Model
from stepbus.trainer.torch_ppo import TorchPPO

DEFAULT_ALGOS = ("stepbus.trainer.ppo:PPO", "stepbus.trainer.torch_ppo:TorchPPO")


class TorchModel(Model):
    """A torch model as the learner holds one (the numpy MLP's is `model.Model`): the
    module the factory makes for the run's spaces, trained by TorchPPO (or --algo), its
    state_dict published as numpy arrays, checkpointed as safetensors."""

    def __init__(self, models: policy.ModelConfig, algo: str, env_spec: p.EnvSpec,
                 config: PPOConfig, seed: int) -> None:
        """Raises CannotStart when the model does not fit the spaces or the algorithm fails
        to start."""
        self.spec, self.config = env_spec.spec, config
        self.action = policy.action_space(self.spec)
        torch.manual_seed(seed)  # the initial weights
        try:
            acting = policy.make_policy(models.model, self.spec, device=models.device)
        except ValueError as exc:
            raise CannotStart(f"{exc}") from exc
        assert isinstance(acting, torch_policy.TorchPolicy)
        self.module = acting.module
        self.memory = acting.memory
        default = TorchPPO if self.memory is None else torch_recurrent.RecurrentPPO
        algo_class = default if algo in DEFAULT_ALGOS else algorithm.load(algo)
        given = {"spec": self.spec} if algo_class is default else {}
        self.rng = np.random.default_rng(seed)  # minibatches (its state is checkpointed)
        self.initial = acting.initial_state(1) if self.memory is not None else {}
        try:
            self.torch_algo = algo_class(self.module, self.action, config, self.rng,
                                         **given)
        except Exception as exc:  # user code: one line
            raise CannotStart(f"--algo {algo} failed to start with --model {models.model}: "
                              f"{type(exc).__name__}: {exc}") from exc

    def problem(self, msg: p.Trajectory | p.Trajectories) -> str:
        """As the numpy model's, and a recurrent model's trajectories carry first states
        shaped as its own."""
        states = msg.state if isinstance(msg, p.Trajectory) else msg.states
        lead = () if isinstance(msg, p.Trajectory) else (len(msg.seqs),)
        want = {k: ((*lead, *v.shape[1:]), v.dtype.str) for k, v in self.initial.items()}
        got = {k: (v.shape, v.dtype.str) for k, v in states.items()}
        if got != want:
            return f"recurrent states {got}, this model's are {want}"[:200]
        return super().problem(msg) or checks.state_problem(states, lead)

    def record(self, t: p.Trajectory) -> Trajectory:
        """Observations as they travel (the module nests them itself), and the action mask."""
        return self.trajectory(t, t.obs, t.bootstrap_obs)

    def update(self, batch: Sequence[Trajectory],
               tick: Callable[[], object]) -> dict[str, float]:
        stats: dict[str, float] = self.torch_algo.update(batch, tick=tick)
        return stats

    def algorithm(self) -> object:
        return self.torch_algo

    def weights(self) -> dict[str, np.ndarray]:
        return torch_policy.state_arrays(self.module)

    def save(self, path: Path, progress: dict[str, Any]) -> None:
        checkpoint.save_torch(path, self.module.state_dict(),
                              self.torch_algo.optimizer_state(), progress)

    def resume(self, path: Path) -> dict[str, Any]:
        """The module's weights and the optimiser's state from the checkpoint at `path`; the
        progress it carries. Raises CannotStart when it holds another model's weights."""
        saved, optimizer, progress = checkpoint.load_torch(path)
        problem = torch_policy.layout_problem(
            self.module.state_dict(), {k: v.numpy() for k, v in saved.items()})
        if problem:
            raise CannotStart(f"checkpoint {path} does not fit this model ({problem}; spaces "
                              f"{self.spec}): start a new run or use the old settings")
        self.module.load_state_dict(saved)
        self.torch_algo.load_optimizer_state(optimizer)
        return progress
