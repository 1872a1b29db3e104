"""The epoch/minibatch loop every PPO here runs (numpy, torch, through time) and the figures it
reports: written once, so the three draw their minibatches alike from the same RNG and name
their statistics alike in the metrics."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Step = Callable[[np.ndarray], dict[str, float]]
"""One gradient step on the minibatch of these indices; its loss figures."""


def minibatch_count(samples: int, size: int, most: int | None = None) -> int:
    """Into how many equal minibatches a batch of `samples` goes: round(samples / size), at
    least one, at most `most` (minibatches of whole trajectories cannot outnumber them).

    Batches off the bus overshoot batch_steps by part of a trajectory. Splitting into equal
    parts avoids SB3's ragged last minibatch, which here would be a few samples normalised by
    their own std and given a full Adam step; at samples == k * size it is SB3 exactly."""
    count = max(1, round(samples / size))
    return count if most is None else max(1, min(most, count))


def run(step: Step, *, items: int, minibatches: int, n_epochs: int, rng: np.random.Generator,
        advantages: np.ndarray, returns: np.ndarray,
        tick: Callable[[], object] | None = None,
        target_kl: float | None = None) -> dict[str, float]:
    """`n_epochs` passes over `items` (samples, or whole trajectories), each a fresh
    permutation split into `minibatches` equal parts, one `step` on each; `tick` after every
    step, so a process keeps heartbeating through a long update; no more epochs once one's
    mean `approx_kl` exceeds `target_kl`. The figures: each step's averaged over all steps,
    then the critic's (`critic_stats` of the batch's GAE targets), the number of steps and of
    epochs run."""
    totals: dict[str, float] = {}
    n_steps = epochs_run = 0
    for _epoch in range(n_epochs):
        kl_before, steps_before = totals.get("approx_kl", 0.0), n_steps
        for indices in np.array_split(rng.permutation(items), minibatches):
            for key, val in step(indices).items():
                totals[key] = totals.get(key, 0.0) + val
            n_steps += 1
            if tick is not None:
                tick()
        epochs_run += 1
        epoch_kl = (totals.get("approx_kl", 0.0) - kl_before) / (n_steps - steps_before)
        if target_kl is not None and epoch_kl > target_kl:
            break
    means = {key: val / n_steps for key, val in totals.items()}
    return means | critic_stats(advantages, returns) | {"n_grad_steps": float(n_steps),
                                                        "n_epochs_run": float(epochs_run)}


def critic_stats(advantages: np.ndarray, returns: np.ndarray) -> dict[str, float]:
    """Explained variance of the returns by the critic the update started from (its values
    are returns - advantages): 1 = it explains them, 0 = no better than their mean (also when
    they are constant); and the sample count."""
    values = returns - advantages
    var_returns = float(np.var(returns))
    explained = (1.0 - float(np.var(returns - values)) / var_returns
                 if var_returns > 0 else 0.0)
    return {"explained_variance": explained, "n_samples": float(len(advantages))}
