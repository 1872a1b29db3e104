"""PPO through time for a recurrent torch model (`--model torch-lstm`, or a module of your own
with `initial_state`): the same loss, optimiser and figures as `torch_ppo.TorchPPO`
(trainer/torch_base.py, trainer/epochs.py), on whole trajectories replayed from the state their
first step was acted from.

A trajectory never crosses an episode's end (the assembler cuts it there), and the broker
restarts an agent's state from `initial_state` wherever a new episode starts, so each
trajectory is replayed from its own first state (`Trajectory.state`, kept by the assembler)
with `done` all False. Minibatches hold whole trajectories, padded at the end to the longest
one (padding after the last real step cannot change the steps before it) and left out of every
mean; values for GAE, the bootstrap included, come from replaying each trajectory one step
further, through its bootstrap observation, with the current weights. A trajectory with
`bootstrap_from_last` (no observation follows its last step: its agent vanished without one,
or its env raised) is replayed through its own steps only and bootstraps from its last step's
value: feeding its last observation again would advance the memory through a step that never
happened.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from stepbus.bus import protocol as p
from stepbus.bus import rows
from stepbus.models import torch_policy
from stepbus.policy import ActionSpace, State
from stepbus.trainer import epochs, ppo
from stepbus.trainer.algorithm import PPOConfig, Trajectory
from stepbus.trainer.torch_base import Taken, Targets, TorchAlgorithm, loss_step

GAE_GROUP = 64  # trajectories replayed together for the critic's values


def padded(parts: Sequence[np.ndarray], length: int) -> np.ndarray:
    """(length * N, ...) time-major: part j's rows at [t * N + j], its last row repeated
    after its end (a valid observation, unlike zeros, for any space)."""
    n = len(parts)
    first = parts[0]
    out = np.empty((length, n, *first.shape[1:]), first.dtype)
    for j, part in enumerate(parts):
        out[:len(part), j] = part
        out[len(part):, j] = part[-1]
    return out.reshape(length * n, *first.shape[1:])


def padded_obs(obs: Sequence[p.Obs], length: int) -> p.Obs:
    if isinstance(obs[0], dict):
        return {k: padded([o[k] for o in obs], length) for k in obs[0]}
    return padded(obs, length)  # type: ignore[arg-type]


def states_of(trajs: Sequence[Trajectory]) -> State:
    """Each trajectory's first state, one row each."""
    first = trajs[0].state or {}
    return {k: np.stack([t.state[k] for t in trajs if t.state is not None]) for k in first}


@dataclass
class Sequences:
    """Trajectories as padded, time-major tensors: what one forward pass through time takes."""

    obs: Any
    state: Any
    done: torch.Tensor
    valid: torch.Tensor
    length: int

    @classmethod
    def of(cls, trajs: Sequence[Trajectory], obs: Sequence[p.Obs], policy: Recurrent
           ) -> Sequences:
        """`obs`: each trajectory's observations (its steps, or its steps and bootstrap)."""
        length, n = max(rows.count(o) for o in obs), len(trajs)
        valid = np.zeros((length, n), np.float32)
        for j, o in enumerate(obs):
            valid[:rows.count(o), j] = 1.0
        device = policy.device
        return cls(torch_policy.module_input(policy.spec, padded_obs(obs, length), device),
                   policy.layout.module(states_of(trajs), device),
                   torch.zeros(length * n, dtype=torch.bool, device=device),
                   torch.from_numpy(valid.reshape(-1)).to(device), length)


@dataclass
class Recurrent:
    """What replaying needs of the model: the spaces, the state's layout, the device."""

    spec: p.SpaceSpec
    layout: torch_policy.StateLayout
    device: torch.device


class RecurrentPPO(TorchAlgorithm):
    """trainer/torch_ppo.py's `TorchPPO` for a module with `initial_state`: minibatches of
    whole trajectories, each replayed from its first state (the module docstring)."""

    def __init__(self, module: nn.Module, action: ActionSpace, config: PPOConfig,
                 rng: np.random.Generator, *, spec: p.SpaceSpec | None = None) -> None:
        super().__init__(module, action, config, rng, spec=spec)
        assert spec is not None, "a recurrent model's learner knows the spaces"
        self.replay = Recurrent(spec, torch_policy.StateLayout(module), self.device)

    def values(self, trajs: Sequence[Trajectory]) -> np.ndarray:
        """The critic's values of every step then of every bootstrap (the replay's next
        step, or with `bootstrap_from_last` its last one), as `ppo.gae` takes them."""
        steps, boots = [], []
        agent = torch_policy.recurrent_agent(self.module)
        for start in range(0, len(trajs), GAE_GROUP):
            group = trajs[start:start + GAE_GROUP]
            obs = [t.obs if t.bootstrap_from_last
                   else rows.concat([t.obs, rows.stack([t.bootstrap_obs])]) for t in group]
            seq = Sequences.of(group, obs, self.replay)
            with torch.no_grad():
                v = (agent.get_value(seq.obs, seq.state, seq.done).reshape(seq.length, -1)
                     .double().cpu().numpy())
            for j, t in enumerate(group):
                steps.append(v[:len(t), j])
                boots.append(v[len(t) - 1 if t.bootstrap_from_last else len(t), j])
        return np.concatenate([*steps, np.asarray(boots)])

    def update(self, batch: Sequence[Trajectory],
               tick: Callable[[], object] | None = None) -> dict[str, float]:
        trajs = [t for t in batch if len(t)]
        if not trajs:
            return {}
        adv, returns = ppo.gae(trajs, self.values(trajs), self.config)
        ends = np.cumsum([len(t) for t in trajs])
        parts = [(adv[e - len(t):e], returns[e - len(t):e]) for t, e in zip(trajs, ends,
                                                                           strict=True)]

        def step(group: np.ndarray) -> dict[str, float]:
            return self.sequence_step([trajs[i] for i in group], [parts[i] for i in group])

        minibatches = epochs.minibatch_count(len(adv), self.config.minibatch_size,
                                             most=len(trajs))
        return epochs.run(step, items=len(trajs), minibatches=minibatches,
                          n_epochs=self.config.n_epochs, rng=self.rng, advantages=adv,
                          returns=returns, tick=tick, target_kl=self.config.target_kl)

    def sequence_step(self, trajs: list[Trajectory],
                      targets: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
        """One Adam step on whole trajectories, replayed through time from their first
        states."""
        seq = Sequences.of(trajs, [t.obs for t in trajs], self.replay)
        device, length = self.device, seq.length

        def steps(arrays: Sequence[np.ndarray], dtype: Any) -> torch.Tensor:
            return torch.from_numpy(padded([np.asarray(a) for a in arrays], length)
                                    .astype(dtype)).to(device)

        action_dtype = np.float32 if self.action.kind == "box" else np.int64
        masks = ppo.masks_of(trajs, self.action)
        mask = {} if masks is None else {"action_mask": steps(
            np.split(masks, np.cumsum([len(t) for t in trajs])[:-1]), bool)}
        _, logp, entropy, value, _ = torch_policy.recurrent_agent(self.module) \
            .get_action_and_value(seq.obs, seq.state, seq.done,
                                  steps([t.actions for t in trajs], action_dtype), **mask)
        return loss_step(self.module, self.optimizer, self.config, Taken(logp, entropy, value),
                         Targets(steps([t.logp for t in trajs], np.float32),
                                 steps([a for a, _ in targets], np.float32),
                                 steps([r for _, r in targets], np.float32), seq.valid,
                                 values=steps([r - a for a, r in targets], np.float32)))
