"""The learner's state machine in-process: trajectories in as they arrive off the wire, its
weights, receipts and requests read back from an outbox, time from an explicit clock. A real
learner in a real pipeline is test_pipeline's, test_receipts' and test_trainer_slot's."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import zmq
from conftest import ManualClock
from scripted_algos import CurriculumPPO

from stepbus import cli, clidoc
from stepbus.bus import node
from stepbus.bus import protocol as p
from stepbus.trainer import checkpoint, learner, ppo
from stepbus.trainer.algorithm import CannotStart
from stepbus.trainer.model import Model
from stepbus.workers import envs

SPEC = envs.space_spec(gym.make("CartPole-v1"))
T0 = 1000.0
BATCH = 64  # env steps per update here
STEPS = 20  # per trajectory: an update every 4 of them


def wire(msg: p.Message) -> p.Message:
    """The message as a learner receives it: encoded and decoded (read-only arrays)."""
    return p.decode(p.encode(msg))


def trajectory(seq: int, *, version: int = 1, steps: int = STEPS, assembler: str = "a1",
               obs_dim: int = 4, policy: str = "default", ret: float | None = None
               ) -> p.Trajectory:
    rng = np.random.default_rng(seq)
    return p.Trajectory(
        agent=f"w0/{seq % 4}", epoch=0, terminated=ret is not None, truncated=False,
        episode_return=ret, episode_length=None if ret is None else steps,
        obs=rng.normal(size=(steps, obs_dim)).astype(np.float32),
        actions=rng.integers(0, 2, steps), logp=np.full(steps, -0.69, np.float32),
        values=np.zeros(steps, np.float32), rewards=np.ones(steps, np.float32),
        policy_versions=np.full(steps, version, np.int64),
        bootstrap_obs=rng.normal(size=obs_dim).astype(np.float32), assembler=assembler,
        seq=seq, policy=policy)


class Bench:
    """One learner object on an outbox, the test playing the assembler, the broker and the
    controller."""

    def __init__(self, run_dir: Path, *, newest_version: int = 0,
                 algo_class: type = ppo.PPO, incarnation: str = "i1",
                 spaces: p.SpaceSpec = SPEC, slot: node.SupervisorBeat | None = None,
                 **cfg: object) -> None:
        """A learner of the run in `run_dir`, resuming its checkpoint if there is one;
        checkpointing and recording after every update unless `checkpoint_interval_s` and
        `metrics_interval_s` say otherwise. The workers declared `spaces` (CartPole's:
        reward_threshold 475)."""
        self.clock = ManualClock(T0)
        self.out = node.Outbox()
        cfg.setdefault("checkpoint_interval_s", 0.0)
        # One metrics record per update unless a test says otherwise: most tests here count
        # records as updates (the cadence's own tests set --metrics-interval-s).
        cfg.setdefault("metrics_interval_s", 0.0)
        self.cfg = learner.Config(ppo=ppo.PPOConfig(batch_steps=BATCH, minibatch_size=BATCH,
                                                    n_epochs=2), **cfg)  # type: ignore[arg-type]
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        spec = p.EnvSpec(env_id="CartPole-v1", spec=spaces, policy_version=newest_version)
        model = Model(algo_class, spec, self.cfg.ppo, self.cfg.seed, name=self.cfg.algo)
        progress = learner.Progress()
        if (run_dir / learner.CHECKPOINT).exists():
            progress = learner.Progress(**model.resume(run_dir / learner.CHECKPOINT))
        self.learner = learner.Learner(
            self.cfg, model, progress, run_dir, self.out,
            logging.getLogger("test.learner"), name="t0", incarnation=incarnation,
            newest_version=newest_version, env=spec, clock=self.clock, run=run_dir.name,
            slot=slot)

    def deliver(self, *msgs: p.Message) -> None:
        """Each message as the loop hands it over, then the loop's tick until it has no more
        to do at once (an update per tick)."""
        for msg in msgs:
            self.learner.deliver(b"", wire(msg), now=self.clock.t)
        while self.learner.tick(self.clock.t) == 0.0:
            pass

    def later(self, seconds: float) -> None:
        """Time passes; the timers due by then run."""
        self.clock.t += seconds
        self.learner.run_timers(self.clock.t)

    def weights(self) -> list[p.Weights]:
        return self.out.take(p.Weights, port="policy")

    def receipts(self) -> list[p.Receipt]:
        return self.out.take(p.Receipt, port="receipts")

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[Bench]:
    b = Bench(tmp_path)
    yield b
    b.learner.metrics.close()


def test_a_full_batch_is_learned_from_and_weights_go_out_with_ever_higher_versions(
        tmp_path: Path) -> None:
    b = Bench(tmp_path, newest_version=5)
    first = b.weights()
    assert [w.version for w in first] == [6], "published at once, above the broker's newest"
    b.deliver(*(trajectory(seq) for seq in range(3)))  # 60 steps: not a full batch
    assert b.weights() == [] and b.learner.counts.updates == 0
    b.deliver(trajectory(3))
    sent = b.weights()
    assert [(w.version, w.consumed_steps, w.starving) for w in sent] == [(7, 80, False)]
    assert not np.array_equal(sent[0].params["pi.0.w"], first[0].params["pi.0.w"]), "learned"
    b.deliver(*(trajectory(seq, version=7) for seq in range(4, 8)))
    assert [w.version for w in b.weights()] == [8]
    records = b.records()
    assert [(r["policy_version"], r["env_steps"]) for r in records] == [(7, 80), (8, 160)]
    assert records[0]["digest"] != records[1]["digest"]
    assert b.learner.figures()["updates"] == 2 and b.learner.figures()["trajectories"] == 8
    b.learner.metrics.close()


def test_receipts_name_what_was_taken_in_and_after_the_update_what_was_learned(
        bench: Bench) -> None:
    bench.deliver(*(trajectory(seq) for seq in range(3)))
    assert bench.receipts() == [], "sent by a timer, after the messages at hand"
    bench.later(0.0)
    (r,) = bench.receipts()
    assert (r.trainer, r.incarnation, r.assembler, r.policy) == ("t0", "i1", "a1", "default")
    assert r.max_policy_lag == 8, "its bound: the assembler cuts trajectories to half of it"
    assert r.taken.tolist() == [0, 1, 2] and r.learned.tolist() == []
    bench.deliver(trajectory(3))  # the batch is full: learned from
    bench.later(learner.RECEIPT_INTERVAL_S * 0.75)
    assert bench.receipts() == [], "at most one receipt per interval"
    bench.later(learner.RECEIPT_INTERVAL_S * 0.5)
    (r,) = bench.receipts()
    assert r.taken.tolist() == [3] and r.learned.tolist() == [0, 1, 2, 3]
    bench.later(1.0)
    assert bench.receipts() == [], "nothing new: nothing sent"


def test_a_bad_trajectory_or_another_policys_is_refused_counted_and_not_receipted(
        bench: Bench) -> None:
    bench.deliver(trajectory(0, obs_dim=5), trajectory(1, policy="red"))
    figures = bench.learner.figures()
    assert figures["rejected"] == 2 and figures["rejected_bad_trajectory"] == 1
    assert figures["rejected_wrong_policy"] == 1
    assert figures["trajectories"] == 0 and figures["env_steps"] == 0
    bench.later(1.0)
    assert bench.receipts() == []
    bad = p.Trajectories.of([trajectory(2), trajectory(3, steps=5)])
    bench.deliver(dataclasses.replace(bad, lengths=[20, 20]))  # lengths the arrays do not have
    assert bench.learner.figures()["rejected_bad_trajectories"] == 1


def test_a_trajectory_acted_beyond_the_policy_lag_is_dropped_counted_and_receipted_learned(
        tmp_path: Path) -> None:
    b = Bench(tmp_path, newest_version=20, max_policy_lag=8)  # the learner's version: 21
    b.deliver(trajectory(0, version=12), trajectory(1, version=13))
    assert b.learner.counts.stale_dropped == 1 and b.learner.counts.trajectories == 2
    assert b.learner.batch.ids == [("a1", 1)], "version 13 is 8 behind: still learned from"
    b.later(learner.RECEIPT_INTERVAL_S)
    (r,) = b.receipts()
    assert r.taken.tolist() == [0, 1] and r.learned.tolist() == [0], "the assembler forgets it"
    b.deliver(*(trajectory(seq, version=14) for seq in range(2, 5)))
    weights = b.weights()
    assert [w.version for w in weights] == [21, 22]
    # The broker hears the median lag of what came (9, 8, 7, 7, 7 versions) and the bound, so
    # it steps less far ahead; the next weights say only what came since.
    assert [(w.policy_lag, w.max_policy_lag) for w in weights] == [(-1, 8), (7, 8)]
    b.deliver(*(trajectory(seq, version=22) for seq in range(5, 9)))
    assert [(w.policy_lag, w.max_policy_lag) for w in b.weights()] == [(0, 8)]
    assert b.records()[0]["stale_dropped"] == 1
    b.learner.metrics.close()


def test_a_trajectory_sent_again_is_counted_as_a_duplicate_and_not_taken_twice(
        bench: Bench) -> None:
    bench.deliver(trajectory(0), trajectory(1), trajectory(0))
    assert bench.learner.counts.duplicates == 1 and bench.learner.counts.trajectories == 2
    assert bench.learner.steps_taken == 2 * STEPS
    assert bench.learner.progress.env_steps == 0, "counted in the progress once learned from"


def test_a_message_spanning_two_batches_is_learned_one_update_per_tick_the_intake_held(
        bench: Bench) -> None:
    lrn = bench.learner
    lrn.deliver(b"", wire(p.Trajectories.of([trajectory(seq) for seq in range(8)])),
                now=T0)
    assert lrn.batch.steps == 80 and len(lrn.pending) == 4, "taken in up to a full batch"
    assert lrn.holds("trajectories"), "the rest waits in the assembler's queue"
    assert lrn.tick(T0) == 0.0 and lrn.counts.updates == 1, "more to do at once"
    assert lrn.holds("trajectories")
    assert lrn.tick(T0) == np.inf and lrn.counts.updates == 2 and not lrn.pending
    assert not lrn.holds("trajectories")
    assert [w.version for w in bench.weights()] == [1, 2, 3]


def test_weights_go_out_again_on_a_quiet_link_marked_starving(bench: Bench) -> None:
    bench.weights()
    bench.later(learner.QUIET_S / 2)
    bench.deliver(trajectory(0))  # data: the link is not quiet
    bench.later(learner.QUIET_S / 2)
    assert bench.weights() == []
    bench.later(learner.QUIET_S / 2)
    (w,) = bench.weights()
    assert w.starving and w.version == 1 and w.consumed_steps == STEPS
    bench.later(learner.QUIET_S)
    assert [w.starving for w in bench.weights()] == [True], "and again while it stays quiet"


def test_a_solved_run_learns_no_more_and_asks_the_controller_to_shut_down_until_it_does(
        tmp_path: Path) -> None:
    b = Bench(tmp_path, max_updates=1, target_return=0.0)
    b.deliver(*(trajectory(seq) for seq in range(4)))
    assert b.learner.phase is learner.Phase.SOLVED and b.learner.progress.updates == 1
    b.later(0.0)
    (req,) = b.out.take(p.ShutdownRequest, port="controller")
    assert "--max-updates 1" in req.reason
    (r,) = b.receipts()
    assert r.learned.tolist() == [0, 1, 2, 3]
    b.deliver(*(trajectory(seq, version=2) for seq in range(4, 9)))
    assert b.learner.counts.updates == 1, "no more updates"
    b.later(learner.RECEIPT_INTERVAL_S)
    (r,) = b.receipts()
    assert r.learned.tolist() == [4, 5, 6, 7, 8], "taken in means done with"
    b.later(learner.SHUTDOWN_REQUEST_INTERVAL_S)
    assert len(b.out.take(p.ShutdownRequest)) == 1, "asked again"
    weights = b.weights()
    assert [w.version for w in weights[:2]] == [1, 2] and len(weights) > 2, "and republished"
    assert not any(w.starving for w in weights), "nothing more wanted: not starving"
    _, _, saved = checkpoint.load(tmp_path / learner.CHECKPOINT)
    assert saved["updates"] == 1, "checkpointed when solved"
    b.learner.metrics.close()


def solved_by(b: Bench) -> str:
    """Why the learner asked for a shutdown ("" if it did not)."""
    b.later(0.0)
    asked = b.out.take(p.ShutdownRequest, port="controller")
    assert (b.learner.phase is learner.Phase.SOLVED) == bool(asked)
    b.learner.metrics.close()
    return asked[0].reason if asked else ""


def episodes(first: int, ret: float, n: int = 4) -> list[p.Trajectory]:
    """`n` whole episodes of STEPS steps (four make one update)."""
    return [trajectory(seq, ret=ret) for seq in range(first, first + n)]


def test_without_target_return_the_run_ends_at_the_envs_reward_threshold(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    easy = dataclasses.replace(SPEC, reward_threshold=15.0)
    with caplog.at_level(logging.INFO, logger="test.learner"):
        b = Bench(tmp_path / "a", spaces=easy, target_episodes=4)
    assert ("the run ends once the mean return of the last 4 episodes reaches 15 (env "
            "CartPole-v1's reward_threshold)") in caplog.text
    b.deliver(*episodes(0, ret=10.0))
    assert b.learner.phase is learner.Phase.LEARNING, "a mean of 10 is below 15"
    b.deliver(*episodes(4, ret=20.0))
    assert solved_by(b) == "trainer reached mean return 20.0"
    explicit = Bench(tmp_path / "b", spaces=easy, target_episodes=4, target_return=25.0)
    explicit.deliver(*episodes(0, ret=20.0))
    assert solved_by(explicit) == "", "an explicit --target-return wins over the env's"
    never = Bench(tmp_path / "c", spaces=easy, target_episodes=4, target_return=0.0)
    never.deliver(*episodes(0, ret=20.0))
    assert solved_by(never) == "", "--target-return 0: no target"


def test_an_env_without_a_reward_threshold_runs_until_stopped_and_says_so_once_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    no_goal = dataclasses.replace(SPEC, reward_threshold=None)
    with caplog.at_level(logging.INFO, logger="test.learner"):
        b = Bench(tmp_path, spaces=no_goal, target_episodes=4)
        b.deliver(*episodes(0, ret=1e6), *episodes(4, ret=1e6))
    said = [r.getMessage() for r in caplog.records if "target return" in r.getMessage()]
    assert said == ["no target return (env CartPole-v1 has no reward_threshold): the run goes "
                    "on until stopped (give --target-return or --max-env-steps to end it)"]
    assert b.learner.counts.updates == 2 and solved_by(b) == ""


def test_max_env_steps_ends_the_run_once_it_has_learned_from_that_many_env_steps(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    no_goal = dataclasses.replace(SPEC, reward_threshold=None)
    with caplog.at_level(logging.INFO, logger="test.learner"):
        b = Bench(tmp_path, spaces=no_goal, max_env_steps=150)
    assert "the run goes on until stopped or --max-env-steps 150" in caplog.text
    b.deliver(*episodes(0, ret=1.0))
    assert b.learner.phase is learner.Phase.LEARNING, "80 env steps of 150"
    b.deliver(*episodes(4, ret=1.0))
    assert solved_by(b) == "trainer learned from --max-env-steps 150 env steps"
    assert b.learner.progress.env_steps == 160 and b.learner.counts.updates == 2
    again = Bench(tmp_path, spaces=no_goal, max_env_steps=150, newest_version=3,
                  incarnation="i2")
    assert solved_by(again).startswith("the run learned from --max-env-steps 150"), (
        "a resumed run that got there already ends at once")
    raised = Bench(tmp_path, spaces=no_goal, max_env_steps=300, newest_version=5,
                   incarnation="i3")
    assert solved_by(raised) == "", "a higher limit lets it go on"


def test_the_target_return_flag_defaults_to_the_envs_and_says_so_in_its_help() -> None:
    parser = clidoc.subcommands(cli.build_parser())["learner"]
    assert parser.parse_args([]).target_return is None
    assert parser.parse_args(["--target-return", "-100"]).target_return == -100.0
    assert parser.parse_args(["--max-env-steps", "5000"]).max_env_steps == 5000
    (action,) = [a for a in parser._actions if "--target-return" in a.option_strings]
    assert action.help is not None
    assert action.help.endswith("[default: the env's reward_threshold; none: run until stopped "
                                "or --max-env-steps]")


class NumberedPPO(ppo.PPO):
    """Reports each update's number as its loss, so a record's average is known."""

    updates = 0

    def update(self, batch: Sequence[ppo.Trajectory],
               tick: Callable[[], object] | None = None) -> dict[str, float]:
        self.updates += 1
        return {"loss": float(self.updates)}


def test_metrics_records_come_at_most_once_a_second_averaging_every_update_in_between(
        tmp_path: Path) -> None:
    b = Bench(tmp_path, algo_class=NumberedPPO, metrics_interval_s=1.0)
    b.deliver(*episodes(0, ret=10.0))
    assert [(r["updates"], r["loss"]) for r in b.records()] == [(1, 1.0)], "the first at once"
    b.deliver(*episodes(4, ret=20.0), *episodes(8, ret=30.0))  # two more updates, no time
    assert len(b.records()) == 1, "the next waits for the interval"
    b.later(1.0)  # no update comes: the interval's end writes the record of the two
    _, second = b.records()
    assert (second["updates"], second["loss"], second["policy_version"]) == (2, 2.5, 4)
    assert (second["env_steps"], second["episodes"]) == (12 * STEPS, 12)
    assert second["interval_mean_return"] == 25.0, "every episode since the last record"
    assert second["mean_return"] == 20.0, "the goal's mean: the last --target-episodes"
    assert second["steps_per_second"] == 8 * STEPS, "over the interval"
    b.later(5.0)
    assert len(b.records()) == 2, "no update, no record"
    b.deliver(*episodes(12, ret=40.0))
    assert [(r["updates"], r["loss"]) for r in b.records()[2:]] == [(1, 4.0)], "due: at once"
    b.learner.metrics.close()


def test_the_update_that_ends_the_run_and_a_leaving_learners_last_ones_are_recorded(
        tmp_path: Path) -> None:
    b = Bench(tmp_path / "a", algo_class=NumberedPPO, metrics_interval_s=60.0, max_updates=3)
    b.deliver(*(episodes(0, ret=1.0, n=12)))
    assert solved_by(b).startswith("trainer made --max-updates 3")
    assert [(r["updates"], r["loss"], r["policy_version"]) for r in b.records()] == [
        (1, 1.0, 2), (2, 2.5, 4)], "the last record is the update that ended the run"
    left = Bench(tmp_path / "b", algo_class=NumberedPPO, metrics_interval_s=60.0,
                 checkpoint_interval_s=5.0)
    left.deliver(*(episodes(0, ret=1.0, n=8)))
    assert len(left.records()) == 0, "the first record waits for its checkpoint"
    left.learner.on_signal("SIGUSR1")  # the trainer slot's hand-over
    left.learner.finish()
    assert [r["updates"] for r in left.records()] == [1, 1]


def test_at_shutdown_the_assembler_flush_is_taken_in_until_it_disconnects_then_checkpointed(
        bench: Bench, tmp_path: Path) -> None:
    lrn = bench.learner
    bench.deliver(trajectory(0))
    bench.deliver(p.Shutdown(reason="operator"))
    assert lrn.phase is learner.Phase.DRAINING and not lrn.stop_reason
    (r,) = bench.receipts()
    assert r.taken.tolist() == [0], "what the interval held back goes out at once"
    bench.deliver(*(trajectory(seq) for seq in range(1, 5)))  # the flush: a full batch
    assert lrn.counts.updates == 0 and lrn.counts.trajectories == 5, "taken in, not learned"
    bench.later(0.0)
    (r,) = bench.receipts()
    assert r.taken.tolist() == [1, 2, 3, 4] and r.learned.tolist() == []
    lrn.on_socket_event("assembler_events", zmq.EVENT_DISCONNECTED)
    assert lrn.stop_reason == "operator"
    lrn.finish()
    _, _, saved = checkpoint.load(tmp_path / learner.CHECKPOINT)
    assert saved["env_steps"] == 5 * STEPS and saved["generation"] == 1


def test_at_shutdown_what_waits_behind_a_full_batch_is_taken_in_and_not_learned_from(
        bench: Bench) -> None:
    lrn = bench.learner
    lrn.deliver(b"", wire(p.Trajectories.of([trajectory(seq) for seq in range(8)])), now=T0)
    assert len(lrn.pending) == 4 and lrn.full()
    lrn.deliver(b"", wire(p.RunState(run_id="r1", epoch=0, options={}, shutting_down=True)),
                now=T0)
    assert lrn.phase is learner.Phase.DRAINING and not lrn.pending
    assert lrn.counts.trajectories == 8 and lrn.tick(T0) == np.inf
    assert lrn.counts.updates == 0 and not lrn.holds("trajectories")
    (r,) = bench.receipts()
    assert r.taken.tolist() == list(range(8)) and r.learned.tolist() == []


def test_the_shutdown_drain_ends_after_its_time_if_the_assembler_never_disconnects(
        bench: Bench) -> None:
    bench.learner.on_signal("SIGTERM")
    bench.later(learner.SHUTDOWN_DRAIN_MAX_S - 0.25)
    assert not bench.learner.stop_reason
    bench.later(0.25)
    assert bench.learner.stop_reason == "SIGTERM"


def test_a_hand_over_leaves_at_once_without_taking_in_what_waits(bench: Bench) -> None:
    lrn = bench.learner
    lrn.deliver(b"", wire(p.Trajectories.of([trajectory(seq) for seq in range(8)])), now=T0)
    lrn.on_signal("SIGUSR1")
    assert lrn.stop_reason == "SIGUSR1" and lrn.phase is learner.Phase.LEARNING
    assert len(lrn.pending) == 4, "left for the next learner: the assembler sends it again"


def test_a_curriculum_reset_is_asked_for_and_asked_again_while_another_barrier_runs(
        tmp_path: Path) -> None:
    b = Bench(tmp_path, algo_class=CurriculumPPO)
    b.deliver(*(trajectory(seq) for seq in range(8)))  # two updates: the second asks
    b.later(0.0)
    (req,) = b.out.take(p.ResetRequest, port="controller")
    assert req.options == {"level": 2}
    b.deliver(p.Reply(ok=False, detail="a reset barrier is already running"))
    b.later(0.0)
    assert b.out.take(p.ResetRequest) == [], "not before RETRY_S"
    b.later(learner.Curriculum.RETRY_S)
    assert [r.options for r in b.out.take(p.ResetRequest)] == [{"level": 2}]
    b.learner.metrics.close()


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_parameters_that_differ(
        tmp_path: Path) -> None:
    env_spec = p.EnvSpec(env_id="CartPole-v1", spec=SPEC, policy_version=-1)
    small = Model(ppo.PPO, env_spec, ppo.PPOConfig(hidden=(8,)), seed=0)
    small.save(tmp_path / "small.npz", {"updates": 1})
    again = Model(ppo.PPO, env_spec, ppo.PPOConfig(hidden=(8,)), seed=1)
    assert again.resume(tmp_path / "small.npz") == {"updates": 1}
    assert all(np.array_equal(again.params[k], v) for k, v in small.params.items())
    wide = Model(ppo.PPO, env_spec, ppo.PPOConfig(hidden=(16,)), seed=0)
    with pytest.raises(CannotStart, match=r"does not fit this policy \(pi\.0\.b, pi\.0\.w, "
                                          r"pi\.1\.w, vf\.0\.b; spaces SpaceSpec\(obs_shape"):
        wide.resume(tmp_path / "small.npz")


def saved(run_dir: Path) -> dict:
    """The progress in the run's checkpoint on disk."""
    return checkpoint.load(run_dir / learner.CHECKPOINT)[2]


def test_learning_is_receipted_and_recorded_only_once_a_checkpoint_holds_it(
        tmp_path: Path) -> None:
    b = Bench(tmp_path, checkpoint_interval_s=1.0)  # its first checkpoint: at start, T0
    b.deliver(*(trajectory(seq) for seq in range(4)))  # a full batch: an update at T0
    assert [w.version for w in b.weights()] == [1, 2], "the new weights go out at once"
    b.later(learner.RECEIPT_INTERVAL_S)
    (r,) = b.receipts()
    assert r.taken.tolist() == [0, 1, 2, 3] and r.learned.tolist() == [], "not on disk yet"
    assert b.records() == [] and saved(tmp_path)["updates"] == 0
    b.later(1.0 - learner.RECEIPT_INTERVAL_S)  # the interval since the last checkpoint is up
    assert saved(tmp_path)["updates"] == 1 and saved(tmp_path)["env_steps"] == 4 * STEPS
    assert [(r["policy_version"], r["env_steps"]) for r in b.records()] == [(2, 4 * STEPS)]
    b.later(learner.RECEIPT_INTERVAL_S)
    (r,) = b.receipts()
    assert r.learned.tolist() == [0, 1, 2, 3], "receipted once the checkpoint holds it"
    assert b.learner.figures()["checkpoints"] == 2
    b.learner.metrics.close()


def test_a_learner_killed_before_its_checkpoint_leaves_nothing_confirmed_and_its_successor_learns_it_again(  # noqa: E501
        tmp_path: Path) -> None:
    first = Bench(tmp_path, checkpoint_interval_s=5.0)
    first.deliver(*(trajectory(seq) for seq in range(8)))  # two updates
    first.later(1.0)
    assert first.learner.counts.updates == 2
    assert all(r.learned.size == 0 for r in first.receipts()), "nothing confirmed yet"
    first.learner.metrics.close()  # killed: no finish(), no checkpoint
    assert first.records() == []
    newest = max(w.version for w in first.weights())  # what the broker has seen: 3
    second = Bench(tmp_path, newest_version=newest, incarnation="i2")
    (hello,) = second.weights()
    assert hello.version == newest + 1, "above everything published"
    assert hello.consumed_steps == 0, "the checkpoint holds no steps: all of them come again"
    second.deliver(*(trajectory(seq, version=3) for seq in range(8)))  # the assembler resends
    assert second.learner.counts.duplicates == 0 and second.learner.counts.updates == 2
    second.later(learner.RECEIPT_INTERVAL_S)
    assert sorted(seq for r in second.receipts() for seq in r.learned.tolist()) == list(range(8))
    records = second.records()
    assert [r["env_steps"] for r in records] == [4 * STEPS, 8 * STEPS]
    assert [r["policy_version"] for r in records] == [newest + 2, newest + 3]
    assert saved(tmp_path)["generation"] == 2
    second.learner.metrics.close()


def test_a_successor_receipts_again_what_the_checkpoint_held_and_does_not_count_it_twice(
        tmp_path: Path) -> None:
    first = Bench(tmp_path)
    first.deliver(*(trajectory(seq, ret=10.0) for seq in range(4)))  # learned, checkpointed
    first.deliver(trajectory(4))  # taken in, not learned
    assert saved(tmp_path)["env_steps"] == 4 * STEPS and saved(tmp_path)["episodes"] == 4
    assert first.weights()[-1].checkpointed_steps == 0, "the update's weights precede it"
    first.learner.publish()  # its next weights, as a republish on a quiet link or the next update
    said = first.weights()[-1]
    assert said.checkpointed_steps == 4 * STEPS, "so the broker knows a successor"
    first.learner.metrics.close()  # killed before its receipts went out
    assert first.receipts() == [] and len(first.records()) == 1
    second = Bench(tmp_path, newest_version=2, incarnation="i2")
    (hello,) = second.weights()
    assert hello.consumed_steps == 4 * STEPS, "the run's count: the broker's scale continues"
    assert hello.checkpointed_steps == 4 * STEPS, "the checkpoint it resumed"
    assert hello.run == said.run == tmp_path.name, "the same run, said"
    # The assembler never heard of the receipt: it sends all five again.
    second.deliver(*(trajectory(seq, ret=10.0) for seq in range(4)), trajectory(4))
    assert second.learner.counts.duplicates == 4 and second.learner.counts.trajectories == 1
    assert second.learner.steps_taken == 5 * STEPS, "each step counted once"
    second.later(learner.RECEIPT_INTERVAL_S)
    (r,) = second.receipts()
    assert r.taken.tolist() == [4] and r.learned.tolist() == [0, 1, 2, 3], "receipted again"
    second.deliver(*(trajectory(seq) for seq in range(5, 8)))
    assert second.learner.progress.episodes == 4 and second.learner.progress.updates == 2
    records = first.records()
    assert [r["env_steps"] for r in records] == [4 * STEPS, 8 * STEPS]
    assert [r["episodes"] for r in records] == [4, 4]
    second.learner.metrics.close()


def test_a_hand_over_checkpoints_what_was_learned_and_leaves_the_partial_batch_to_be_sent_again(
        tmp_path: Path) -> None:
    b = Bench(tmp_path, checkpoint_interval_s=5.0)
    b.deliver(*(trajectory(seq) for seq in range(6)))  # one update, two taken in after it
    b.learner.on_signal("SIGUSR1")
    b.learner.finish()
    (r,) = b.receipts()
    assert r.learned.tolist() == [0, 1, 2, 3] and r.taken.tolist() == list(range(6))
    assert saved(tmp_path)["env_steps"] == 4 * STEPS, "the partial batch is not counted"
    assert [r["env_steps"] for r in b.records()] == [4 * STEPS]


def test_a_stale_trajectory_is_receipted_once_the_checkpoint_counts_it(tmp_path: Path) -> None:
    b = Bench(tmp_path, newest_version=20, checkpoint_interval_s=1.0)
    b.deliver(trajectory(0, version=3))
    b.later(learner.RECEIPT_INTERVAL_S)
    assert [r.learned.tolist() for r in b.receipts()] == [[]]
    b.later(1.0)
    assert saved(tmp_path)["env_steps"] == STEPS
    b.later(0.0)  # the loop's next pass
    assert [r.learned.tolist() for r in b.receipts()] == [[0]]
    b.learner.metrics.close()


def test_a_learner_tells_its_slot_it_started_once_it_has_its_settings_model_and_checkpoint(
        tmp_path: Path) -> None:
    """What the trainer slot proves a swapped-in learner by (trainer/slot.py): STARTED on the
    beat pipe as the learner takes over from its setup, with ordinary beats after it."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)  # nothing written: BlockingIOError, not a hang
    try:
        bench = Bench(tmp_path, slot=node.SupervisorBeat(write_end))
        assert os.read(read_end, 64) == node.STARTED
        bench.later(node.HEARTBEAT_INTERVAL_S)
        assert os.read(read_end, 64) == b"."
    finally:
        os.close(read_end)
        os.close(write_end)


def test_started_waits_for_room_in_a_full_pipe_and_goes_with_the_next_beat() -> None:
    read_end, write_end = os.pipe()
    try:
        beat = node.SupervisorBeat(write_end)
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(write_end, b"." * 4096)
        beat.started(1.0)  # no room: kept for the next beat
        os.set_blocking(read_end, False)
        with contextlib.suppress(BlockingIOError):
            while os.read(read_end, 1 << 16):
                pass
        beat.beat(1.0 + node.HEARTBEAT_INTERVAL_S)
        assert os.read(read_end, 64) == node.STARTED
        beat.beat(1.0 + 2 * node.HEARTBEAT_INTERVAL_S)
        assert os.read(read_end, 64) == b"."
    finally:
        os.close(read_end)
        os.close(write_end)
