"""A recurrent model's memory in the broker, in-process: every case where an agent's state must
start again from the model's initial state (never zeros), and what the assembler keeps of it.
The policy here counts steps in its state, starting from 100, and reports the count it acted
from as its value, so each row's value says which state the broker acted with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from test_broker_state import OBS_DIM, Bench

from stepbus.bus import protocol as p
from stepbus.policy import ModelConfig, Policy, State
from stepbus.processor.buffers import WorkerTrack

START = 100.0  # the initial state: a zero-filled state would show as 0


class Counter(Policy):
    """Acts 0 from a per-row counter, which each step adds one to."""

    @property
    def recurrent(self) -> bool:
        return True

    def initial_state(self, n: int) -> State:
        return {"count": np.full((n, 1), START)}

    def prepare(self, params: Mapping[str, np.ndarray]) -> None:
        pass

    def act(self, obs: p.Obs, rng: np.random.Generator, deterministic: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise AssertionError("a recurrent policy is asked to act_recurrent")

    def act_recurrent(self, obs: p.Obs, state: State, rng: np.random.Generator,
                      deterministic: bool = False
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, State]:
        count = state["count"][:, 0]
        n = len(count)
        return (np.zeros(n, np.int64), np.zeros(n, np.float32), count.astype(np.float32),
                {"count": state["count"] + 1})

    def weights_problem(self, params: Mapping[str, np.ndarray]) -> str:
        return ""


def bench(**cfg: Any) -> Bench:
    made = Bench(models=ModelConfig(model="test_memory:Counter"), **cfg)
    return made


def acted_from(b: Bench) -> list[list[float]]:
    """The state each EXPERIENCE's rows were acted from (its values), oldest first; and the
    state the message carries must be the same."""
    out = []
    for sent in b.out.take_sent(p.Experience):
        m = sent.msg
        assert isinstance(m, p.Experience)
        if m.value is not None:
            assert m.state["count"][:, 0].tolist() == m.value.tolist()
            out.append(m.value.tolist())
    return out


def answer(b: Bench, w: bytes, result: p.StepResult | None = None) -> None:
    """The worker's reply to its last command (or `result`), and the broker's tick."""
    b.deliver(w, result if result is not None else b.result(w))
    b.tick()


def start(b: Bench, name: str = "w0", **join: object) -> bytes:
    w = b.join(name, **join)  # type: ignore[arg-type]
    b.deliver(b"t", p.Weights(trainer="t", incarnation="t1", policy="default", version=1,
                              consumed_steps=0, batch_steps=256, starving=False,
                              params={"w": np.zeros(1)}))
    return w


def test_state_starts_at_the_models_initial_state_and_carries_from_step_to_step() -> None:
    b = bench()
    w = start(b)
    for _ in range(3):
        answer(b, w)
    assert acted_from(b) == [[START, START], [START + 1, START + 1], [START + 2, START + 2]]
    figures = b.broker.figures()
    assert figures["memory_agents"] == 2 and figures["memory_bytes"] == 16
    assert figures["memory_resets"] == {"first appearance": 2}


def test_an_episode_end_restarts_only_that_rows_state() -> None:
    b = bench()
    w = start(b)
    answer(b, w)
    answer(b, w)
    r = b.result(w)
    answer(b, w, p.StepResult(**{**r.__dict__, "terminated": np.array([True, False]),
                                 "final_obs": np.zeros((1, OBS_DIM), np.float32)}))
    assert acted_from(b)[-1] == [START, START + 2]


def test_a_new_incarnation_and_a_reset_start_every_row_again() -> None:
    b = bench()
    w = start(b)
    answer(b, w)
    answer(b, w)
    b.commands_to(w)  # what it was told before it restarted
    b.join("w0", incarnation="i2")  # the worker restarted: its reset comes next
    answer(b, w)
    assert acted_from(b)[-1] == [START, START]
    assert b.broker.figures()["memory_resets"]["new incarnation"] == 2
    answer(b, w)
    b.deliver(b"", p.Barrier(epoch=1, options={}))  # a reset barrier: RESET, then a first result
    b.tick()
    answer(b, w)  # the step in flight, drained
    answer(b, w)  # the reset's first result
    assert acted_from(b)[-1] == [START, START]
    assert b.broker.figures()["memory_resets"]["reset"] == 2


def test_a_lost_worker_drops_its_states() -> None:
    b = bench()
    w = start(b)
    answer(b, w)
    b.later(60)
    b.tick()
    figures = b.broker.figures()
    assert figures["workers"] == 0 and figures["memory_agents"] == 0
    assert figures["memory_resets"]["worker lost"] == 1


def test_agents_that_appear_vanish_and_come_back_start_from_the_initial_state() -> None:
    b = bench()
    w = start(b, agents=["a", "b"], num_envs=1)
    rows = [np.array([True, False]), np.array([True, True]), np.array([True, False]),
            np.array([True, True])]
    seen = []
    for alive in rows:
        r = b.result(w)
        answer(b, w, p.StepResult(**{**r.__dict__, "alive": alive}))
        seen.append(acted_from(b)[-1])
    # b appears at step 2, vanishes at 3 (its state dropped), comes back at 4 afresh.
    assert [row[1] for row in seen[1:]] == [START, START, START]
    assert [row[0] for row in seen] == [START, START + 1, START + 2, START + 3]


def test_a_trajectory_keeps_the_state_of_its_first_step_across_a_horizon_cut() -> None:
    b = bench()
    w = start(b)
    for _ in range(7):
        answer(b, w)
    msgs = [s.msg for s in b.out.take_sent(p.Experience)]
    track = WorkerTrack.start(msgs[0], horizon=3)
    trajs = []
    for m in msgs:
        assert isinstance(m, p.Experience)
        trajs += track.complete(m, 3).trajectories
        track.last_obs, track.seq = m.obs, m.seq
        track.choose(m)
    firsts = sorted({t.state["count"][0] for t in trajs})
    assert firsts == [START, START + 3], "each trajectory starts from its own first step"
    batch = p.Trajectories.of([t for t in trajs if t.agent.endswith("/0")])
    again = p.decode(p.encode(dataclasses_replace(batch)))
    assert isinstance(again, p.Trajectories)
    assert [t.state["count"][0] for t in again.split()] == [START, START + 3]


def dataclasses_replace(batch: p.Trajectories) -> p.Trajectories:
    import dataclasses

    return dataclasses.replace(batch, assembler="a", seqs=list(range(len(batch.seqs))))


class FlakyCounter(Counter):
    """A Counter whose weights {"w": [1]} make it raise while acting."""

    explode = False

    def prepare(self, params: Mapping[str, np.ndarray]) -> None:
        self.explode = bool(params["w"][0])

    def act_recurrent(self, obs: p.Obs, state: State, rng: np.random.Generator,
                      deterministic: bool = False
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, State]:
        if self.explode:
            raise FloatingPointError("probability tensor contains inf")
        return super().act_recurrent(obs, state, rng)


def test_a_batch_acted_on_again_after_the_model_failed_restarts_states_once() -> None:
    """Weights that fail to act are put aside and the same results acted on again: the
    states they act from are the ones the first try prepared, and each restart counts once."""
    b = Bench(models=ModelConfig(model="test_memory:FlakyCounter"))
    w = start(b)
    answer(b, w)
    answer(b, w)
    b.deliver(b"t", p.Weights(trainer="t", incarnation="t1", policy="default", version=2,
                              consumed_steps=0, batch_steps=256, starving=False,
                              params={"w": np.ones(1)}))
    r = b.result(w)
    answer(b, w, p.StepResult(**{**r.__dict__, "terminated": np.array([True, False]),
                                 "final_obs": np.zeros((1, OBS_DIM), np.float32)}))
    b.tick()  # version 2 raised; acted on again with version 1
    figures = b.broker.figures()
    assert figures["act_failures"] == 1
    assert acted_from(b)[-1] == [START, START + 2]
    assert figures["memory_resets"] == {"first appearance": 2, "episode end": 1}
