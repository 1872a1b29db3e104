"""The evaluator: its state machine in-process (weights in, greedy episodes played, results
out), the learner's side of it (results into metrics and the goal), and real runs: a serial
run judged on eval return, and real processes where the evaluator shows in `stepbus status`,
refuses bad input, and is killed while training goes on."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import Cluster, ManualClock, send_message, serial_run, wait_for
from controller_probe import status_rows
from test_learner_state import Bench as LearnerBench
from test_learner_state import trajectory

from stepbus.bus import node
from stepbus.bus import protocol as p
from stepbus.models import mlp
from stepbus.policy import ActionSpace
from stepbus.processor import evaluator

LEARNER = b"learner-peer"


def weights(version: int, *, obs_dim: int = 4, policy: str = "default",
            params_seed: int = 0) -> p.Weights:
    """A learner's WEIGHTS with real, untrained MLP weights (its logits near even, so sampled
    actions would differ from greedy ones)."""
    params = mlp.init_params(obs_dim, ActionSpace("discrete", n=2), (8,),
                             np.random.default_rng(params_seed))
    return p.Weights(trainer="t0", incarnation="i1", policy=policy, version=version,
                     consumed_steps=0, batch_steps=64, starving=False, params=params)


class Bench:
    """One evaluator object on an outbox, with CartPole envs of its own; the test plays the
    learner."""

    def __init__(self, **cfg: object) -> None:
        self.cfg = evaluator.Config(env="CartPole-v1", env_kwargs="", **cfg)  # type: ignore
        log = logging.getLogger("test.evaluator")
        self.out = node.Outbox()
        envs = evaluator.make_envs(self.cfg, "e0", log)
        self.evaluator = evaluator.Evaluator(self.cfg, envs, self.out, log, name="e0",
                                             clock=ManualClock(100.0))

    def deliver(self, *msgs: p.Message) -> None:
        """Each message as it comes off the wire, then the loop's ticks until it is idle (a
        clock that stands still lets one tick play a whole evaluation)."""
        for msg in msgs:
            self.evaluator.deliver(LEARNER, p.decode(p.encode(msg)))
        while self.evaluator.tick(100.0) == 0.0:
            pass

    def results(self) -> list[p.EvalResult]:
        sent = self.out.take_sent(p.EvalResult)
        assert all(s.port == "evaluation" and s.to == LEARNER for s in sent), sent
        return [s.msg for s in sent]


@pytest.fixture
def bench() -> Iterator[Bench]:
    b = Bench(eval_episodes=5, eval_envs=2)
    yield b
    b.evaluator.envs.close()


def test_each_new_version_is_played_greedily_on_the_same_episodes_and_answered(bench: Bench):
    bench.deliver(weights(3))
    (first,) = bench.results()
    assert (first.version, first.episodes, first.policy, first.evaluator) == (3, 5, "default",
                                                                              "e0")
    assert first.mean_return > 0 and first.mean_length > 0 and first.std_return >= 0
    # The same weights again as version 4: the sampling generator has moved on, the episodes'
    # seeds have not, so only greedy acting gives the very same returns.
    bench.deliver(weights(4))
    (second,) = bench.results()
    assert second.version == 4
    assert (second.mean_return, second.std_return, second.mean_length) == (
        first.mean_return, first.std_return, first.mean_length)
    bench.deliver(weights(4), weights(2))  # sent again, and older: nothing to play
    assert bench.results() == []
    figures = bench.evaluator.figures()
    assert figures["evaluations"] == 2 and figures["policy_version"] == 4
    assert figures["eval_return"] == round(first.mean_return, 2)


def test_episodes_are_shared_out_over_the_envs_so_short_ones_are_not_favoured():
    episodes = evaluator.Episodes(n_envs=3, n_episodes=5)
    assert episodes.targets.tolist() == [1, 2, 2]
    ended = np.array([True, True, False])
    episodes.add(np.ones(3), ended)  # envs 0 and 1 end an episode each after one step
    episodes.add(np.ones(3), ended)  # env 0's second one is past its share: not counted
    assert episodes.returns == [1.0, 1.0, 1.0] and not episodes.finished
    episodes.add(np.ones(3), np.array([False, False, True]))
    episodes.add(np.ones(3), np.array([False, False, True]))
    assert episodes.returns == [1.0, 1.0, 1.0, 3.0, 1.0] and episodes.finished


def test_eval_every_skips_versions_and_only_the_newest_waiting_one_is_played():
    b = Bench(eval_episodes=2, eval_envs=2, eval_every=3)
    try:
        b.deliver(weights(1))
        b.evaluator.deliver(LEARNER, weights(2))  # not due: less than 3 above version 1
        b.evaluator.deliver(LEARNER, weights(4))  # due, waits...
        b.evaluator.deliver(LEARNER, weights(5))  # ...and is replaced by a newer one
        b.deliver()
        assert [r.version for r in b.results()] == [1, 5]
        assert b.evaluator.counts.versions_skipped == 1
    finally:
        b.evaluator.envs.close()


def test_bad_weights_are_refused_and_counted_and_other_policies_ignored(bench: Bench):
    bench.deliver(weights(1, obs_dim=5))  # another env's model
    bench.deliver(weights(-1))
    bench.deliver(weights(2, policy="red"))
    assert bench.results() == [] and bench.evaluator.phase is evaluator.Phase.IDLE
    figures = bench.evaluator.figures()
    assert figures["rejected_bad_weights"] == 2 and figures["rejected"] == 2
    assert figures["other_policy_weights"] == 1 and figures["evaluations"] == 0
    bench.deliver(weights(3))  # good weights after bad ones are played
    assert [r.version for r in bench.results()] == [3]


# -- the learner's side


def result(version: int, mean: float = 123.0, **fields: object) -> p.EvalResult:
    values: dict = dict(evaluator="e0", policy="default", version=version, episodes=5,
                        mean_return=mean, std_return=1.5, mean_length=50.0)
    values.update(fields)
    return p.EvalResult(**values)


def test_the_learner_offers_each_new_version_once_and_records_eval_results(tmp_path: Path):
    b = LearnerBench(tmp_path, metrics_interval_s=1.0)
    try:
        offered = b.out.take(p.Weights, port="evaluation")
        assert [w.version for w in offered] == [1]
        b.learner.republish(b.clock.t + 1.0)  # the same version again: not to the evaluator
        assert b.out.take(p.Weights, port="evaluation") == []
        b.deliver(*(trajectory(seq) for seq in range(4)))  # an update: version 2
        assert [w.version for w in b.out.take(p.Weights, port="evaluation")] == [2]
        b.later(1.0)
        b.deliver(result(1, mean=42.0))
        b.later(1.0)  # the record holding it, at most one a --metrics-interval-s
        (record,) = [r for r in b.records() if "eval_return" in r]
        assert (record["eval_return"], record["eval_version"], record["eval_episodes"],
                record["eval_return_std"], record["eval_length"]) == (42.0, 1, 5, 1.5, 50.0)
        assert record["env_steps"] == 80 and "mean_return" in record
        figures = b.learner.figures()
        assert (figures["eval_return"], figures["eval_version"]) == (42.0, 1)
    finally:
        b.learner.metrics.close()


@pytest.mark.parametrize("bad", [
    {"version": 9}, {"version": -1}, {"policy": "red"}, {"episodes": 0},
    {"mean_return": float("nan")}, {"std_return": -1.0}, {"mean_length": float("inf")}])
def test_the_learner_refuses_and_counts_an_eval_result_it_cannot_use(tmp_path: Path,
                                                                       bad: dict):
    b = LearnerBench(tmp_path)
    try:
        b.deliver(result(**{"version": 1, **bad}))
        figures = b.learner.figures()
        assert figures["rejected_bad_eval_result"] == 1 and "eval_return" not in figures
    finally:
        b.learner.metrics.close()


def test_with_target_on_eval_the_goal_is_the_eval_return_not_the_training_one(
        tmp_path: Path):
    b = LearnerBench(tmp_path, target_return=100.0, target_on="eval", target_episodes=1)
    try:
        b.deliver(*(trajectory(seq, ret=500.0) for seq in range(4)))  # training return 500
        assert b.learner.phase is not b.learner.phase.SOLVED
        b.deliver(result(2, mean=99.0))
        assert b.learner.phase is not b.learner.phase.SOLVED
        b.deliver(result(2, mean=150.0))  # not news: the same version's again
        assert b.learner.phase is not b.learner.phase.SOLVED
        b.deliver(*(trajectory(seq, version=2) for seq in range(4, 8)))
        b.deliver(result(3, mean=150.0))
        assert b.learner.phase is b.learner.phase.SOLVED
        b.later(0.0)  # the shutdown request's timer
        (request,) = b.out.take(p.ShutdownRequest)
        assert request.reason == "trainer reached eval return 150.0"
    finally:
        b.learner.metrics.close()


# -- real runs


def test_a_serial_run_with_an_evaluator_records_eval_returns_and_stops_on_one(tmp_path: Path):
    records = serial_run(tmp_path, "--evaluator", "--eval-episodes", "3", "--target-on", "eval",
                         "--target-return", "150", "--seed", "1")
    evaluated = [r for r in records if "eval_return" in r]
    assert len(evaluated) >= 2, records[-3:]
    assert evaluated[-1]["eval_return"] >= 150 and evaluated[-1]["eval_episodes"] == 3
    assert all(r["eval_version"] <= r["policy_version"] for r in evaluated)
    assert all(r["eval_return"] < 150 for r in evaluated[:-1]), "it stopped at the first one"


def test_the_evaluator_shows_in_status_refuses_bad_input_and_dies_without_hurting_training(
        cluster: Cluster):
    cluster.start_all(trainer_args=("--target-return", "0"))
    ev = cluster.start("evaluator", "--eval-episodes", "2", "--cpu-priority", "normal")
    wait_for(lambda: any("eval_return" in r for r in cluster.metrics()), 60,
             "an eval_return in the metrics")

    def rows() -> dict[str, dict]:
        return {r["role"]: r for r in status_rows(cluster)}

    shown = wait_for(lambda: (by := rows()) and "eval_return" in by.get("trainer", {})
                     and by.get("evaluator", {}).get("evaluations") and by, 30,
                     "the eval return in the trainer's and the evaluator's status rows")
    assert shown["evaluator"]["policy_version"] >= 1
    assert isinstance(shown["trainer"]["mean_return"], float)
    # Bad input to its socket: bytes that are no message, a kind it does not take.
    stranger = cluster.socket(zmq.DEALER, cluster.endpoints["evaluation"])
    stranger.send_multipart([b"\x00junk"])
    send_message(stranger, p.ShutdownRequest(reason="not for you"))
    wait_for(lambda: rows().get("evaluator", {}).get("rejected", 0) >= 2, 30,
             "both refused and counted")
    stranger.close()
    assert ev.popen.poll() is None, "and it goes on"
    os.kill(ev.pid, signal.SIGKILL)
    ev.wait(10)
    before = max(r["env_steps"] for r in cluster.metrics())
    wait_for(lambda: max(r["env_steps"] for r in cluster.metrics()) > before + 2000, 60,
             "training going on without the evaluator")
    assert all(proc.popen.poll() is None for proc in cluster.procs if proc is not ev)


class SteppingClock(ManualClock):
    """Each reading a millisecond later than the last: playing takes time."""

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


@pytest.mark.parametrize("share", [0.1, 0.5, 1.0])
def test_playing_rests_between_slices_to_keep_to_its_cpu_share(share: float) -> None:
    """After each slice of play (TURN_BUDGET_S), the next is due only after a rest that makes
    playing `--eval-cpu-share` of the evaluator's time; 1 plays on at once."""
    cfg = evaluator.Config(env="CartPole-v1", env_kwargs="", eval_episodes=4, eval_envs=2,
                           eval_cpu_share=share)
    log = logging.getLogger("test.evaluator")
    clock = SteppingClock(100.0)
    envs = evaluator.make_envs(cfg, "e0", log)
    played = evaluator.Evaluator(cfg, envs, node.Outbox(), log, name="e0", clock=clock)
    try:
        played.deliver(LEARNER, p.decode(p.encode(weights(1))))
        began = clock.t
        look_again = played.tick(clock.t)  # a time on its clock
        spent, rest = clock.t - began, look_again - clock.t
        assert played.phase is evaluator.Phase.PLAYING
        assert spent >= evaluator.TURN_BUDGET_S
        # the rest is to the slice as (1 - share) to share (the clock's own readings aside)
        assert rest * share == pytest.approx(spent * (1 - share), abs=0.003)
        if share < 1:  # a tick before the rest is over (a message woke the loop) plays nothing
            at = clock.t
            assert played.tick(clock.t) == look_again
            assert clock.t - at < 0.005
    finally:
        envs.close()
