"""Reset barriers beyond the basic one in test_pipeline: late joiners and the learner's own call."""

from __future__ import annotations

import json

from conftest import EVERY_UPDATE, Cluster, wait_for

RECORDING = ("--env", "scripted_envs:recording_cartpole", "--envs-per-worker", "3")


def resets(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_worker_that_joins_after_a_barrier_resets_with_its_options(cluster: Cluster):
    first, late = cluster.dir / "first.jsonl", cluster.dir / "late.jsonl"
    procs = {role: cluster.start(role) for role in ("controller", "broker", "assembler")}
    procs["w0"] = cluster.start("worker", *RECORDING, "--name", "w0", env={"RESET_LOG": str(first)})
    procs["trainer"] = cluster.start("trainer", "--target-return", "0", *EVERY_UPDATE)
    wait_for(lambda: len(cluster.metrics()) >= 2, 60, "training under way (two updates)")
    done = cluster.cli("reset", "--option", "level=3")
    assert done.returncode == 0, done.stdout + done.stderr
    procs["w1"] = cluster.start("worker", *RECORDING, "--name", "w1", "--worker-index", "1",
                                env={"RESET_LOG": str(late)})
    # First the start-up probe: an extra env, reset once to see whether info has action masks.
    wait_for(lambda: len(resets(late)) >= 4, 30, "the late worker's first resets")
    assert resets(late)[0] == {}
    assert resets(late)[1:4] == [{"level": 3}] * 3, "reset into the current epoch's options"
    assert cluster.cli("shutdown").returncode == 0
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()


def test_the_learner_can_ask_for_a_barrier_curriculum_style(cluster: Cluster):
    log = cluster.dir / "resets.jsonl"
    procs = {role: cluster.start(role) for role in ("controller", "broker", "assembler")}
    procs["w0"] = cluster.start("worker", *RECORDING, "--name", "w0", env={"RESET_LOG": str(log)})
    procs["trainer"] = cluster.start("trainer", "--target-return", "0",
                                     "--algo", "scripted_algos:CurriculumPPO")
    wait_for(lambda: resets(log).count({"level": 2}) >= 3, 60,
             "every env reset to level 2 by the learner's barrier")
    wait_for(lambda: "reset barrier: epoch 1: 1 workers reset" in procs["trainer"].output(), 10,
             "the learner to hear the barrier's outcome")
    assert cluster.cli("shutdown").returncode == 0
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
