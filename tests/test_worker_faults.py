"""Workers that stall, fail, die or freeze in a running pipeline: what the rest of the pipeline
does about it, read from `stepbus status --json` and the process logs.

Figures travel with heartbeats (every 0.5 s), so every check on them waits for the value;
none reads a single snapshot and hopes it is fresh.
"""

from __future__ import annotations

import re
import signal
import time

from conftest import Cluster, Proc, wait_for
from controller_probe import status_rows

SLEEPY = ("--env", "scripted_envs:sleepy_cartpole", "--envs-per-worker", "2")


def figure(cluster: Cluster, role: str, key: str, *, name: str | None = None,
           pid: int | None = None) -> int | None:
    """A figure from the newest heartbeat of one process; None while that process has no row
    (so a missing process is never read as a zero)."""
    for row in status_rows(cluster):
        if row["role"] == role and name in (None, row["name"]) and pid in (None, row["pid"]):
            return row.get(key, 0)
    return None


def read(cluster: Cluster, role: str, key: str, **which) -> int:
    """A figure, once that process has a row in status."""
    seen: list[int] = []

    def present() -> bool:
        value = figure(cluster, role, key, **which)
        seen.extend([] if value is None else [value])
        return value is not None

    wait_for(present, 20, f"{role} {which or ''} {key} in status")
    return seen[-1]


def grows(cluster: Cluster, role: str, key: str, by: int = 1, **which) -> None:
    """Wait until a figure is at least `by` above its current value."""
    start = read(cluster, role, key, **which)
    wait_for(lambda: (figure(cluster, role, key, **which) or 0) >= start + by, 30,
             f"{role} {which or ''} {key} to grow by {by} from {start}")


def lost_line(broker: Proc, worker: str) -> re.Match | None:
    return re.search(rf"worker {worker} (silent for [\d.]+s|unreachable)", broker.output())


def test_one_env_step_longer_than_the_liveness_timeout_does_not_make_the_worker_look_dead(
        cluster: Cluster):
    procs = cluster.start_all(trainer_args=("--target-return", "0"), worker_args=(
        "--env", "scripted_envs:stalling_cartpole", "--envs-per-worker", "1", "--name", "stalling"))
    # Every single env.step takes 2.5 s, over the 1.5 s (3 heartbeat intervals) timeout.
    wait_for(lambda: (figure(cluster, "assembler", "steps") or 0) >= 2, 60,
             "two 2.5 s steps to reach the assembler")
    assert figure(cluster, "broker", "workers_lost") == 0, cluster.dump()
    assert "stalling silent" not in procs["broker"].output()
    assert "stalling expired" not in procs["controller"].output(), "the controller keeps it too"
    assert procs["broker"].output().count("worker stalling joined") == 1
    assert procs["worker0"].popen.poll() is None


def test_an_env_that_keeps_raising_makes_its_worker_exit_1_with_one_line_saying_what_to_do(
        cluster: Cluster):
    procs = cluster.start_all(trainer_args=("--target-return", "0"), worker_args=(
        "--env", "scripted_envs:broken_cartpole", "--envs-per-worker", "2", "--name", "broken"))
    assert procs["worker0"].wait(60) == 1, cluster.dump()
    out = procs["worker0"].output()
    (line,) = [x for x in out.splitlines() if "keeps raising" in x]
    assert ("scripted_envs:broken_cartpole keeps raising: 11 env restarts within 60 s" in line
            and "RuntimeError: simulated broken build" in line
            and "over --max-env-restarts-per-minute 10; fix the environment" in line
            and line.endswith("worker exiting")), line
    assert out.count("raised RuntimeError: simulated broken build") == 11, "one line per error"
    assert "Traceback" not in out, "no traceback spam in the worker's own log"
    # The controller logs each reported error with its traceback, at most once per error: the
    # last ones may reach its log after the worker has exited.
    wait_for(lambda: "Traceback" in procs["controller"].output(), 30,
             "the controller's log of the errors")
    assert 1 <= procs["controller"].output().count("Traceback") <= 11
    assert procs["broker"].popen.poll() is None, "the rest of the pipeline stays up"


def test_a_worker_killed_mid_step_is_counted_lost_the_other_steps_on_and_a_restart_is_served(
        cluster: Cluster):
    procs = cluster.start_all(trainer_args=("--target-return", "0"), worker_args=SLEEPY,
                              workers=2)
    grows(cluster, "worker", "env_steps", 20, name="w1")  # being served, nearly always mid-step
    truncated = read(cluster, "assembler", "closed_truncated")
    procs["worker1"].signal(signal.SIGKILL)
    t0 = time.monotonic()
    line = wait_for(lambda: lost_line(procs["broker"], "w1"), 20, "the broker to give up on w1")
    print(f"broker: worker w1 {line.group(1)}; seen by the test {time.monotonic() - t0:.1f}s "
          "after SIGKILL")
    wait_for(lambda: (figure(cluster, "broker", "workers_lost") or 0) >= 1, 10,
             "workers_lost counted")
    wait_for(lambda: (figure(cluster, "assembler", "closed_truncated") or 0) > truncated, 10,
             "its open trajectories closed as truncated")
    grows(cluster, "worker", "env_steps", 100, name="w0")  # the other keeps stepping
    again = cluster.start("worker", "--name", "w1", "--worker-index", "1", *SLEEPY,
                          name="w1-restarted")
    wait_for(lambda: (figure(cluster, "worker", "env_steps", pid=again.pid) or 0) > 0, 30,
             "the restarted w1 to be served")
    assert procs["broker"].output().count("worker w1 joined") == 2, cluster.dump()
    assert procs["broker"].popen.poll() is None and procs["worker0"].popen.poll() is None


def test_a_frozen_worker_is_lost_then_its_stale_reply_is_dropped_and_it_is_served_again(
        cluster: Cluster):
    procs = cluster.start_all(trainer_args=("--target-return", "0"), worker_args=SLEEPY,
                              workers=2)
    grows(cluster, "worker", "env_steps", 20, name="w1")
    stale = read(cluster, "broker", "stale_dropped")
    procs["worker1"].signal(signal.SIGSTOP)  # nearly always inside a 5 ms step, or about to be
    t0 = time.monotonic()
    # Thawed as soon as the broker gives up on it: the connection stays up however long the
    # freeze, so the reply to the step it was frozen in arrives late, to be counted as stale.
    line = wait_for(lambda: lost_line(procs["broker"], "w1"), 20, "the broker to give up on w1",
                    interval=0.02)
    procs["worker1"].signal(signal.SIGCONT)
    print(f"broker: worker w1 {line.group(1)}; thawed {time.monotonic() - t0:.1f}s after SIGSTOP")
    # Back: the broker forgot it, so it joins anew (same incarnation) and is reset; the reply
    # to the step it was frozen in carries an old sequence number and is dropped, counted.
    wait_for(lambda: procs["broker"].output().count("worker w1 joined") == 2, 20,
             "w1 to re-announce itself")
    wait_for(lambda: (figure(cluster, "broker", "stale_dropped") or 0) > stale, 10,
             "its late reply counted as stale")
    wait_for(lambda: (figure(cluster, "broker", "workers_lost") or 0) >= 1, 10,
             "workers_lost counted")
    grows(cluster, "worker", "env_steps", 100, name="w1")  # served again
    # Never double-counted: the assembler checks every experience message against the
    # worker's previous sequence number; a replayed or duplicated reply would be a gap there.
    grows(cluster, "assembler", "steps")  # a heartbeat newer than all of this
    assert figure(cluster, "assembler", "gaps") == 0, cluster.dump()
    assert figure(cluster, "assembler", "rejected") == 0
    assert all(proc.popen.poll() is None for proc in procs.values()), cluster.dump()
