"""The step broker killed (SIGKILL) and restarted under a running pipeline: what the user sees in
`stepbus status` and the metrics, what is counted, and how fast the run is back."""

from __future__ import annotations

import json
import re
import signal
import time
from typing import Any

import pytest
import zmq
from conftest import EVERY_UPDATE, Cluster, Proc, recv_message, send_message, wait_for

from stepbus.bus import protocol as p
from stepbus.bus import wiring


class Status:
    """`stepbus status` without a process start per look: the same StatusReply the CLI prints,
    asked over one socket, so timings can be polled at 50 ms instead of ~0.5 s per CLI run."""

    def __init__(self, cluster: Cluster) -> None:
        self.sock = cluster.socket(zmq.DEALER, cluster.endpoints["controller"])

    def rows(self, role: str, **match: Any) -> list[dict]:
        send_message(self.sock, p.StatusRequest())
        reply = recv_message(self.sock, timeout=5)
        assert isinstance(reply, p.StatusReply), reply
        return [r for r in reply.processes if r["role"] == role
                and all(r.get(k) == v for k, v in match.items())]

    def figure(self, role: str, key: str, **match: Any) -> Any:
        """The figure of the one matching process (None while it is not registered)."""
        rows = self.rows(role, **match)
        return rows[0].get(key) if len(rows) == 1 else None

    def known(self, role: str, key: str, **match: Any) -> Any:
        """The figure once the process is registered and reports it (one heartbeat at most)."""
        return wait_for(lambda: self.figure(role, key, **match) is not None
                        and [self.figure(role, key, **match)], 5, f"{role} {key}")[0]

    def close(self) -> None:
        self.sock.close(0)


def cli_status(cluster: Cluster) -> list[dict]:
    res = cluster.cli("status", "--json", "--timeout", "5")
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)["processes"]


@pytest.mark.solo  # reads figures settling while no broker runs: a neighbour test skews them
def test_the_run_survives_the_broker_being_killed_and_restarted(cluster: Cluster):
    # Records are counted as updates here, to time the first ones after the restart.
    procs = cluster.start_all(trainer_args=("--target-return", "0", *EVERY_UPDATE), workers=2)
    status = Status(cluster)
    try:
        wait_for(lambda: len(cluster.metrics()) >= 3, 60, "training under way")
        for w in ("w0", "w1"):
            def stepping(name: str = w) -> bool:
                return (status.figure("worker", "env_steps", name=name) or 0) > 0

            wait_for(stepping, 20, f"worker {w} stepping")
        old_pid = procs["broker"].pid
        version_before = status.known("broker", "policy_version", pid=old_pid)
        closed_before = status.known("assembler", "closed_truncated")
        trainer_at_kill = status.known("trainer", "policy_version")

        procs["broker"].signal(signal.SIGKILL)
        assert procs["broker"].wait(5) == -signal.SIGKILL
        dead_broker = procs.pop("broker")
        time.sleep(1.0)  # the outage: workers wait on a reply that will never come

        *worker_steps, assembler_steps = figures_once_settled(status)
        stalled = dict(zip(("w0", "w1"), worker_steps, strict=True))
        trainer_version = status.known("trainer", "policy_version")
        # Every env step a worker took completed a transition in the assembler or was lost with
        # the broker, 8 envs at a time: per worker at most the reply it answered but had not
        # forwarded (actions go out first) and the one that went to the dead broker.
        lost = sum(worker_steps) - assembler_steps
        print(f"\nenv steps lost with the dead broker: {lost} (workers' env_steps minus the "
              f"assembler's steps)")
        assert lost % 8 == 0 and 0 <= lost <= 2 * 2 * 8, lost
        records_at_restart = len(cluster.metrics())

        t_start = time.monotonic()
        procs["broker"] = broker = cluster.start("broker", name="broker-restarted")
        seen = restart_milestones(cluster, status, broker, stalled, trainer_version,
                                  records_at_restart)
        assert_back_in_time(seen, t_start)

        # The new broker's first weights were published after the kill (up to 4 wait in the
        # trainer's queue while no broker is there), so they are at least what the old broker
        # had; the trainer's starving re-publish then brings its newest within 0.25 s.
        first = re.search(r"connected at policy version (\d+)", broker.output())
        assert first is not None, broker.output()
        assert int(first[1]) >= max(version_before, trainer_at_kill)
        wait_for(lambda: (status.figure("broker", "policy_version", pid=broker.pid) or -1)
                 >= trainer_version, 5, "the new broker to have the trainer's newest weights")

        # Training goes on, and versions only ever increase across the restart.
        wait_for(lambda: len(cluster.metrics()) >= records_at_restart + 3, 30,
                 "three more updates after the restart")
        versions = [r["policy_version"] for r in cluster.metrics()]
        assert versions == sorted(versions) and len(set(versions)) == len(versions)

        assert_the_dead_brokers_losses_counted(cluster, status, broker, closed_before,
                                               version_before)
        assert_clean_shutdown(cluster, procs, dead_broker)
    finally:
        status.close()


def figures_once_settled(status: Status) -> tuple[int, ...]:
    """Nothing steps without a broker: the figures the run resumes from (each worker's
    env_steps, then the assembler's steps), read until two looks a heartbeat apart agree
    (figures travel with 0.5 s heartbeats)."""
    def idle_figures() -> tuple[int, ...]:
        return (*(status.known("worker", "env_steps", name=w) for w in ("w0", "w1")),
                status.known("assembler", "steps"))

    looks = [idle_figures()]

    def settled() -> bool:
        looks.append(idle_figures())
        return looks[-1] == looks[-2]

    time.sleep(0.6)  # the next look is a heartbeat later
    wait_for(settled, 10, "the figures to settle while no broker runs", interval=0.6)
    return looks[-1]


def restart_milestones(cluster: Cluster, status: Status, broker: Proc, stalled: dict[str, int],
                       trainer_version: int, records_at_restart: int) -> dict[str, float]:
    """When (monotonic) each thing the user waits for after a broker restart first showed:
    the new broker bound, each worker's hello at it and its steps counting again (past
    `stalled`), the first two policy updates past `trainer_version`."""
    seen: dict[str, float] = {}

    def milestones() -> bool:
        """Notes when each thing the user waits for first shows (polled together)."""
        now = time.monotonic()
        if "bound" not in seen and "broker: workers on" in broker.output():
            seen["bound"] = now
        for w, steps in stalled.items():
            if f"{w} joined" not in seen and f"worker {w} joined" in broker.output():
                seen[f"{w} joined"] = now  # its hello reached the new broker
            if w not in seen and (status.figure("worker", "env_steps", name=w) or 0) > steps:
                seen[w] = now
        updates = [r for r in cluster.metrics()[records_at_restart:]
                   if r["policy_version"] > trainer_version]
        for i, key in enumerate(("update1", "update2")):
            if key not in seen and len(updates) > i:
                seen[key] = now
        return len(seen) == 7

    wait_for(milestones, 20, "the new broker bound, both workers served, two updates")
    return seen


def assert_back_in_time(seen: dict[str, float], t_start: float) -> None:
    """Prints how long after the new broker started (`t_start`) each milestone showed; the
    workers are served again within a few seconds of its binding."""
    t_bound, t_served = seen["bound"], max(seen["w0"], seen["w1"])
    t_update = seen["update1"]
    t_joined = max(seen["w0 joined"], seen["w1 joined"])
    print(f"\nbroker restart, s after the new process started: bound "
          f"{t_bound - t_start:.2f}; both workers' hellos in {t_joined - t_start:.2f}; "
          f"both served again {t_served - t_start:.2f} (figures ride 0.5 s heartbeats); "
          f"policy updates {t_update - t_start:.2f}, {seen['update2'] - t_start:.2f}")
    assert t_served - t_bound < 5.0, "workers reconnect within a few seconds"


def assert_the_dead_brokers_losses_counted(cluster: Cluster, status: Status, broker: Proc,
                                           closed_before: int, version_before: int) -> None:
    """What the dead broker took with it is counted: each worker's open trajectories were
    closed as truncated (bootstrapped from the last observation seen), none joined to steps
    after the restart, and the lost steps show as gaps and steps_lost."""
    wait_for(lambda: (status.figure("assembler", "closed_truncated") or 0)
             >= closed_before + 2, 10, "the workers' open trajectories closed as truncated")
    rows = {(r["role"], r.get("pid")): r for r in cli_status(cluster)}  # as the user sees it
    trainer_row = next(r for (role, _), r in rows.items() if role == "trainer")
    assembler_row = next(r for (role, _), r in rows.items() if role == "assembler")
    broker_row = rows[("broker", broker.pid)]
    print(f"after the restart: assembler {assembler_row}\nbroker {broker_row}")
    assert trainer_row["rejected"] == 0, "no malformed trajectory reached the trainer"
    assert assembler_row["rejected"] == 0
    # Each worker's reply to the dead broker is lost: one gap in its sequence numbers (the
    # new broker continues them), and its envs' chosen actions never got their results.
    assert 1 <= assembler_row["gaps"] <= 2, assembler_row
    assert 1 <= assembler_row["steps_lost"] <= 2 * 8, assembler_row
    assert broker_row["rejected"] == 0 and broker_row["workers"] == 2
    assert broker_row["policy_version"] >= version_before


def assert_clean_shutdown(cluster: Cluster, procs: dict[str, Proc], dead_broker: Proc) -> None:
    """`stepbus shutdown` ends every process with exit code 0, and no process, the killed
    broker included, printed a traceback."""
    done = cluster.cli("shutdown")
    assert done.returncode == 0, done.stdout + done.stderr
    deadline = time.monotonic() + 20
    codes = {name: proc.wait(max(0.1, deadline - time.monotonic()))
             for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    for proc in (*procs.values(), dead_broker):
        assert "Traceback" not in proc.output(), proc.output()


def test_a_restarted_broker_resets_workers_into_the_runs_epoch_with_its_options(
        cluster: Cluster, monkeypatch):
    """The controller remembers the last barrier's epoch and options; a new broker must reset
    workers with them, never first without them (a spell of unconfigured envs). The controller
    is frozen while the new broker starts, so the workers' hellos surely come first."""
    reset_log = cluster.dir / "resets.jsonl"
    monkeypatch.setenv("RESET_LOG", str(reset_log))
    procs = cluster.start_all(trainer_args=("--target-return", "0", *EVERY_UPDATE), workers=2,
                              worker_args=("--env", "scripted_envs:recording_cartpole",
                                           "--envs-per-worker", "3"))
    status = Status(cluster)
    try:
        wait_for(lambda: len(cluster.metrics()) >= 2, 60, "training under way")
        done = cluster.cli("reset", "--option", "level=3")
        assert done.returncode == 0, done.stdout + done.stderr
        procs["broker"].signal(signal.SIGKILL)
        procs["broker"].wait(5)
        procs.pop("broker")
        procs["controller"].signal(signal.SIGSTOP)
        logged = len(reset_log.read_text().splitlines())
        records = len(cluster.metrics())
        procs["broker"] = broker = cluster.start("broker", name="broker-restarted")
        wait_for(lambda: all(re.search(rf"worker {w} (joined|waits)", broker.output())
                             for w in ("w0", "w1")), 10, "both workers' hellos at the new broker")
        procs["controller"].signal(signal.SIGCONT)
        wait_for(lambda: len(cluster.metrics()) >= records + 2, 30, "training after the restart")
        # Training may go on from data already in the pipeline: wait for the new broker's resets.
        wait_for(lambda: len(reset_log.read_text().splitlines()) > logged, 30,
                 "the new broker's resets")
        resets = [json.loads(line) for line in reset_log.read_text().splitlines()[logged:]]
        assert resets and all(r == {"level": 3} for r in resets), resets
        # Its first heartbeat may predate the controller's answer: wait for the epoch it took.
        wait_for(lambda: status.figure("broker", "epoch", pid=broker.pid) == 1, 10,
                 "the new broker to report the run's epoch")
        assert "Traceback" not in broker.output()
    finally:
        status.close()


FREEZE_S = 5.0  # over 3x the 1.5 s liveness: the broker must not take its own stall for theirs


def test_a_broker_resumed_after_a_freeze_keeps_its_links_and_loses_no_worker(
        cluster: Cluster):
    names = list(cluster.endpoints)  # on TCP, whose links must outlive the freeze
    cluster.endpoints = {n: f"tcp://127.0.0.1:{port}" for n, port in
                         zip(names, wiring.free_tcp_ports(len(names)), strict=True)}
    procs = cluster.start_all(trainer_args=("--target-return", "0"), workers=2)
    status = Status(cluster)
    try:
        for w in ("w0", "w1"):
            def stepping(name: str = w) -> bool:
                return (status.figure("worker", "env_steps", name=name) or 0) > 0

            wait_for(stepping, 60, f"worker {w} stepping")
        procs["broker"].signal(signal.SIGSTOP)
        time.sleep(FREEZE_S)  # the fault under test is the freeze's length itself
        procs["broker"].signal(signal.SIGCONT)
        steps = {w: status.known("worker", "env_steps", name=w) for w in ("w0", "w1")}
        for w in ("w0", "w1"):
            def stepping_again(name: str = w) -> bool:
                return status.figure("worker", "env_steps", name=name) > steps[name]

            wait_for(stepping_again, 20, f"worker {w} stepping again after the freeze")
        assert status.known("broker", "workers_lost") == 0, "no worker was really lost"
        assert status.known("broker", "stale_hellos") == 0, "the links outlived the freeze"
    finally:
        status.close()
    log = procs["broker"].output()
    assert log.count(" joined: ") == 2 and "unreachable" not in log, log[-3000:]
    assert "restarted (incarnation" not in log
