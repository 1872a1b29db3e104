"""PPO for torch models (`--model torch` or your own module), as trainer/ppo.py does it for the
numpy MLP: the same clipped surrogate, per-minibatch advantage normalisation, squared-error
value loss, entropy bonus, global grad-norm clip and Adam (eps 1e-5), the same equal
minibatches and GAE with the critic re-evaluated on the current weights, the same metrics
figures. It is the learner's algorithm when `--model` is not mlp and `--algo` is the default.

Reads top to bottom: GAE on the module's values, the batch, one gradient step, and `TorchPPO`
(its loss and optimiser are trainer/torch_base.py's, its epochs trainer/epochs.py's). What the
learner holds of a torch model is trainer/torch_model.py's `TorchModel`.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from stepbus.bus import protocol as p
from stepbus.bus import rows
from stepbus.models import torch_policy
from stepbus.policy import ActionSpace
from stepbus.trainer import epochs, ppo
from stepbus.trainer.algorithm import PPOConfig, Trajectory
from stepbus.trainer.torch_base import Taken, Targets, TorchAlgorithm, loss_step

VALUE_CHUNK_ROWS = 1024  # the critic's pass over a batch goes in chunks of this many rows


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
    `trainer.ppo.compute_gae`: every value, bootstrap ones included, from the current critic
    (with `bootstrap_from_last`, V(bootstrap_obs) is the last step's value: no memory here).
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
    b_mask: torch.Tensor | None = None

    @classmethod
    def of(cls, trajs: Sequence[Trajectory], adv: np.ndarray, returns: np.ndarray,
           action: ActionSpace, device: torch.device) -> _Batch:
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
        return cls(b_obs, b_actions, b_logp, torch.from_numpy(adv.astype(np.float32)).to(device),
                   torch.from_numpy(returns.astype(np.float32)).to(device), b_mask)

    @property
    def n(self) -> int:
        return len(self.b_adv)


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
                             batch.b_returns[mb_inds],
                             values=batch.b_returns[mb_inds] - batch.b_adv[mb_inds]))


class TorchPPO(TorchAlgorithm):
    """The learner's algorithm for a feed-forward torch model. Another one (`--algo
    module:Class` with a torch --model) is built the same way, `(module, action, config, rng)`,
    trains `module` in place, and has `update`, `optimizer_state` and `load_optimizer_state`
    (tensors by name)."""

    def update(self, batch: Sequence[Trajectory],
               tick: Callable[[], object] | None = None) -> dict[str, float]:
        """`config.n_epochs` of minibatch PPO on `batch`; stats averaged over the gradient
        steps, the explained variance of the critic it started from, the sample count."""
        trajs = [t for t in batch if len(t)]
        if not trajs:
            return {}
        cfg = self.config
        adv, returns = compute_gae(trajs, self.module, cfg, self.device, self.spec)
        data = _Batch.of(trajs, adv, returns, self.action, self.device)

        def step(mb_inds: np.ndarray) -> dict[str, float]:
            return gradient_step(self.module, self.optimizer, data,
                                 torch.from_numpy(mb_inds).to(self.device), cfg, self.spec)

        return epochs.run(step, items=data.n,
                          minibatches=epochs.minibatch_count(data.n, cfg.minibatch_size),
                          n_epochs=cfg.n_epochs, rng=self.rng, advantages=adv,
                          returns=returns, tick=tick, target_kl=cfg.target_kl)
