"""The environment worker in-process: RESET and STEP in, its sends read back from an outbox,
time from an explicit clock where it matters. Real processes (faults, shared memory, many
hosts) are in test_worker_faults, test_shm_frames and test_multihost."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import ManualClock

from stepbus.bus import node, shm
from stepbus.bus import protocol as p
from stepbus.workers import worker
from stepbus.workers.worker import Config, Phase, Worker, beat_while_envs_run

T0 = 1000.0


class Bench:
    """One worker on an outbox, the test playing its broker and controller."""

    def __init__(self, *, clock: ManualClock | None = None, **cfg: object) -> None:
        cfg.setdefault("name", "w")
        self.cfg = Config(**cfg)  # type: ignore[arg-type]
        self.out = node.Outbox()
        self.beats: list[float] = []  # controller heartbeats asked for while a batch ran
        kwargs = {"clock": clock} if clock is not None else {}
        self.worker = Worker(self.cfg, self.out, logging.getLogger("test.worker"),
                             controller_beat=self.beats.append, **kwargs)  # type: ignore[arg-type]

    def reset(self, epoch: int, seq: int, options: dict | None = None) -> list[p.StepResult]:
        self.worker.deliver(b"", p.Reset(epoch=epoch, seq=seq, options=options or {}))
        return self.out.take(p.StepResult, port="steps")

    def step(self, epoch: int, seq: int, actions: np.ndarray | None = None,
             version: int = 0) -> list[p.StepResult]:
        if actions is None:
            actions = np.zeros(self.worker.envs.rows, np.int64)
        self.worker.deliver(b"", p.Step(epoch=epoch, seq=seq, policy_version=version,
                                        actions=actions))
        return self.out.take(p.StepResult, port="steps")


@pytest.fixture
def bench() -> Iterator[Bench]:
    b = Bench(envs_per_worker=2)
    try:
        yield b
    finally:
        b.worker.close()


def test_a_reset_then_steps_reply_once_per_batch_with_the_brokers_epoch_and_seq(bench: Bench):
    (first,) = bench.reset(epoch=3, seq=5)
    assert (first.first, first.epoch, first.seq) == (True, 3, 5)
    assert first.incarnation == bench.worker.incarnation
    assert isinstance(first.obs, np.ndarray) and isinstance(first.final_obs, np.ndarray)
    assert first.obs.shape == (2, 4) and first.final_obs.shape == (0, 4)
    assert not first.reward.any() and not first.terminated.any() and not first.truncated.any()
    assert first.episode is not None and list(first.episode) == [0, 0]
    assert bench.worker.phase is Phase.STEPPING
    for seq in (6, 7, 8):
        (result,) = bench.step(epoch=3, seq=seq, version=11)
        assert (result.first, result.epoch, result.seq) == (False, 3, seq)
        assert result.incarnation == bench.worker.incarnation
        assert isinstance(result.obs, np.ndarray)
        assert result.obs.shape == (2, 4) and (result.reward == 1).all()
    figures = bench.worker.figures()
    assert figures["env_steps"] == 6 and figures["policy_version"] == 11
    assert figures["env_errors"] == 0 and figures["rejected"] == 0
    assert "shm_batches" not in figures, "shared-memory figures only with a segment"


def test_a_step_before_any_reset_or_of_another_epoch_is_ignored(bench: Bench):
    assert bench.step(epoch=0, seq=1) == [], "no reset yet"
    assert bench.worker.phase is Phase.WAITING
    bench.reset(epoch=2, seq=2)
    assert bench.step(epoch=1, seq=3) == [], "from before the barrier"
    assert bench.step(epoch=3, seq=3) == [], "from an epoch we were not reset into"
    assert bench.worker.figures()["env_steps"] == 0
    (result,) = bench.step(epoch=2, seq=3)
    assert result.seq == 3 and bench.worker.figures()["env_steps"] == 2
    assert bench.out.sent == [], "nothing else went out"
    assert bench.worker.figures()["rejected"] == 0, "stale steps are not refused as bad input"


def test_actions_that_do_not_fit_the_spaces_are_refused_and_nothing_is_stepped(bench: Bench):
    bench.reset(epoch=0, seq=1)
    assert bench.step(0, 2, actions=np.zeros(3, np.int64)) == []
    assert bench.step(0, 2, actions=np.array([0, 2])) == [], "CartPole has actions 0 and 1"
    assert bench.step(0, 2, actions=np.zeros(2, np.float32)) == []
    figures = bench.worker.figures()
    assert figures["rejected"] == figures["rejected_bad_actions"] == 3
    assert figures["env_steps"] == 0
    (result,) = bench.step(0, 2)
    assert result.seq == 2


def test_a_reset_resets_every_env_with_the_options_and_the_next_epoch_steps_on():
    bench = Bench(env="scripted_envs:picky_cartpole", envs_per_worker=2)
    try:
        bench.reset(epoch=0, seq=1)
        bench.step(0, 2)
        (first,) = bench.reset(epoch=1, seq=3, options={"level": 2})
        assert first.first and first.epoch == 1
        assert first.episode is not None and list(first.episode) == [1, 1]
        assert bench.out.take(p.RemoteError) == [], "level 2 exists"
        (first,) = bench.reset(epoch=2, seq=4, options={"level": 9})
        assert first.first and first.epoch == 2
        errors = bench.out.take_sent(p.RemoteError)
        assert sorted(s.port for s in errors) == ["controller"] * 2 + ["steps"] * 2, \
            "each rejection reported to the controller and to the broker's barrier"
        assert {s.msg.error_type for s in errors} == {"ValueError"}
        assert bench.worker.envs.without_options == {0, 1}
        (result,) = bench.step(2, 5)
        assert result.epoch == 2 and result.seq == 5
    finally:
        bench.worker.close()


def test_an_env_that_raises_is_reported_with_its_traceback_and_recreated():
    bench = Bench(env="scripted_envs:broken_cartpole", envs_per_worker=1)
    try:
        bench.reset(epoch=0, seq=1)
        broken = bench.worker.envs.envs[0]
        assert [r.truncated[0] for r in bench.step(0, 2) + bench.step(0, 3)] == [False, False]
        assert bench.out.take(p.RemoteError) == []
        (result,) = bench.step(0, 4)  # its 3rd step raises
        assert result.truncated[0] and not result.terminated[0], "the episode is cut"
        assert isinstance(result.final_obs, np.ndarray) and result.episode is not None
        assert result.final_obs.shape == (1, 4) and result.episode[0] == 1, "a new episode"
        sent = bench.out.take_sent(p.RemoteError)
        assert sorted(s.port for s in sent) == ["controller", "steps"]
        error = sent[0].msg
        assert isinstance(error, p.RemoteError)
        assert (error.origin, error.error_type) == ("w", "RuntimeError")
        assert error.message == "simulated broken build"
        assert "Traceback" in error.traceback and error.context["env_index"] == 0
        assert bench.worker.envs.envs[0] is not broken, "recreated"
        assert bench.worker.figures()["env_errors"] == 1
        (result,) = bench.step(0, 5)  # the new env steps on
        assert not result.truncated[0] and result.seq == 5
        assert bench.out.take(p.RemoteError) == []
    finally:
        bench.worker.close()


def test_an_env_that_keeps_raising_ends_the_worker_with_env_failure():
    bench = Bench(env="scripted_envs:broken_cartpole", envs_per_worker=1,
                  max_env_restarts_per_minute=2)
    try:
        bench.reset(epoch=0, seq=1)
        with pytest.raises(worker.EnvFailure, match="keeps raising: 3 env restarts"):
            for seq in range(2, 100):
                bench.step(0, seq)
        assert len(bench.out.take(p.RemoteError, port="controller")) == 3
    finally:
        bench.worker.close()


def test_an_env_that_cannot_be_made_is_one_clear_error():
    with pytest.raises(worker.CannotCreateEnv, match="cannot create environment 'NoSuchEnv-v9'"):
        Bench(env="NoSuchEnv-v9")


def test_a_broker_that_never_answers_gets_hellos_at_the_interval_after_the_first_seconds():
    """A broker that refuses our spaces, or a vector client that has not reset, never
    answers: the quick hellos of the start last FIRST_HELLOS_FOR_S, not for days."""
    clock = ManualClock(T0)
    bench = Bench(clock=clock, envs_per_worker=1)
    w = bench.worker
    try:
        sent_at = []
        t = T0
        while t < T0 + 10.0:
            clock.t = t
            w.run_timers(t)
            sent_at += [t] * len(bench.out.take(p.WorkerHello, port="steps"))
            t = round(t + 0.01, 6)
        quick = [s for s in sent_at if s < T0 + worker.FIRST_HELLOS_FOR_S]
        later = [s for s in sent_at if s >= T0 + worker.FIRST_HELLOS_FOR_S]
        assert len(quick) == pytest.approx(worker.FIRST_HELLOS_FOR_S / 0.05, abs=2)
        assert len(later) == pytest.approx(7.0 / worker.HELLO_INTERVAL_S, abs=1), later
    finally:
        w.close()


def test_the_hello_repeats_quickly_until_a_broker_answers_then_at_its_interval_with_the_last_seq():
    clock = ManualClock(T0)
    bench = Bench(clock=clock, envs_per_worker=1)
    w = bench.worker
    try:
        def hellos_at(t: float) -> list[p.WorkerHello]:
            clock.t = t
            w.run_timers(t)
            return bench.out.take(p.WorkerHello, port="steps")

        (hello,) = hellos_at(T0)
        assert (hello.worker, hello.incarnation, hello.seq) == ("w", w.incarnation, 0)
        assert (hello.env_id, hello.num_envs, hello.agents) == ("CartPole-v1", 1, [])
        assert hello.spec.obs_shape == [4] and hello.shm == ""
        assert hellos_at(T0 + 0.04) == []
        assert len(hellos_at(T0 + 0.05)) == 1, "until a broker first answers, hellos are quick"
        assert len(hellos_at(T0 + 0.1)) == 1
        clock.t = T0 + 0.6
        w.deliver(b"", p.Reset(epoch=0, seq=41, options={}), now=clock.t)
        assert hellos_at(T0 + 1.0) == [], "the broker spoke 0.4 s ago"
        clock.t = T0 + 1.05
        w.deliver(b"", p.Step(epoch=0, seq=42, policy_version=0,
                              actions=np.zeros(1, np.int64)), now=clock.t)
        assert hellos_at(T0 + 1.5) == []
        (hello,) = hellos_at(T0 + 1.55)
        assert hello.seq == 42, "a new broker continues our numbering"
        assert [h.seq for h in hellos_at(T0 + 2.05)] == [42], "and again while it is silent"
        assert hellos_at(T0 + 2.5) == [], "a broker answered once: the hello interval now"
        assert bench.out.take(p.Heartbeat) == [], "a fast batch needs no busy heartbeat"
    finally:
        w.close()


def test_after_a_stall_what_waits_is_read_before_a_hello_goes_out():
    """A worker that did not run for seconds (starved, or the serial runner's long update) has
    a hello long due and maybe a STEP waiting: the hello must not go first, or it tells a
    broker that has waited over a second for the reply that the STEP was lost. Postponed once
    per hello: a worker late on every pass with nothing arriving still says hello."""
    clock = ManualClock(T0)
    bench = Bench(clock=clock, envs_per_worker=1)
    w = bench.worker

    def stalled(seconds: float) -> list[p.WorkerHello]:
        clock.t = w.now = clock.t + seconds
        w.on_stalled(seconds)
        w.run_timers(clock.t)
        return bench.out.take(p.WorkerHello)

    def step(seq: int) -> list[int]:
        w.deliver(b"", p.Step(epoch=0, seq=seq, policy_version=0,
                              actions=np.zeros(1, np.int64)), now=clock.t)
        return [r.seq for r in bench.out.take(p.StepResult)]

    try:
        w.deliver(b"", p.Reset(epoch=0, seq=1, options={}), now=T0)
        bench.out.take(p.StepResult)
        for seq in (2, 3):  # a stall, a STEP waiting; again after the broker spoke
            assert stalled(0.2) == [], "a short stall, the hello not due: nothing postponed"
            assert stalled(3.0) == [], "the poll comes first"
            assert step(seq) == [seq]
        clock.t += worker.READ_FIRST_S
        w.run_timers(clock.t)
        assert bench.out.take(p.WorkerHello) == [], "the broker just spoke"
        clock.t += worker.HELLO_INTERVAL_S
        w.run_timers(clock.t)
        assert [h.seq for h in bench.out.take(p.WorkerHello)] == [3]
        assert stalled(2.0) == [] and [h.seq for h in stalled(2.0)] == [3], \
            "stalled on every pass with nothing arriving: postponed once"
    finally:
        w.close()


def test_heartbeats_go_on_through_a_batch_blocked_in_native_code():
    """Two env steps of 0.6 s each inside one C call: the heartbeat thread beats meanwhile, and
    the env's wait is not cut short (a timer signal made nanosleep return early)."""
    bench = Bench(env="scripted_envs:c_sleeping_cartpole", envs_per_worker=2)
    try:
        bench.worker.busy_beats = beat_while_envs_run([bench.worker.envs],
                                                      bench.worker.beat_while_busy)
        bench.reset(epoch=0, seq=1)
        bench.out.take(p.Heartbeat)
        bench.beats.clear()
        t0 = time.monotonic()
        (result,) = bench.step(0, 2)
        assert time.monotonic() - t0 >= 1.2, "the env's native wait was cut short"
        assert result.seq == 2
        beats = bench.out.take(p.Heartbeat, port="steps")
        assert 1 <= len(beats) <= 3, beats
        assert (beats[0].role, beats[0].name, beats[0].leaving) == ("worker", "w", False)
        assert len(bench.beats) >= 3, "the controller's link is asked to beat every 0.25 s"
        assert not bench.worker.envs.in_env
        gate = bench.worker.envs.gate
        assert gate is not None and not gate.acquire(blocking=False), "the loop holds it"
    finally:
        bench.worker.close()
    assert not bench.worker.busy_beats.thread.is_alive()


@pytest.mark.parametrize(("envs", "segment"), [(15, False), (16, True)])
def test_by_default_only_batches_of_64_kib_and_up_go_through_shared_memory(envs: int,
                                                                           segment: bool):
    """32x32x4 uint8 frames are 4 KiB a row: 15 envs' batch stays on the socket, 16 envs'
    (64 KiB, shm.MIN_BATCH_BYTES) gets a segment, and the hello names it."""
    assert shm.MIN_BATCH_BYTES == 16 * 32 * 32 * 4
    bench = Bench(name=f"state-{uuid.uuid4().hex[:8]}", env="scripted_envs:stamp_frames",
                  envs_per_worker=envs)
    try:
        w = bench.worker
        assert (w.segment is not None) == segment
        w.run_timers(w.now)
        (hello,) = bench.out.take(p.WorkerHello)
        assert bool(hello.shm) == segment
        assert ("shm_batches" in w.figures()) == segment
    finally:
        bench.worker.close()
    assert not segment or not os.path.exists(os.path.join(shm.DIR, hello.shm))


def test_with_shm_frames_observations_go_through_the_segment_once_the_broker_maps_it():
    name = f"state-{uuid.uuid4().hex[:8]}"
    bench = Bench(name=name, env="scripted_envs:stamp_frames", envs_per_worker=2,
                  shm_frames=True, shm_min_batch_bytes=0)
    try:
        w = bench.worker
        assert w.segment is not None
        w.run_timers(w.now)
        (hello,) = bench.out.take(p.WorkerHello)
        assert hello.shm == w.segment.name and hello.shm_nonce == w.segment.nonce.hex()
        bench.reset(epoch=0, seq=1)
        (result,) = bench.step(0, 2)
        assert isinstance(result.obs, np.ndarray)
        assert result.obs_slot == -1 and result.obs.shape == (2, 32, 32, 4), \
            "the broker has not mapped the segment: rows on the socket"
        reader = shm.Reader(hello.shm, hello.shm_nonce)
        reader.mark()  # the broker maps it, then resets the worker
        bench.reset(epoch=0, seq=3)
        (result,) = bench.step(0, 4)
        assert isinstance(result.obs, np.ndarray)
        assert result.obs.shape == (0, 32, 32, 4) and result.obs_slot >= 0
        rows = reader.view(result.obs_slot, result.obs)
        assert isinstance(rows, np.ndarray) and reader.holds(result.obs_slot, 4)
        assert isinstance(w.envs.last_obs, np.ndarray)
        assert np.array_equal(rows, w.envs.last_obs)
        figures = w.figures()
        assert (figures["shm_batches"], figures["shm_full"], figures["shm_reclaimed"]) == (1, 0, 0)
    finally:
        bench.worker.close()
    assert shm.segment_name(name, bench.worker.incarnation) not in os.listdir(shm.DIR)


def test_barriers_and_shutdowns_from_the_controller_are_not_refused(bench: Bench):
    bench.worker.deliver(b"", p.Barrier(epoch=1, options={}))
    assert bench.out.sent == [] and bench.worker.figures()["rejected"] == 0
    bench.worker.deliver(b"", p.Shutdown(reason="shutdown"))
    assert bench.worker.stop_reason == "shutdown"
