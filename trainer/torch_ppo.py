"""PPO for torch models (`--model torch` or your own module), as trainer/ppo.py does it for the
numpy MLP: the same clipped surrogate, per-minibatch advantage normalisation, squared-error
value loss, entropy bonus, global grad-norm clip and Adam (eps 1e-5), the same equal
minibatches and GAE with the critic re-evaluated on the current weights, the same metrics
figures. It is the learner's algorithm when `--model` is not mlp and `--algo` is the default.

Reads top to bottom: GAE on the module's values, the batch, one gradient step, `TorchPPO`, and
`TorchModel`, which is what the learner holds of a torch model (built from the spaces, weights
out as numpy arrays, checkpoints as safetensors).
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stepbus import policy
from stepbus.bus import checks, rows
from stepbus.bus import protocol as p
from stepbus.models import torch_policy
from stepbus.policy import ActionSpace
from stepbus.trainer import algorithm, checkpoint, ppo
from stepbus.trainer.algorithm import CannotStart, Model
from stepbus.trainer.ppo import PPOConfig, Trajectory

VALUE_CHUNK_ROWS = 1024  # the critic's pass over a batch goes in chunks of this many rows
DEFAULT_ALGOS = ("stepbus.trainer.ppo:PPO", "stepbus.trainer.torch_ppo:TorchPPO")


def values_of(module: nn.Module, obs: p.Obs, device: torch.device,
              spec: p.SpaceSpec | None = None) -> np.ndarray:
    """The critic's values (float64, one per row), without gradients. `spec`: how a map of
    leaves nests (None: `obs` is one array)."""
    out = []
    with torch.no_grad():
        for start in range(0, rows.count(obs), VALUE_CHUNK_ROWS):
            part = rows.take(obs, slice(start, start + VALUE_CHUNK_ROWS))
            chunk = (torch_policy.module_input(spec, part, device) if spec is not None
                     else torch_policy.as_input(typing.cast(np.ndarray, part), device))
            out.append(torch_policy.agent(module).get_value(chunk).reshape(-1).double()
                       .cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0)


def compute_gae(trajs: Sequence[Trajectory], module: nn.Module, cfg: PPOConfig,
                device: torch.device, spec: p.SpaceSpec | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns), float64, concatenated in trajectory order, as
    `trainer.ppo.compute_gae`: every value, bootstrap ones included, from the current critic.
    Observations keep their shape (images stay images)."""
    all_obs = rows.concat([*(t.obs for t in trajs), rows.stack([t.bootstrap_obs for t in trajs])])
    return ppo.gae(trajs, values_of(module, all_obs, device, spec), cfg)


@dataclass
class _Batch:
    """One update's samples as tensors on the module's device, with GAE targets."""

    b_obs: torch.Tensor | dict[str, torch.Tensor]  # as the observations travel, as tensors
    b_actions: torch.Tensor
    b_logp: torch.Tensor
    b_adv: torch.Tensor
    b_returns: torch.Tensor
    n_minibatches: int
    explained_variance: float
    b_mask: torch.Tensor | None = None

    @classmethod
    def of(cls, trajs: Sequence[Trajectory], module: nn.Module, cfg: PPOConfig,
           action: ActionSpace, device: torch.device, spec: p.SpaceSpec | None = None
           ) -> _Batch:
        adv, returns = compute_gae(trajs, module, cfg, device, spec)
        obs = rows.concat([t.obs for t in trajs])
        b_obs: torch.Tensor | dict[str, torch.Tensor] = (
            {k: torch_policy.as_input(v, device) for k, v in obs.items()}
            if isinstance(obs, dict) else torch_policy.as_input(obs, device))
        actions = np.concatenate([np.asarray(t.actions) for t in trajs])
        b_actions = torch.from_numpy(actions.astype(
            np.float32 if action.kind == "box" else np.int64)).to(device)
        masks = ppo.masks_of(trajs, action)
        b_mask = None if masks is None else torch.from_numpy(masks).to(device)
        b_logp = torch.from_numpy(
            np.concatenate([np.asarray(t.logp, np.float32) for t in trajs])).to(device)
        values = returns - adv
        var_returns = float(np.var(returns))
        explained = (1.0 - float(np.var(returns - values)) / var_returns
                     if var_returns > 0 else 0.0)
        return cls(b_obs, b_actions, b_logp, torch.from_numpy(adv.astype(np.float32)).to(device),
                   torch.from_numpy(returns.astype(np.float32)).to(device),
                   max(1, round(len(adv) / cfg.minibatch_size)), explained, b_mask)

    @property
    def n(self) -> int:
        return len(self.b_adv)


STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "loss",
         "grad_norm")


def gradient_step(module: nn.Module, optimizer: torch.optim.Optimizer, batch: _Batch,
                  mb_inds: torch.Tensor, cfg: PPOConfig, spec: p.SpaceSpec | None = None
                  ) -> dict[str, float]:
    """One clipped-surrogate Adam step on the minibatch `mb_inds`; its loss stats, named as
    trainer/ppo.py names them."""
    obs = batch.b_obs
    inputs = (torch_policy.module_input(spec, {k: v[mb_inds] for k, v in obs.items()},
                                        mb_inds.device)
              if isinstance(obs, dict) and spec is not None else
              typing.cast(torch.Tensor, obs)[mb_inds])
    masks = {} if batch.b_mask is None else {"action_mask": batch.b_mask[mb_inds]}
    _, newlogp, entropy, newvalue = torch_policy.agent(module).get_action_and_value(
        inputs, batch.b_actions[mb_inds], **masks)
    return loss_step(module, optimizer, cfg, Taken(newlogp, entropy, newvalue),
                     Targets(batch.b_logp[mb_inds], batch.b_adv[mb_inds],
                             batch.b_returns[mb_inds]))


@dataclass
class Taken:
    """What the module makes of a minibatch's actions now: log-probs, entropies, values."""

    logp: torch.Tensor
    entropy: torch.Tensor
    value: torch.Tensor


@dataclass
class Targets:
    """A minibatch's behaviour log-probs, advantages and returns; `valid` (1 or 0 per row)
    leaves padding out of every mean (sequences of a recurrent model)."""

    logp: torch.Tensor
    adv: torch.Tensor
    returns: torch.Tensor
    valid: torch.Tensor | None = None


def loss_step(module: nn.Module, optimizer: torch.optim.Optimizer, cfg: PPOConfig,
              taken: Taken, targets: Targets) -> dict[str, float]:
    """PPO's loss on one minibatch, one Adam step with the gradient norm clipped, the stats."""
    valid = targets.valid if targets.valid is not None else torch.ones_like(targets.adv)
    count = valid.sum().clamp(min=1.0)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x.reshape(-1) * valid).sum() / count

    adv = targets.adv
    if count > 1:  # unbiased std, as SB3 and ppo.py
        centred = (adv - mean(adv)) * valid
        adv = centred / (torch.sqrt((centred ** 2).sum() / (count - 1)) + 1e-8)
    logratio = taken.logp.reshape(-1) - targets.logp
    if targets.valid is not None:  # a padded row's ratio may overflow: inf * 0 would be NaN
        logratio = torch.where(targets.valid > 0, logratio, torch.zeros_like(logratio))
    ratio = logratio.exp()
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_range, 1.0 + cfg.clip_range)
    policy_loss = mean(torch.max(-adv * ratio, -adv * clipped))
    value_loss = mean((taken.value.reshape(-1) - targets.returns) ** 2)
    entropy_mean = mean(taken.entropy)
    loss = policy_loss + cfg.vf_coef * value_loss - cfg.ent_coef * entropy_mean
    optimizer.zero_grad()
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(module.parameters(), cfg.max_grad_norm)
    optimizer.step()
    with torch.no_grad():
        approx_kl = mean((ratio - 1.0) - logratio)
        clip_fraction = mean(((ratio - 1.0).abs() > cfg.clip_range).float())
        figures = torch.stack([policy_loss, value_loss, entropy_mean, approx_kl, clip_fraction,
                               loss, grad_norm.to(loss.dtype)]).double().cpu().tolist()
    return dict(zip(STATS, figures, strict=True))


class TorchPPO:
    """The learner's algorithm for a torch model. Another one (`--algo module:Class` with a
    torch --model) is built the same way, `(module, action, config, rng)`, trains `module` in
    place, and has `update`, `optimizer_state` and `load_optimizer_state` (tensors by name)."""

    def __init__(self, module: nn.Module, action: ActionSpace, config: PPOConfig,
                 rng: np.random.Generator, *, spec: p.SpaceSpec | None = None) -> None:
        """`spec`: how observations that travel as a map of leaves nest for the module."""
        self.module, self.action, self.config, self.rng = module, action, config, rng
        self.spec = spec
        self.device = next(module.parameters()).device
        self.optimizer = torch.optim.Adam(module.parameters(), lr=config.lr, eps=1e-5)

    def update(self, batch: Sequence[Trajectory],
               tick: Callable[[], object] | None = None) -> dict[str, float]:
        """`config.n_epochs` of minibatch PPO on `batch`; stats averaged over the gradient
        steps, the explained variance of the critic it started from, the sample count."""
        trajs = [t for t in batch if len(t)]
        if not trajs:
            return {}
        data = _Batch.of(trajs, self.module, self.config, self.action, self.device, self.spec)
        totals = dict.fromkeys(STATS, 0.0)
        n_steps = 0
        for _epoch in range(self.config.n_epochs):
            for mb_inds in np.array_split(self.rng.permutation(data.n), data.n_minibatches):
                stats = gradient_step(self.module, self.optimizer, data,
                                      torch.from_numpy(mb_inds).to(self.device), self.config,
                                      self.spec)
                for key, val in stats.items():
                    totals[key] += val
                n_steps += 1
                if tick is not None:
                    tick()
        return {**{key: val / n_steps for key, val in totals.items()},
                "explained_variance": data.explained_variance, "n_samples": float(data.n),
                "n_grad_steps": float(n_steps)}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Adam's moments and step counts by parameter name (`name/exp_avg`, ...)."""
        names = [name for name, _ in self.module.named_parameters()]
        state = self.optimizer.state_dict()["state"]
        return {f"{names[index]}/{key}": torch.as_tensor(value)
                for index, moments in state.items() for key, value in moments.items()}

    def load_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """Moments from a checkpoint; the learning rate and the rest stay this config's."""
        index = {name: i for i, (name, _) in enumerate(self.module.named_parameters())}
        moments: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            name, _, field = key.rpartition("/")
            if name in index:
                moments.setdefault(index[name], {})[field] = value
        current = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": moments,
                                        "param_groups": current["param_groups"]})


class TorchModel(Model):
    """A torch model as the learner holds one (the numpy MLP's is `algorithm.Model`): the
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
        from stepbus.trainer import torch_recurrent  # which imports this module

        self.memory = acting.memory
        default = TorchPPO if self.memory is None else torch_recurrent.RecurrentPPO
        algo_class = default if algo in DEFAULT_ALGOS else algorithm.load(algo)
        given = {"spec": self.spec} if algo_class is default else {}
        self.initial = acting.initial_state(1) if self.memory is not None else {}
        try:
            self.torch_algo = algo_class(self.module, self.action, config,
                                         np.random.default_rng(seed), **given)
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

    def curriculum(self, stats: dict[str, float]) -> dict | None:
        hook = getattr(self.torch_algo, "curriculum", None)
        return hook(stats) if callable(hook) else None

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
