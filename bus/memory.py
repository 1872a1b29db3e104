"""Each agent's recurrent state, as the broker holds it for a recurrent model.

Keyed by worker, its incarnation, and row (an env, or an agent of a multi-agent env). A row
starts from the model's initial state (`Policy.initial_state`, never zeros unless the model
says so) whenever its observation starts something new:

- the agent first appears: a worker not seen before, or an agent of a parallel env that was
  not acting at the previous step;
- a new incarnation of the worker (it restarted: every env is new);
- a reset: the first result after a RESET (a reset barrier, a new broker);
- an episode's end (the row's observation is the next episode's first).

A row whose agent finished or vanished (not alive) goes back to the initial state too, which is
dropping it: nothing of that agent is kept. A lost worker's states are dropped whole. New weights
leave the states as they are: a policy version changes several times a second, and cutting
every agent's memory at each would make the memory useless; a state made by the previous
version is a few gradient steps off, the same staleness PPO's clipping already allows for the
actions (Sample Factory and SEED RL also carry states across weight updates).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from stepbus.bus import protocol as p

State = dict[str, np.ndarray]


@dataclass
class Held:
    """One worker incarnation's states, one row per row of its batch."""

    incarnation: str
    state: State
    alive: np.ndarray  # rows that acted at the last step
    # The result (its seq) whose states are made ready and not acted on yet: a model that
    # failed on it leaves them so, and the broker acts on the same result again.
    prepared: int | None = None


@dataclass
class Memory:
    """The states of every worker's agents; `initial(n)` makes n rows of the initial state."""

    initial: Callable[[int], State]
    held: dict[str, Held] = field(default_factory=dict)
    resets: collections.Counter[str] = field(default_factory=collections.Counter)

    def before_step(self, worker: str, incarnation: str, r: p.StepResult, rows: int) -> State:
        """The state each row acts from on `r`'s observations: what it held after the last
        step, or the initial state where something new starts (the module docstring). The
        same result again (the model failed on it, and it is acted on anew) finds its states
        as they were made ready for it: restarted once, counted once."""
        held = self.held.get(worker)
        if held is not None and held.incarnation == incarnation and held.prepared == r.seq:
            return held.state
        if held is None or held.incarnation != incarnation or r.first:
            why = ("first appearance" if held is None else "reset" if r.first
                   and held.incarnation == incarnation else "new incarnation")
            self.count(why, rows)
            held = self.held[worker] = Held(incarnation, self.initial(rows), np.ones(rows, bool),
                                            r.seq)
            if r.alive is not None:
                held.alive = r.alive.copy()
            return held.state
        held.prepared = r.seq
        fresh = r.terminated | r.truncated
        self.count("episode end", int(fresh.sum()))
        if r.alive is not None:
            appeared, gone = r.alive & ~held.alive, ~r.alive & held.alive
            self.count("first appearance", int(appeared.sum()))
            self.count("vanished or finished", int((gone & ~fresh).sum()))
            fresh = fresh | appeared | gone
            held.alive = r.alive.copy()
        if fresh.any():
            index = np.flatnonzero(fresh)
            start = self.initial(len(index))
            for key, value in held.state.items():
                value[index] = start[key]
        return held.state

    def count(self, why: str, n: int) -> None:
        if n:
            self.resets[why] += n

    def after_step(self, worker: str, state: State) -> None:
        """The states the model returned for this worker's rows: what it acts from next.
        Replaced, not written into: the state before this step may still be on its way to the
        assembler, zero-copy."""
        held = self.held[worker]
        held.state, held.prepared = state, None

    def drop(self, worker: str) -> None:
        """A lost worker: its states go (a new incarnation starts from the initial state)."""
        if self.held.pop(worker, None) is not None:
            self.count("worker lost", 1)

    def figures(self) -> dict[str, int]:
        """What is held: agents (rows) and bytes, bounded by the workers served."""
        return {"memory_agents": sum(len(h.alive) for h in self.held.values()),
                "memory_bytes": sum(v.nbytes for h in self.held.values()
                                    for v in h.state.values())}
