"""Faults injected into a running pipeline: what the user sees, and what is counted."""

from __future__ import annotations

import signal
import time

import numpy as np
import zmq
from conftest import EVERY_UPDATE, Cluster, recv_message, send_message, wait_for
from controller_probe import status_rows

from stepbus.bus import protocol as p


def figure(cluster: Cluster, role: str, key: str, name: str | None = None) -> int:
    rows = [r for r in status_rows(cluster) if r["role"] == role and name in (None, r["name"])]
    return rows[0].get(key, 0) if rows else 0


def test_the_run_survives_the_assembler_being_killed_and_restarted_twice(cluster: Cluster):
    procs = cluster.start_all(trainer_args=EVERY_UPDATE)  # records counted as updates
    for round_ in range(2):
        records = len(cluster.metrics())

        def three_more_updates(n: int = records) -> bool:
            return len(cluster.metrics()) >= n + 3

        wait_for(three_more_updates, 60, "three more updates")
        procs["assembler"].signal(signal.SIGKILL)
        procs["assembler"].wait(5)
        procs["assembler"] = cluster.start("assembler", name=f"assembler-restart{round_}")
        pid = procs["assembler"].pid

        def counts_joined_mid_episode(p: int = pid) -> bool:
            return any(r["pid"] == p and r.get("joined_mid_episode", 0) > 0
                       for r in status_rows(cluster))

        wait_for(counts_joined_mid_episode, 30,
                 "the new assembler to count the agents whose earlier steps died with the old")
    codes = {name: proc.wait(90) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    assert cluster.metrics()[-1]["mean_return"] >= 475


def test_a_worker_whose_batch_takes_longer_than_the_liveness_timeout_is_not_declared_dead(
        cluster: Cluster):
    procs = {"controller": cluster.start("controller"), "broker": cluster.start("broker"),
             "assembler": cluster.start("assembler"),
             "trainer": cluster.start("trainer", "--target-return", "0"),
             "worker": cluster.start("worker", "--env", "scripted_envs:slow_cartpole",
                                     "--envs-per-worker", "4", "--name", "slow")}
    # 4 envs x 0.5 s = 2 s per batch, over the 1.5 s (3 heartbeat intervals) liveness timeout.
    wait_for(lambda: figure(cluster, "assembler", "steps") >= 8, 40,
             "two slow batches to reach the assembler")
    assert figure(cluster, "broker", "workers_lost") == 0
    assert "silent" not in procs["broker"].output()
    assert "expired" not in procs["controller"].output(), "nor does the controller drop it"


def test_a_barrier_completes_without_a_frozen_worker_which_is_served_again_later(
        cluster: Cluster):
    procs = cluster.start_all(trainer_args=("--target-return", "0", *EVERY_UPDATE), workers=2)
    wait_for(lambda: len(cluster.metrics()) >= 2, 60, "training under way (two updates)")
    wait_for(lambda: figure(cluster, "worker", "env_steps", "w1") > 0, 30,
             "the second worker to be served before it is frozen")
    control = cluster.socket(zmq.DEALER, cluster.endpoints["controller"])
    procs["worker1"].signal(signal.SIGSTOP)
    t0 = time.monotonic()  # asked at once, so the worker is frozen, not yet expired, at the start
    send_message(control, p.ResetRequest(options={"level": 2}))
    reply = recv_message(control, timeout=10)
    elapsed = time.monotonic() - t0
    assert isinstance(reply, p.Reply) and reply.ok, reply
    assert "1 workers reset, 1 lost during the barrier" in reply.detail
    assert elapsed < 4.0, "noticed within a few heartbeat intervals"
    procs["worker1"].signal(signal.SIGCONT)
    wait_for(lambda: figure(cluster, "broker", "workers") == 2, 20, "the thawed worker back")
    # Figures travel with heartbeats (every 0.5 s): wait for the one after the stale reply.
    wait_for(lambda: figure(cluster, "broker", "stale_dropped") >= 1, 5,
             "its old reply to be recognised as stale")
    steps = figure(cluster, "worker", "env_steps", "w1")
    wait_for(lambda: figure(cluster, "worker", "env_steps", "w1") > steps + 100, 20,
             "the thawed worker stepping again")


def test_reset_options_an_environment_rejects_fail_the_barrier_clearly_and_the_run_goes_on(
        cluster: Cluster):
    procs = cluster.start_all(trainer_args=("--target-return", "0", *EVERY_UPDATE),
                              worker_args=("--env", "scripted_envs:picky_cartpole",
                                           "--envs-per-worker", "2"))
    wait_for(lambda: len(cluster.metrics()) >= 2, 60, "training under way")
    res = cluster.cli("reset", "--option", "level=9")
    assert res.returncode == 1
    assert "ValueError: no level 9" in res.stdout
    steps = cluster.metrics()[-1]["env_steps"]
    wait_for(lambda: cluster.metrics()[-1]["env_steps"] > steps + 500, 30, "stepping on")
    assert procs["worker0"].popen.poll() is None


def test_the_credit_window_allows_for_the_horizon_the_assembler_runs_with(cluster: Cluster):
    """The assembler's --horizon reaches the broker through the controller's run state."""
    for role in ("controller", "broker", "worker"):
        cluster.start(role)
    cluster.start("trainer", "--batch-steps", "256")
    cluster.start("assembler", "--horizon", "500")
    # Two batches, and for each of the 8 envs a partial trajectory of up to 500 steps, the step
    # awaiting its reward and the step in flight.
    wait_for(lambda: figure(cluster, "broker", "credit_window") == 2 * 256 + 8 * 502, 60,
             "a credit window that allows for the assembler's horizon")


def test_a_window_too_small_for_the_partial_trajectories_grows_instead_of_stalling(
        cluster: Cluster):
    procs = {"controller": cluster.start("controller"),
             "broker": cluster.start("broker", "--max-steps-ahead", "256"),
             "assembler": cluster.start("assembler", "--horizon", "500"),
             "worker": cluster.start("worker"),
             "trainer": cluster.start("trainer", "--target-return", "200")}
    # 8 envs x 500 steps can sit in partial trajectories: far more than a 256-step window.
    wait_for(lambda: figure(cluster, "broker", "credit_topups") >= 1, 60, "a credit top-up")
    codes = {name: proc.wait(90) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    assert cluster.metrics()[-1]["mean_return"] >= 200


def test_a_late_reply_from_a_worker_the_broker_still_knows_is_dropped_as_stale(
        cluster: Cluster):
    """A scripted worker that 'loses' a reply: the broker resets it, then the late reply
    arrives and must fail the sequence check instead of being taken for the reset's answer."""
    procs = {"controller": cluster.start("controller"), "broker": cluster.start("broker"),
             "assembler": cluster.start("assembler"),
             "trainer": cluster.start("trainer", "--target-return", "0")}
    worker = cluster.socket(zmq.DEALER, cluster.endpoints["steps"])
    worker.setsockopt(zmq.IDENTITY, b"scripted")
    spec = p.SpaceSpec([4], "<f4", "discrete", action_n=2)
    hello = p.WorkerHello(worker="scripted", incarnation="s1", env_id="CartPole-v1",
                          num_envs=1, seed=0, spec=spec, seq=0)

    def result(msg: p.Reset | p.Step, first: bool) -> p.StepResult:
        return p.StepResult(incarnation="s1", epoch=msg.epoch, seq=msg.seq, first=first,
                            obs=np.zeros((1, 4), np.float32), reward=np.ones(1, np.float32),
                            terminated=np.zeros(1, bool), truncated=np.zeros(1, bool),
                            final_obs=np.zeros((0, 4), np.float32))

    send_message(worker, hello)
    reset = recv_message(worker, timeout=10)
    assert isinstance(reset, p.Reset)
    send_message(worker, result(reset, first=True))
    step = None  # once the trainer's weights are in; idle hellos keep the worker alive till then
    deadline = time.monotonic() + 30
    while step is None and time.monotonic() < deadline:
        send_message(worker, hello)
        if worker.poll(500):
            step = p.decode(worker.recv_multipart())
    assert isinstance(step, p.Step) and step.seq == reset.seq + 1
    # Play dead for a moment but stay alive: idle hellos make the broker give up on the step.
    deadline = time.monotonic() + 10
    again = None
    while again is None and time.monotonic() < deadline:
        send_message(worker, hello)
        if worker.poll(500):
            again = p.decode(worker.recv_multipart())
    assert isinstance(again, p.Reset) and again.seq > step.seq
    send_message(worker, result(step, first=False))  # the late reply to the old step
    send_message(worker, result(again, first=True))
    nxt = recv_message(worker, timeout=10)
    assert isinstance(nxt, p.Step) and nxt.seq == again.seq + 1, "the reset's answer was used"
    wait_for(lambda: figure(cluster, "broker", "stale_dropped") >= 1, 10,
             "the late reply counted as stale")
    # The step whose reply came too late is one gap (counted as lost), and the late reply
    # itself never reached the assembler (that would have been a second gap).
    wait_for(lambda: figure(cluster, "assembler", "gaps") >= 1, 10, "the lost step counted")
    assert figure(cluster, "assembler", "gaps") == 1
    assert procs["broker"].popen.poll() is None
