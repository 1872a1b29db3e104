"""The trainer slot: a learner killed or swapped under a running pipeline, nothing lost. A
learner killed and swapped under honcho is test_supervision's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from conftest import EVERY_UPDATE, Cluster, never_taken_in, wait_for
from controller_probe import shutdown, status_rows


def row(cluster: Cluster, role: str) -> dict:
    rows = [r for r in status_rows(cluster) if r["role"] == role]
    return rows[0] if rows else {}


def learner_row(cluster: Cluster, generation: int) -> dict:
    """The learner's status row once the learner of `generation` reports (figures travel with
    heartbeats, so this waits)."""
    return wait_for(lambda: (r := row(cluster, "trainer")).get("generation") == generation and r,
                    60, f"learner generation {generation} in stepbus status")


def test_a_killed_learner_is_restarted_by_its_slot_and_nothing_sent_to_it_is_lost(
        cluster: Cluster):
    procs = cluster.start_all(trainer_args=("--target-return", "0", *EVERY_UPDATE,
                                            "--checkpoint-interval-s", "0.2"), workers=2)
    wait_for(lambda: len(cluster.metrics()) >= 5, 60, "five updates")
    first = learner_row(cluster, 1)
    killed_at = max(r["policy_version"] for r in cluster.metrics())
    os.kill(first["pid"], signal.SIGKILL)
    second = learner_row(cluster, 2)
    assert second["pid"] != first["pid"]
    wait_for(lambda: any(r["generation"] == 2 and r["policy_version"] > killed_at
                         for r in cluster.metrics()), 60, "generation 2 learning past the kill")
    slot = wait_for(lambda: (r := row(cluster, "slot")).get("deaths") == 1 and r, 10,
                    "the slot to count the death")
    assert slot["last_death"] == "killed by SIGKILL"
    assembler = wait_for(lambda: (r := row(cluster, "assembler")).get("trainer_swaps") and r,
                         10, "the assembler to see the new learner")
    print(f"swap gap {assembler['last_swap_gap_s']}s, {assembler['resent']} resent")
    assert procs["trainer"].popen.poll() is None, "the slot itself survives"
    assert shutdown(cluster)
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    assert never_taken_in(procs["assembler"].output()) == 0, procs["assembler"].output()[-2000:]
    assert "Traceback" not in cluster.dump()


def plateau(read: Callable[[], int], quiet_s: float, timeout: float, what: str) -> int:
    """The value `read` settles on: unchanged for `quiet_s` (status figures move with 0.5 s
    heartbeats, so quiet_s spans several)."""
    deadline = time.monotonic() + timeout
    last, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        value, now = read(), time.monotonic()
        if value != last:
            last, since = value, now
        elif now - since >= quiet_s:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_swap_to_new_flags_and_algorithm_keeps_versions_rising_and_reverts_a_bad_one(
        cluster: Cluster):
    procs = cluster.start_all(trainer_args=("--target-return", "0", *EVERY_UPDATE))
    wait_for(lambda: len(cluster.metrics()) >= 3, 60, "three updates")
    before = max(r["policy_version"] for r in cluster.metrics())

    swap = cluster.cli("trainer", "swap", "--lr", "0.0005", "--algo", "scripted_algos:NoUpdatePPO")
    assert swap.returncode == 0, swap.stdout + swap.stderr
    assert "--algo scripted_algos:NoUpdatePPO" in swap.stdout
    second = learner_row(cluster, 2)
    assert second["algo"] == "scripted_algos:NoUpdatePPO"
    wait_for(lambda: any(r.get("no_update") for r in cluster.metrics()), 30,
             "an update by the swapped-in algorithm")
    swapped = [r for r in cluster.metrics() if r.get("no_update")]
    assert swapped[0]["generation"] == 2 and swapped[0]["policy_version"] > before
    assembler = wait_for(lambda: (r := row(cluster, "assembler")).get("trainer_swaps") and r,
                         10, "the assembler to report the swap")
    assert assembler["last_swap_gap_s"] is not None

    bad = cluster.cli("trainer", "swap", "--algo", "scripted_algos:RefusesToStart")
    assert bad.returncode == 1
    assert "back to the previous settings" in bad.stdout
    third = learner_row(cluster, 3)
    assert third["algo"] == "scripted_algos:NoUpdatePPO", "the previous settings are back"
    slot = row(cluster, "slot")
    assert (slot["swaps"], slot["swaps_reverted"]) == (1, 1)
    assert "this algorithm refuses to start" in procs["trainer"].output()

    typo = cluster.cli("trainer", "swap", "--no-such-flag", "1")
    assert typo.returncode != 0 and "--no-such-flag" in typo.stderr
    assert row(cluster, "trainer")["pid"] == third["pid"], "a refused swap stops nothing"

    assert shutdown(cluster)
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    assert max(r["policy_version"] for r in cluster.metrics()) > swapped[0]["policy_version"]


def test_without_a_learner_stepping_pauses_and_the_next_learner_gets_everything(
        cluster: Cluster):
    args = ("--target-return", "0", "--checkpoint-interval-s", "0.2", *EVERY_UPDATE)
    procs = cluster.start_all(trainer_args=args, trainer="learner")
    wait_for(lambda: len(cluster.metrics()) >= 3 and list(cluster.runs_dir.glob(
        "*/checkpoint.npz")), 60, "three updates and a checkpoint")
    procs["trainer"].signal(signal.SIGKILL)
    procs["trainer"].wait(5)

    def assembler_steps() -> int:
        return row(cluster, "assembler").get("steps", -1)

    # Stepping stops once the credit window is spent; the assembler keeps what it made.
    paused_at = plateau(assembler_steps, 2.0, 30, "stepping to pause")
    kept = row(cluster, "assembler")
    assert kept["held"] + kept["unlearned"] > 0, "trajectories wait for the next learner"
    assert kept["held"] + kept["untaken"] <= 10_000

    procs["trainer"] = cluster.start("learner", *args)
    wait_for(lambda: assembler_steps() > paused_at, 60, "stepping to resume with a new learner")
    wait_for(lambda: any(r["generation"] == 2 for r in cluster.metrics()), 60,
             "the new learner's first update")
    assert shutdown(cluster)
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    assert never_taken_in(procs["assembler"].output()) == 0, procs["assembler"].output()[-2000:]


def test_a_stopped_learner_is_continued_by_its_slot_and_learns_on(cluster: Cluster):
    """SIGSTOP: its slot continues it (SIGCONT) at the liveness bound; the same learner, its
    batch and checkpoint as they were, updates again. (A learner frozen otherwise is killed:
    test_slot_state.)"""
    procs = cluster.start_all(trainer_args=("--target-return", "0", *EVERY_UPDATE))
    wait_for(lambda: len(cluster.metrics()) >= 3, 60, "three updates")
    stopped = learner_row(cluster, 1)["pid"]
    os.kill(stopped, signal.SIGSTOP)
    slot = wait_for(lambda: (r := row(cluster, "slot")).get("resumed") == 1 and r, 30,
                    "the slot to continue the stopped learner")
    assert (slot["frozen"], slot["deaths"]) == (0, 0), slot
    updates = len(cluster.metrics())
    wait_for(lambda: len(cluster.metrics()) > updates + 1, 60, "the same learner updating")
    assert learner_row(cluster, 1)["pid"] == stopped
    assert all(r["generation"] == 1 for r in cluster.metrics())
    assert "sent no heartbeat" in procs["trainer"].output()
    assert shutdown(cluster)
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()


def test_a_swap_whose_slot_is_killed_fails_once_the_slot_falls_silent(cluster: Cluster):
    """SIGKILL leaves no goodbye: the controller answers the swap when the slot's heartbeats
    stop, not at its own 30 s deadline (the command's --timeout is longer still)."""
    controller = cluster.start("controller")
    cluster.start("trainer")
    slot = wait_for(lambda: row(cluster, "slot").get("pid") and row(cluster, "slot"), 30,
                    "the trainer slot in stepbus status")
    swap = subprocess.Popen(
        [sys.executable, "-m", "stepbus", "trainer", "swap", "--timeout", "60", "--lr", "0.001"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cluster.env(),
        cwd=cluster.dir)
    try:
        wait_for(lambda: "trainer swap in slot" in controller.output(), 30,
                 "the controller to hand the swap to the slot")
        os.kill(slot["pid"], signal.SIGKILL)  # within the swap's 3 s probation at the least
        out, _ = swap.communicate(timeout=60)
    finally:
        swap.kill()
    assert swap.returncode == 1, out
    assert f"trainer slot {slot['name']} went silent for" in out, out
    assert "before answering the swap" in out, out


def test_a_learner_on_a_run_directory_of_its_own_gets_a_credit_scale_of_its_own(
        cluster: Cluster):
    """After a learner that checkpointed, one started on a fresh run directory counts from 0,
    as no successor would: the broker starts a new scale for it. Taken for a successor, its 0
    would leave everything the first had learned outstanding, and stepping would wait for
    top-ups (16 s here after 50,000 steps)."""
    procs = cluster.start_all(trainer="learner", trainer_args=(
        "--target-return", "0", *EVERY_UPDATE, "--checkpoint-interval-s", "0.2"))
    seen = wait_for(lambda: (n := len(cluster.metrics())) >= 5 and n, 60,
                    "five updates, so checkpoints behind them")
    # The broker hears of a checkpoint with the next update's weights, and one checkpoint may
    # write all five records: a record made after it means those weights went out.
    wait_for(lambda: len(cluster.metrics()) > seen, 30, "a record of a later checkpoint")
    procs["trainer"].popen.kill()
    procs["trainer"].popen.wait(10)
    fresh = cluster.start("learner", "--target-return", "0", "--run-dir", str(cluster.dir / "own"))
    afresh = "its count of 0 steps received starts where stepping is now"
    wait_for(lambda: procs["broker"].output().count(afresh) == 2, 30,
             "the broker to give the fresh learner a scale of its own")
    assert "continues the last trainer's" not in procs["broker"].output()
    steps = row(cluster, "worker")["env_steps"]
    wait_for(lambda: row(cluster, "worker").get("env_steps", 0) > steps + 5000, 30,
             "stepping to go on for the fresh learner")
    fresh.popen.kill()


def test_a_learner_killed_with_the_assembler_at_its_bound_does_not_stall_the_run(
        cluster: Cluster):
    """The assembler pauses at --max-buffered; what the dead learner never learned from is
    sent again to the next one as soon as the dead one disconnects."""
    procs = {"controller": cluster.start("controller"), "broker": cluster.start("broker"),
             "assembler": cluster.start("assembler", "--max-buffered", "10"),
             "worker": cluster.start("worker", "--name", "w0"),
             "trainer": cluster.start("learner", "--target-return", "0", *EVERY_UPDATE,
                                      "--checkpoint-interval-s", "0.2")}
    wait_for(lambda: len(cluster.metrics()) >= 3, 60, "three updates")
    procs["trainer"].signal(signal.SIGKILL)
    procs["trainer"].wait(5)
    procs["trainer"] = cluster.start("learner", "--target-return", "0")
    wait_for(lambda: any(r["generation"] == 2 for r in cluster.metrics()), 60,
             "the next learner's first update")
    wait_for(lambda: row(cluster, "assembler").get("resent", 0) > 0, 10,
             "what the dead learner held to be sent again")
    assert shutdown(cluster)
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    assert never_taken_in(procs["assembler"].output()) == 0


def test_a_swap_loses_nothing_of_a_batch_the_old_learner_had_not_learned_from(
        cluster: Cluster):
    # A batch too large to ever fill: everything the first learner takes in stays unlearned.
    procs = cluster.start_all(trainer_args=("--target-return", "0", "--batch-steps", "1000000"))
    taken = wait_for(lambda: (n := row(cluster, "trainer").get("trajectories", 0)) >= 50 and n,
                     60, "the first learner to take trajectories in")
    swap = cluster.cli("trainer", "swap", "--batch-steps", "256")
    assert swap.returncode == 0, swap.stdout + swap.stderr
    wait_for(lambda: any(r["generation"] == 2 for r in cluster.metrics()), 60,
             "the second learner's first update")
    assembler = row(cluster, "assembler")
    assert assembler["resent"] >= taken, "every unlearned trajectory was sent again"
    assert shutdown(cluster)
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
