"""PPO on trajectories that arrive in pieces from many workers.

Reads top to bottom: GAE, the update, the default algorithm `PPO`. The config and the
trajectory record it learns from are the plug-in interface's (trainer/algorithm.py).
Semantics follow SB3's PPO (clipped surrogate, per-minibatch advantage normalisation, global
grad-norm clipping, Adam eps 1e-5), except that the critic is re-evaluated with the current
params before GAE, because data on a bus can be a few policy versions old.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from stepbus.models.mlp import (
    Adam,
    Net,
    clip_grad_norm,
    infer_action_space,
    init_params,
    ppo_loss_and_grads,
    value,
)
from stepbus.policy import ActionSpace, Params
from stepbus.trainer import epochs
from stepbus.trainer.algorithm import PPOConfig, Trajectory

__all__ = ["PPO", "PPOConfig", "Trajectory", "compute_gae", "gae", "masks_of", "net_of",
           "ppo_update"]


def net_of(config: PPOConfig) -> Net:
    """The MLP's make beyond its widths, from the run's settings."""
    return Net(config.activation, config.log_std_init, config.ortho_init)


def compute_gae(
    trajs: Sequence[Trajectory], params: Params, cfg: PPOConfig
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns), float64, concatenated in trajectory order.

    All values, bootstrap ones included, come from one forward pass with the current critic, so
    stale behaviour values never enter the targets. A trajectory with `bootstrap_from_last`
    carries its last step's observation as `bootstrap_obs`, so its bootstrap is that step's
    value, as it should be: this critic has no memory for the repeat to disturb.
    """
    trajs = [t for t in trajs if len(t)]
    if not trajs:
        return np.zeros(0), np.zeros(0)
    obs_dim = np.asarray(trajs[0].bootstrap_obs).size
    all_obs = np.concatenate(
        [np.asarray(t.obs).reshape(len(t), obs_dim) for t in trajs]
        + [np.stack([np.asarray(t.bootstrap_obs).reshape(obs_dim) for t in trajs])]
    )
    return gae(trajs, value(params, all_obs), cfg)


def gae(trajs: Sequence[Trajectory], all_values: np.ndarray, cfg: PPOConfig
        ) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns) from the critic's values of every step of `trajs` in order, then
    of each trajectory's bootstrap observation: the part of GAE every model kind shares."""
    lengths = np.array([len(t) for t in trajs])
    n, n_traj = int(lengths.sum()), len(trajs)
    values, boot_values = all_values[:n], all_values[n:]
    boot_values[[t.terminated for t in trajs]] = 0.0

    # next-state value: the following step inside a trajectory, the bootstrap at its end
    ends = np.cumsum(lengths) - 1
    next_values = np.empty(n)
    next_values[:-1] = values[1:]
    next_values[ends] = boot_values
    rewards = np.concatenate([np.asarray(t.rewards, dtype=np.float64) for t in trajs])
    deltas = rewards + cfg.gamma * next_values - values

    # discounted reverse cumsum of deltas per trajectory, vectorised across trajectories on a
    # zero-padded (n_traj, T_max) grid; zeros past the end make the recursion stop there
    rows = np.repeat(np.arange(n_traj), lengths)
    cols = np.arange(n) - np.repeat(ends - lengths + 1, lengths)
    grid = np.zeros((n_traj, int(lengths.max()) + 1))
    grid[rows, cols] = deltas
    decay = cfg.gamma * cfg.gae_lambda
    for t in range(grid.shape[1] - 2, -1, -1):
        grid[:, t] += decay * grid[:, t + 1]
    advantages = grid[rows, cols]
    return advantages, advantages + values


def ppo_update(
    params: Params,
    adam: Adam,
    trajs: Sequence[Trajectory],
    cfg: PPOConfig,
    rng: np.random.Generator,
    lr: float | None = None,
    clip_range: float | None = None,
    action: ActionSpace | None = None,
    tick: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Run ``cfg.n_epochs`` of minibatch PPO on ``trajs``, updating ``params`` in place.

    ``lr`` / ``clip_range`` override the config (for schedules). ``action`` defaults to what the
    params imply (discrete if there is no ``log_std``). ``tick`` is called after every gradient
    step, so a process can keep heartbeating through a long update. Returns stats averaged over
    all gradient steps, plus the explained variance of the recomputed critic.
    """
    trajs = [t for t in trajs if len(t)]
    if not trajs:
        return {}
    action = infer_action_space(params) if action is None else action
    batch = _Batch.of(trajs, params, cfg, action)
    step_lr = cfg.lr if lr is None else lr
    step_clip = cfg.clip_range if clip_range is None else clip_range

    def step(mb_inds: np.ndarray) -> dict[str, float]:
        return _gradient_step(params, adam, batch, mb_inds, cfg, action, lr=step_lr,
                              clip_range=step_clip)

    return epochs.run(step, items=batch.n,
                      minibatches=epochs.minibatch_count(batch.n, cfg.minibatch_size),
                      n_epochs=cfg.n_epochs, rng=rng, advantages=batch.b_adv,
                      returns=batch.b_returns, tick=tick, target_kl=cfg.target_kl)


def masks_of(trajs: Sequence[Trajectory], action: ActionSpace) -> np.ndarray | None:
    """Every step's action mask, (N, action.dim) bool, or None when no trajectory has one."""
    if all(t.action_mask is None for t in trajs):
        return None
    return np.concatenate([np.ones((len(t), action.dim), bool) if t.action_mask is None
                           else t.action_mask for t in trajs])


@dataclass
class _Batch:
    """One update's samples, flattened across trajectories, with GAE targets."""

    b_obs: np.ndarray
    b_actions: np.ndarray
    b_logp: np.ndarray
    b_adv: np.ndarray
    b_returns: np.ndarray
    b_mask: np.ndarray | None = None

    @classmethod
    def of(
        cls, trajs: Sequence[Trajectory], params: Params, cfg: PPOConfig, action: ActionSpace
    ) -> _Batch:
        b_obs = np.concatenate([np.asarray(t.obs).reshape(len(t), -1)
                                for t in trajs]).astype(np.float64)
        b_actions = np.concatenate([np.asarray(t.actions).reshape(len(t), -1) for t in trajs])
        if action.kind == "discrete":
            b_actions = b_actions[:, 0]
        b_mask = masks_of(trajs, action)
        b_logp = np.concatenate([np.asarray(t.logp, dtype=np.float64) for t in trajs])
        b_adv, b_returns = compute_gae(trajs, params, cfg)
        return cls(b_obs, b_actions, b_logp, b_adv, b_returns, b_mask)

    @property
    def n(self) -> int:
        return len(self.b_adv)


def _gradient_step(
    params: Params,
    adam: Adam,
    batch: _Batch,
    mb_inds: np.ndarray,
    cfg: PPOConfig,
    action: ActionSpace,
    *,
    lr: float,
    clip_range: float,
) -> dict[str, float]:
    """One clipped-surrogate Adam step on the minibatch ``mb_inds``; its loss stats."""
    mb_adv = batch.b_adv[mb_inds]
    if len(mb_adv) > 1:  # torch's unbiased std, as SB3
        mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std(ddof=1) + 1e-8)
    stats, grads = ppo_loss_and_grads(
        params,
        action,
        batch.b_obs[mb_inds],
        batch.b_actions[mb_inds],
        batch.b_logp[mb_inds],
        mb_adv,
        batch.b_returns[mb_inds],
        clip_range=clip_range,
        ent_coef=cfg.ent_coef,
        vf_coef=cfg.vf_coef,
        mask=None if batch.b_mask is None else batch.b_mask[mb_inds],
        old_values=batch.b_returns[mb_inds] - batch.b_adv[mb_inds],
        clip_range_vf=cfg.clip_range_vf,
    )
    stats["grad_norm"] = clip_grad_norm(grads, cfg.max_grad_norm)
    adam.step(params, grads, lr)
    return stats


class PPO:
    """The default learning algorithm of the learner process (`--algo`).

    Any class that implements trainer/algorithm.py's `Algorithm` can replace it: `--algo
    module:Class`, also in a live `stepbus trainer swap`. `params` must keep
    `stepbus.models.mlp`'s layout, because the broker serves the policy from them; they are
    updated in place.
    """

    def __init__(self, obs_dim: int, action: ActionSpace, config: PPOConfig,
                 rng: np.random.Generator) -> None:
        self.config, self.action, self.rng = config, action, rng
        self.params: Params = init_params(obs_dim, action, config.hidden, rng, net_of(config))
        self.adam = Adam(lr=config.lr)
        self.lr = config.lr

    def set_learning_rate(self, lr: float) -> None:
        """For the next updates (--anneal-lr: the learner lowers it as the run goes on)."""
        self.lr = lr

    def update(self, batch: Sequence[Trajectory],
               tick: Callable[[], object] | None = None) -> dict[str, float]:
        return ppo_update(self.params, self.adam, batch, self.config, self.rng,
                          lr=self.lr, action=self.action, tick=tick)

    def optimizer_state(self) -> dict[str, np.ndarray]:
        state = {f"m/{k}": v for k, v in self.adam.m.items()}
        state |= {f"v/{k}": v for k, v in self.adam.v.items()}
        state["t"] = np.array(self.adam.t)
        return state

    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        """Moments from a checkpoint; keys another algorithm wrote are ignored."""
        self.adam.m = {k[2:]: v for k, v in state.items() if k.startswith("m/")}
        self.adam.v = {k[2:]: v for k, v in state.items() if k.startswith("v/")}
        self.adam.t = int(state["t"]) if "t" in state else 0
