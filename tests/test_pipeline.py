"""The whole pipeline as a user runs it: real processes, real sockets, real learning."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
from conftest import EVERY_UPDATE, Cluster, honcho, interrupt_honcho, wait_for
from controller_probe import status_rows

REPO = Path(__file__).resolve().parents[1]


def exits(procs, timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    return {name: proc.wait(max(0.1, deadline - time.monotonic())) for name, proc in procs.items()}


def test_a_run_given_no_target_return_ends_at_the_reward_threshold_its_env_declares(
        cluster: Cluster):
    """Nobody tells the learner the goal: the worker declares its env's reward_threshold (30
    for this registration) and the learner ends the run there, as it would Acrobot-v1's -100."""
    procs = cluster.start_all(worker_args=("--env", "scripted_envs:EasyCartPole-v0"))
    codes = exits(procs, timeout=60)
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    said = procs["trainer"].output()
    assert ("the run ends once the mean return of the last 20 episodes reaches 30 (env "
            "scripted_envs:EasyCartPole-v0's reward_threshold)") in said
    assert "solved: mean return" in said
    assert 30 <= cluster.metrics()[-1]["mean_return"] < 475


def test_killed_trainer_resumes_from_its_checkpoint_with_a_higher_policy_version(cluster: Cluster):
    procs = cluster.start_all(trainer_args=("--checkpoint-interval-s", "0.2", *EVERY_UPDATE))
    wait_for(lambda: len(cluster.metrics()) >= 15 and list(cluster.runs_dir.glob(
        "*/checkpoint.npz")), 60, "15 updates and a checkpoint")
    learner_pid = wait_for(lambda: [r["pid"] for r in status_rows(cluster)
                                     if r["role"] == "trainer"], 10, "the learner's row")[0]
    procs["trainer"].signal(signal.SIGKILL)  # the trainer slot, not its learner
    procs["trainer"].wait(5)
    wait_for(lambda: learner_pid not in cluster.strays(), 10,
             "the orphaned learner to leave by itself")
    killed_at = max(r["policy_version"] for r in cluster.metrics())
    with np.load(cluster.runs_dir / "latest" / "checkpoint.npz") as saved:
        checkpointed_steps = json.loads(bytes(saved["meta"]))["progress"]["env_steps"]
    assert checkpointed_steps > 0
    procs["trainer"] = cluster.start("trainer")
    codes = exits(procs, timeout=90)
    assert codes == {**dict.fromkeys(procs, 0), "trainer": 0}, cluster.dump()
    records = cluster.metrics()
    second = [r for r in records if r["generation"] == 2]
    assert second, "the new trainer wrote to the same run"
    assert min(r["policy_version"] for r in second) > killed_at
    assert second[0]["env_steps"] > checkpointed_steps, "progress was resumed, not restarted"
    assert "resumed from" in procs["trainer"].output()
    assert records[-1]["mean_return"] >= 475


def test_reset_barrier_resets_every_env_with_the_options_and_stepping_resumes(cluster: Cluster):
    reset_log = cluster.dir / "resets.jsonl"
    os.environ["RESET_LOG"] = str(reset_log)
    try:
        procs = {"controller": cluster.start("controller"), "broker": cluster.start("broker"),
                 "assembler": cluster.start("assembler"),
                 "trainer": cluster.start("trainer", "--target-return", "0", *EVERY_UPDATE)}
        for i in range(2):
            procs[f"w{i}"] = cluster.start("worker", "--env", "scripted_envs:recording_cartpole",
                                           "--envs-per-worker", "3", "--name", f"w{i}")
        wait_for(lambda: len(cluster.metrics()) >= 3, 60, "training under way")

        def both_workers_served() -> bool:
            return sum(r["role"] == "worker" and r.get("env_steps", 0) > 0
                       for r in status_rows(cluster)) == 2

        wait_for(both_workers_served, 30, "both workers stepping")
        done = cluster.cli("reset", "--option", "level=3", "--option", "mode=hard")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "2 workers reset" in done.stdout
        resets = [json.loads(line) for line in reset_log.read_text().splitlines()]
        assert resets.count({"level": 3, "mode": "hard"}) >= 6, "every env of every worker"
        steps_at_barrier = cluster.metrics()[-1]["env_steps"]
        wait_for(lambda: cluster.metrics()[-1]["env_steps"] > steps_at_barrier + 1000, 30,
                 "stepping to resume after the barrier")
        status = cluster.cli("status", "--json")
        assert status.returncode == 0
        roles = sorted(row["role"] for row in json.loads(status.stdout)["processes"])
        assert roles == ["assembler", "broker", "controller", "slot", "trainer", "worker", "worker"]
        assert cluster.cli("shutdown").returncode == 0
        assert exits(procs, timeout=10) == dict.fromkeys(procs, 0), cluster.dump()
    finally:
        os.environ.pop("RESET_LOG", None)


def test_status_names_the_address_it_tried_when_no_controller_answers(cluster: Cluster):
    res = cluster.cli("status", "--controller", "tcp://127.0.0.1:9", "--timeout", "0.5")
    assert res.returncode != 0
    assert "tcp://127.0.0.1:9" in res.stderr


def test_honcho_start_with_three_workers_solves_cartpole_and_exits_zero(cluster: Cluster):
    """The whole pipeline as the Procfile starts it learns CartPole from a random policy's
    return to the threshold, every policy version newer than the last, and stops itself."""
    proc = honcho(cluster, "-c", "worker=3")
    try:
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (cluster.dir / "honcho.out").read_text()
    assert rc == 0, out[-5000:]
    assert cluster.strays() == [], "no process is left behind"
    assert out.count("stopped (rc=0)") == 7, out[-5000:]
    assert "Traceback" not in out
    assert "worker.3" in out
    records = cluster.metrics()
    assert records[-1]["mean_return"] >= 475
    assert records[0]["mean_return"] < 100, "the return rose from a random policy's"
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)


def test_ctrl_c_in_honcho_stops_every_process_within_five_seconds(cluster: Cluster):
    proc = honcho(cluster, target="0")
    try:
        wait_for(lambda: len(cluster.metrics()) >= 3, 60, "training under way")
        interrupt_honcho(cluster, proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert list(cluster.runs_dir.glob("*/checkpoint.npz")), "the trainer checkpointed"


def test_start_order_does_not_matter_and_nothing_is_stepped_before_the_assembler_listens(
        cluster: Cluster):
    procs = {"trainer": cluster.start("trainer", "--target-return", "150"),
             "worker": cluster.start("worker"), "broker": cluster.start("broker")}
    wait_for(lambda: "waiting for controller" in procs["trainer"].output(), 30,
             "the trainer to say what it waits for")
    procs["controller"] = cluster.start("controller")

    def broker_holds_stepping() -> bool:
        return any(r["role"] == "broker" and r.get("assembler_blocked") and
                   r["policy_version"] >= 0 for r in status_rows(cluster))

    wait_for(broker_holds_stepping, 30, "a broker with weights and a worker but no assembler")
    procs["assembler"] = cluster.start("assembler")
    codes = exits(procs, timeout=90)
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    assert cluster.metrics()[-1]["mean_return"] >= 150
    assert "experience dropped" not in procs["broker"].output()


def test_an_environment_that_raises_is_reported_recreated_and_the_run_goes_on(cluster: Cluster):
    procs = {"controller": cluster.start("controller"), "broker": cluster.start("broker"),
             "assembler": cluster.start("assembler"),
             "trainer": cluster.start("trainer", "--target-return", "0"),
             "worker": cluster.start("worker", "--env", "scripted_envs:flaky_cartpole",
                                     "--envs-per-worker", "2")}
    wait_for(lambda: "simulated physics blow-up" in procs["controller"].output(), 60,
             "the controller to log the worker's error")
    controller_log = procs["controller"].output()
    assert "RuntimeError" in controller_log and "Traceback" in controller_log
    assert "scripted_envs:flaky_cartpole" in controller_log, "the env id travels with the error"
    assert "recreating it" in procs["worker"].output()
    steps = cluster.metrics()[-1]["env_steps"] if cluster.metrics() else 0
    wait_for(lambda: cluster.metrics() and cluster.metrics()[-1]["env_steps"] > steps + 500, 30,
             "stepping to go on after the error")

    def worker_errors() -> int:
        (worker,) = [r for r in status_rows(cluster) if r["role"] == "worker"]
        return worker.get("env_errors", 0)

    wait_for(lambda: worker_errors() >= 1, 10, "status to count the env error (next heartbeat)")
    assert cluster.cli("shutdown").returncode == 0
    assert exits(procs, timeout=10) == dict.fromkeys(procs, 0), cluster.dump()


def test_a_worker_with_an_unknown_env_or_bad_flags_exits_2_at_once_with_one_clear_line(
        cluster: Cluster):
    """Before it looks for a controller (none runs here, and it is told to ask one where the
    broker is), so the error is not blamed on anything else."""
    no_broker = {"STEPBUS_STEPS": ""}
    proc = cluster.start("worker", "--env", "NoSuchEnv-v0", env=no_broker)
    assert proc.wait(30) == 2
    out = proc.output()
    assert "cannot create environment 'NoSuchEnv-v0'" in out and "Traceback" not in out
    proc = cluster.start("worker", "--envs-per-worker", "0", env=no_broker)
    assert proc.wait(30) == 2
    assert "argument --envs-per-worker: must be 1 to 65536, not 0" in proc.output()
    proc = cluster.start("worker", "--envs", "4", env=no_broker)  # abbreviations are typos
    assert proc.wait(30) == 2
    assert "unrecognized arguments: --envs 4" in proc.output()


def test_continuous_actions_flow_through_the_pipeline(cluster: Cluster):
    procs = cluster.start_all(trainer_args=("--target-return", "0"),
                              worker_args=("--env", "Pendulum-v1"))
    wait_for(lambda: cluster.metrics() and cluster.metrics()[-1]["episodes"] >= 8, 60,
             "eight 200-step Pendulum-v1 episodes")
    records = cluster.metrics()
    assert records[-1]["env_steps"] >= 8 * 200 and records[-1]["mean_return"] < 0
    assert all(np.isfinite(r["policy_loss"]) for r in records)
    assert cluster.cli("shutdown").returncode == 0
    assert exits(procs, timeout=10) == dict.fromkeys(procs, 0), cluster.dump()
