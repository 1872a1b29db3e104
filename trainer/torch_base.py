"""What the torch PPOs share (trainer/torch_ppo.py's feed-forward one, trainer/torch_recurrent.py's
through time): PPO's loss and its Adam step with the gradient norm clipped, the figures it
reports, and the optimiser with its state by parameter name for the checkpoint. Each of them
imports this module, never the other."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from stepbus.bus import protocol as p
from stepbus.policy import ActionSpace
from stepbus.trainer.algorithm import PPOConfig

STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "loss",
         "grad_norm")


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
    values: torch.Tensor | None = None  # the critic's when the update began (value clipping)


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
    value_loss = mean(_value_sq(taken.value.reshape(-1), targets, cfg.clip_range_vf))
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



def _value_sq(value: torch.Tensor, targets: Targets, clip: float | None) -> torch.Tensor:
    """(V - R)^2, or with a clip the larger of it and (V_clip - R)^2, V_clip the value the
    update began from moved at most `clip` towards V (trainer/ppo.py's numpy loss, alike)."""
    sq = (value - targets.returns) ** 2
    if clip is None or targets.values is None:
        return sq
    clipped = targets.values + torch.clamp(value - targets.values, -clip, clip)
    return torch.max(sq, (clipped - targets.returns) ** 2)


class TorchAlgorithm:
    """A torch PPO's optimiser, built as every torch algorithm is, `(module, action, config,
    rng)`: Adam (eps 1e-5) on the module's parameters, its state saved and restored by
    parameter name. Subclasses add `update`."""

    def __init__(self, module: nn.Module, action: ActionSpace, config: PPOConfig,
                 rng: np.random.Generator, *, spec: p.SpaceSpec | None = None) -> None:
        """`spec`: how observations that travel as a map of leaves nest for the module."""
        self.module, self.action, self.config, self.rng = module, action, config, rng
        self.spec = spec
        self.device = next(module.parameters()).device
        self.optimizer = torch.optim.Adam(module.parameters(), lr=config.lr, eps=1e-5)

    def set_learning_rate(self, lr: float) -> None:
        """For the next updates (--anneal-lr: the learner lowers it as the run goes on)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

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

