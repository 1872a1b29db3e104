"""`stepbus trainer --resume RUN`: a run whose every process was killed goes on from its last
checkpoint in its own directory, under its own id, with its own settings, until its goal; a
run that reached its goal says so and exits 0; something that is not a run is one line, exit 2.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
from pathlib import Path

from conftest import Cluster, wait_for

from stepbus.trainer import checkpoint, learner, resume
from stepbus.trainer.progress import progress_of

TARGET = "200"  # reached a few thousand steps after the kill; CartPole's own 475 takes longer
KILL_AT_STEPS = 2500  # well before TARGET can be met (20 episodes of 200 steps is 4,000)


def kill_everything(cluster: Cluster) -> None:
    """SIGKILL to every process group at once (the trainer slot's learner is in its group):
    nobody checkpoints, flushes or says goodbye."""
    for proc in cluster.procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    for proc in cluster.procs:
        proc.wait(timeout=10)
    wait_for(lambda: cluster.strays() == [], 10, "no process left after the kill")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line]


def test_a_killed_run_resumes_where_its_checkpoint_left_off_and_reaches_its_goal(
        cluster: Cluster) -> None:
    cluster.start_all(trainer_args=("--target-return", TARGET, "--metrics-interval-s", "0"))
    wait_for(lambda: (cluster.metrics() or [{}])[-1].get("env_steps", 0) >= KILL_AT_STEPS, 60,
             f"{KILL_AT_STEPS} env steps learned from")
    kill_everything(cluster)
    run_dir = (cluster.runs_dir / "latest").resolve()
    before = records(run_dir)
    saved = progress_of(checkpoint.progress_only(run_dir / checkpoint.NPZ_FILE), run_dir)
    assert not saved.solved and saved.rng["bit_generator"] == "PCG64"
    assert before[-1]["env_steps"] <= saved.env_steps  # records wait for their checkpoint

    # everything again, the trainer told only to resume: the target comes from config.toml
    procs = cluster.start_all(trainer_args=("--resume", "latest"))
    for name, proc in procs.items():
        assert proc.wait(timeout=90) == 0, f"{name} exited {proc.poll()}"
    trainer_log, controller_log = procs["trainer"].output(), procs["controller"].output()
    assert (f"resumed from {run_dir / checkpoint.NPZ_FILE} (version {saved.version}, "
            f"generation {saved.generation}, {saved.env_steps} env steps, {saved.episodes} "
            "episodes)") in trainer_log
    assert "solved: mean return" in trainer_log
    assert f"carrying on run {run_dir.name}" in controller_log
    assert [d.name for d in cluster.runs_dir.iterdir() if d.is_dir() and not d.is_symlink()] \
        == [run_dir.name], "no new run directory"

    after = records(run_dir)[len(before):]
    assert after and after[-1]["mean_return"] >= float(TARGET)
    whole = before + after
    steps = [r["env_steps"] for r in whole]
    versions = [r["policy_version"] for r in whole]
    assert steps == sorted(set(steps)) and versions == sorted(set(versions)), "no restart at 0"
    assert max(b - a for a, b in itertools.pairwise(steps)) < 4 * 256, "no gap"  # a batch each
    assert after[0]["generation"] == saved.generation + 1
    assert after[0]["policy_version"] > saved.version and after[0]["env_steps"] > saved.env_steps
    assert after[0]["episodes"] >= saved.episodes
    assert len(list(run_dir.glob("events.out.tfevents.*"))) >= 2  # TensorBoard: one logdir

    # solved: one line, exit 0, nothing started; a higher target would go on
    done = cluster.cli("trainer", "--resume", "latest", timeout=30)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 0 and len(lines) == 1, done
    assert f"run {run_dir.name} reached its goal already" in lines[0]
    higher = learner.Config(resume=str(run_dir), target_return=float(TARGET) + 100)
    assert resume.finished(higher) == ""
    assert resume.finished(learner.Config(resume=str(run_dir))) != ""


def test_resume_of_something_that_is_not_a_run_is_one_line_and_exit_2(
        cluster: Cluster) -> None:
    empty = cluster.dir / "empty"
    empty.mkdir()
    for flags, said in ((("--resume", str(cluster.dir / "nowhere")), "is not a run directory"),
                        (("--resume", str(empty)), "holds no checkpoint"),
                        (("--resume", "latest"), "is not a run directory (no run yet)")):
        done: subprocess.CompletedProcess = cluster.cli("trainer", *flags)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done
