"""Every role under the shipped Procfile survives its own kill -9: its supervisor restarts it
and the run goes on, then finishes by itself. The supervisor's state machine is
test_supervisor_state's."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from conftest import Cluster, honcho, never_taken_in, wait_for
from controller_probe import status_rows

from stepbus.bus import node, supervisor

# Long enough a run that five kills fit in it, short enough to end soon after.
RUN = "0 --max-updates 150"


def role_rows(cluster: Cluster, role: str) -> list[dict]:
    return [r for r in status_rows(cluster) if r["role"] == role]


def worker_steps(cluster: Cluster) -> dict[int, int]:
    """Each live worker's env steps so far, by pid."""
    return {r["pid"]: r.get("env_steps", 0) for r in role_rows(cluster, "worker")}


def steps_flowing(cluster: Cluster, before: dict[int, int], only_new: bool) -> bool:
    """Some worker has stepped since `before` was read (a new worker: any step at all);
    `only_new`: a worker that was not there then."""
    return any(steps > before.get(pid, 0) for pid, steps in worker_steps(cluster).items()
               if not (only_new and pid in before))


def newest_version(cluster: Cluster) -> int:
    return max((r.get("policy_version", -1) for r in role_rows(cluster, "trainer")), default=-1)


def kill_and_recover(cluster: Cluster, role: str) -> float:
    """kill -9 the process of `role` (not its supervisor); wait for a new one, steps flowing
    and the policy version rising. Returns seconds from the kill to steps flowing again."""
    (victim,) = wait_for(lambda: role_rows(cluster, role)[:1], 30, f"a live {role}")
    version = wait_for(lambda: (v := newest_version(cluster)) >= 0 and v, 30, "a version")
    before = worker_steps(cluster)
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: any(r["pid"] != victim["pid"] for r in role_rows(cluster, role)), 30,
             f"a new {role} after kill -9 of pid {victim['pid']}")
    wait_for(lambda: steps_flowing(cluster, before, only_new=role == "worker"), 30,
             f"steps flowing after the {role} died")
    flowing = time.monotonic() - killed
    wait_for(lambda: newest_version(cluster) > version, 30,
             f"the policy version rising past {version} after the {role} died")
    return flowing


def test_under_honcho_kill_9_of_each_role_in_turn_and_the_run_goes_on_and_ends_by_itself(
        cluster: Cluster):
    proc = honcho(cluster, "-c", "worker=2", target=RUN)
    try:
        wait_for(lambda: len(role_rows(cluster, "worker")) == 2 and newest_version(cluster) > 0,
                 60, "two workers stepping and a first update")
        recovered = {}
        for role in ("worker", "broker", "assembler", "controller", "trainer"):
            recovered[role] = kill_and_recover(cluster, role)
            assert proc.poll() is None, f"honcho went on after the {role} was killed"
        print("kill -9 to steps flowing again:",
              ", ".join(f"{role} {s:.1f}s" for role, s in recovered.items()))
        swap = cluster.cli("trainer", "swap", "--lr", "0.0005")  # a live swap, under honcho too
        assert swap.returncode == 0, swap.stdout + swap.stderr
        # From the log, not the status: the run may reach --max-updates during the swap.
        wait_for(lambda: "generation 3," in (cluster.dir / "honcho.out").read_text(), 30,
                 "the swapped-in learner (generation 3) starting")
        assert proc.wait(60) == 0, "the run finished by itself"
    except (AssertionError, subprocess.TimeoutExpired):
        print((cluster.dir / "honcho.out").read_text()[-8000:])
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (cluster.dir / "honcho.out").read_text()
    assert "Traceback" not in out
    assert never_taken_in(out) == 0, out[-3000:]
    runs = [d.name for d in cluster.runs_dir.iterdir() if d.name != "latest"]
    assert len(runs) == 1, f"one run carried on across the controller's restart: {runs}"
    for role in ("controller", "broker", "worker", "assembler"):
        assert f"{role} (pid" in out and "killed by SIGKILL after" in out, role
    wait_for(lambda: cluster.strays() == [], 10, "no process left behind")


def test_a_worker_that_keeps_crashing_is_given_up_on_and_status_shows_its_last_error(
        cluster: Cluster):
    cluster.start("controller")
    sup = cluster.start("supervise", "--quick-deaths", "2", "worker", "--name", "bad",
                        "--env", "scripted_envs:segfaulting_cartpole")
    (row,) = wait_for(lambda: [r for r in status_rows(cluster) if r["role"] == "supervisor"
                               and r.get("state") == "gave up"], 30, "the supervisor giving up")
    assert (row["child"], row["deaths"], row["last_death"], row["last_error"], row["starts"]) == (
        "worker", 2, "killed by SIGSEGV", "simulated native crash in the env", 2)
    shown = cluster.cli("status").stdout
    assert (f"supervisor {row['name']}: worker gave up, 2 deaths (2 quick in a row), last "
            "killed by SIGSEGV: simulated native crash in the env") in shown, shown
    assert sup.popen.poll() is None, "a worker's supervisor stays, so the run goes on"
    assert "worker died 2 times in a row" in sup.output()
    # The first child is a fork of the supervisor, the restart a new interpreter: both die,
    # and tell their error, alike.
    starts = [line for line in sup.output().splitlines() if "worker started (pid" in line]
    assert len(starts) == 2 and ", forked)" in starts[0] and "forked" not in starts[1], starts


def supervisor_row(cluster: Cluster) -> dict | None:
    return next((r for r in status_rows(cluster) if r["role"] == "supervisor"), None)


def test_a_stopped_child_is_resumed_and_a_long_env_call_is_not_a_freeze(
        cluster: Cluster, tmp_path) -> None:
    """A supervised worker whose env resets for 4 s (longer than the supervisor's 3 s of
    silence) is not taken for frozen: its heartbeat thread beats through the env call. Stopped
    (SIGSTOP), it is not running at all: after half the silence allowance it is continued
    (SIGCONT), the same process, and steps again; nothing is restarted."""
    mark = tmp_path / "resets"
    cluster.start("controller")
    cluster.start("broker")
    sup = cluster.start("supervise", "worker", "--name", "w", "--env",
                        "scripted_envs:slow_reset_cartpole", env={"STEPBUS_TEST_MARK": str(mark)})
    wait_for(lambda: mark.exists() and mark.read_text().count("reset") >= 1, 30,
             "the worker's first (4 s) reset")
    (worker,) = wait_for(lambda: role_rows(cluster, "worker"), 10, "the worker's status row")
    row = supervisor_row(cluster)
    assert row is not None and (row["starts"], row["frozen"]) == (1, 0), (row, sup.output())

    os.kill(worker["pid"], signal.SIGSTOP)
    stopped_at = time.monotonic()
    wait_for(lambda: "and is stopped; resuming it" in sup.output(), 10, "the worker continued")
    resumed_at = time.monotonic()
    resumed_after = resumed_at - stopped_at
    assert supervisor.process_state(worker["pid"])[0] != "T"
    wait_for(lambda: [r for r in role_rows(cluster, "worker") if r["pid"] == worker["pid"]
                      and r["last_heartbeat_s"] < time.monotonic() - resumed_at], 30,
             "a heartbeat of the same worker since")
    # the supervisor's figures travel with its heartbeats: wait for one sent since
    row = wait_for(lambda: (r := supervisor_row(cluster)) is not None and r["resumed"] and r,
                   10, "the supervisor's figures since")
    assert (row["starts"], row["frozen"], row["resumed"]) == (1, 0, 1), row
    print(f"\nstopped worker resumed {resumed_after:.1f} s after SIGSTOP")
    # Silence counts from its last beat, up to one heartbeat interval before the SIGSTOP.
    half = supervisor.stuck_after(supervisor.SILENT_S)
    assert half - node.HEARTBEAT_INTERVAL_S <= resumed_after < half + 3.0, resumed_after
