"""What `--algo module:Class` implements, and the types it is given: a plug-in needs this
module only. It imports no implementation, so an algorithm of one's own depends on the
contract, not on the PPO that happens to be the default (trainer/ppo.py, trainer/torch_ppo.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from stepbus import imports
from stepbus.bus import wiring
from stepbus.bus.rows import Obs


class CannotStart(Exception):
    """The learner cannot run with these settings: it exits with code 2 (and a trainer slot
    reverts a swap to them)."""


ACTIVATIONS = ("tanh", "relu")  # the built-in MLP's (models/mlp.py), named here for the flag


def _activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"--activation {name!r}: one of {', '.join(ACTIVATIONS)}")


@dataclass
class PPOConfig:
    """The hyperparameters every algorithm is built with (`--gamma`, `--lr`, ...); defaults
    are rl-zoo's SB3 PPO settings for CartPole-v1. An algorithm uses what it needs of them."""

    gamma: float = field(default=0.98, metadata={"min": 0, "max": 1})
    """Discount factor."""
    gae_lambda: float = field(default=0.8, metadata={"min": 0, "max": 1})
    """GAE bias/variance trade-off (1 = Monte Carlo, 0 = one-step TD)."""
    clip_range: float = field(default=0.2, metadata={"above": 0})
    """PPO ratio clip, constant (rl-zoo's linear decay to 0 measured no better here)."""
    ent_coef: float = field(default=0.0, metadata={"min": 0})
    """Entropy bonus weight."""
    vf_coef: float = field(default=0.5, metadata={"min": 0})
    """Value loss weight in the shared loss (the nets are separate, so it scales critic lr)."""
    lr: float = field(default=1e-3, metadata={"above": 0, "flag": "learning_rate",
                                              "aliases": ("lr",)})
    """Adam learning rate, constant (rl-zoo's linear decay to 0 measured no better here)."""
    n_epochs: int = field(default=20, metadata={"min": 1})
    """Passes over each batch."""
    minibatch_size: int = field(default=256, metadata={"min": 1, "flag": "batch_size",
                                                       "aliases": ("minibatch_size",)})
    """Target samples per gradient step; a batch of n is split into round(n / this) equal
    minibatches, so with batch_steps equal to it each epoch is one full-batch step."""
    batch_steps: int = field(default=256, metadata={"min": 1})
    """Env steps collected per update (rl-zoo: 8 envs x n_steps 32)."""
    max_grad_norm: float = field(default=0.5, metadata={"above": 0})
    """Global L2 grad-norm clip."""
    hidden: tuple[int, ...] = field(default=(64, 64), metadata={"min": 1})
    """Hidden widths of both the policy and value MLPs."""
    activation: str = field(default="tanh", metadata={wiring.CHECK: _activation})
    """The MLP's hidden layers: tanh or relu (SB3's activation_fn)."""
    log_std_init: float = 0.0
    """The MLP's Gaussian log-std at the start (SB3's log_std_init)."""
    ortho_init: bool = True
    """The MLP's orthogonal init with SB3's gains; --no-ortho-init: PyTorch's default for a
    Linear layer (SB3's ortho_init)."""
    anneal_lr: bool = False
    """Learning rate falling linearly to 0 over --max-env-steps (CleanRL's anneal_lr); the
    learner sets it before each update (`set_learning_rate`), from the env steps learned."""
    target_kl: float | None = field(default=None, metadata={"above": 0,
                                                             "default_help": "none"})
    """Stop an update's epochs once one's mean approximate KL exceeds this (CleanRL's
    target_kl)."""
    clip_range_vf: float | None = field(default=None, metadata={"above": 0,
                                                                 "default_help": "none"})
    """Clip the value loss around the values the update started from, as the policy's ratio
    is (SB3's clip_range_vf; CleanRL's clip_vloss with clip_coef)."""


@dataclass
class Trajectory:
    """One agent's contiguous steps, cut at an episode end or at an arbitrary horizon.

    ``bootstrap_obs`` is the observation after the last step. If ``terminated`` its value is
    taken as 0; otherwise (``truncated`` by a time limit or a cut, or a plain horizon cut with
    both flags False) the return is bootstrapped with V(bootstrap_obs). With
    ``bootstrap_from_last`` no observation follows the last step (its agent vanished, or its
    env raised): ``bootstrap_obs`` is then the last step's own observation, so a feed-forward
    critic's V(bootstrap_obs) is the last step's value, and a recurrent one takes the value of
    the last step of its replay instead of feeding that observation again.
    """

    obs: Obs
    """(T, *obs_shape) observations the actions were taken in: for the numpy MLP flat rows
    (`spaces.flatten`), for a torch model as they travel (one array, or a map of leaves)."""
    actions: np.ndarray
    """(T,) int for discrete, (T, *action_shape) float for box or int for the multi kinds,
    unclipped as sampled."""
    logp: np.ndarray
    """(T,) behaviour-policy log-probs of ``actions``, used for the importance ratio."""
    values: np.ndarray
    """(T,) behaviour critic values; informational, GAE recomputes them."""
    rewards: np.ndarray
    """(T,) rewards."""
    terminated: bool
    """The last step ended the episode in a terminal state (no bootstrap)."""
    truncated: bool
    """The last step ended the episode by a time limit (bootstrap from ``bootstrap_obs``)."""
    bootstrap_obs: Obs
    """(*obs_shape) observation following the last step (with ``bootstrap_from_last``: the
    last step's own)."""
    assembler: str = ""
    """The assembler incarnation that numbered it (empty: not from the bus)."""
    seq: int = -1
    """Its number: with ``assembler``, which trajectory an update learned from."""
    action_mask: np.ndarray | None = None
    """(T, action dim) bool: the actions the env allowed at each step (None: all)."""
    state: dict[str, np.ndarray] | None = None
    """A recurrent model's state before the first step (None: a feed-forward model)."""
    bootstrap_from_last: bool = False
    """No observation follows the last step (its agent vanished, or its env raised): bootstrap
    from the last step's own value; ``bootstrap_obs`` is that step's observation."""

    def __len__(self) -> int:
        return len(self.rewards)


class Algorithm(Protocol):
    """What `--algo` names: a class built as `(obs_dim, action, config, rng)` (`obs_dim`: the
    width of `spaces.flatten`'s rows, which its trajectories' observations are; `action`: a
    `stepbus.policy.ActionSpace`; `config`: a `PPOConfig`) whose instances have this.
    `params` keep `stepbus.models.mlp`'s layout (the broker acts with them) and are updated in
    place. `update` calls `tick` after every gradient step, so a long update keeps the learner
    heartbeating, and returns the figures that go into the metrics. An optional
    `curriculum(stats) -> options | None` asks, after an update, for a reset barrier with env
    options (as `stepbus reset --option` does); an optional `set_learning_rate(lr)` takes the
    rate a schedule (--anneal-lr) gives the next updates. A `Trajectory` whose
    `bootstrap_from_last` is set has no observation after its last step: bootstrap from that
    step's value (V(bootstrap_obs) is it for a critic without memory).

    With a torch `--model` the class is built as `(module, action, config, rng)` instead,
    trains `module` in place and has no `params`; its optimiser state is tensors by name."""

    params: dict[str, np.ndarray]

    def update(self, batch: Sequence[Trajectory],
               tick: Callable[[], object] | None = None) -> dict[str, float]: ...

    def optimizer_state(self) -> dict[str, np.ndarray]: ...

    def load_optimizer_state(self, state: dict[str, np.ndarray]) -> None: ...


AlgorithmClass = Callable[..., Algorithm]


def load(path: str) -> AlgorithmClass:
    """The class `--algo` names. Raises CannotStart."""
    try:
        algo_class: AlgorithmClass = imports.load_object(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise CannotStart(f"cannot load --algo {path}: {type(exc).__name__}: {exc}") from exc
    return algo_class
