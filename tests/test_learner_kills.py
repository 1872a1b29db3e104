"""Learners killed (SIGKILL) and swapped in a row under a running pipeline: no confirmed
learning is lost, every trajectory is learned at least once, the counts in metrics.jsonl never
go back, and the broker's credit window, so policy lag, is what it was before the first."""

from __future__ import annotations

import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from conftest import EVERY_UPDATE, Cluster, Proc, recv_message, send_message, wait_for
from scripted_algos import RecordsLearned

from stepbus.bus import protocol as p
from stepbus.trainer import checkpoint

ALGO = "scripted_algos:RecordsLearned"
WARM_UP, WINDOW = 4, 16  # updates skipped (a learner starts, catches up), then compared
MAX_POLICY_LAG = 8  # the learner's default --max-policy-lag


class Watch:
    """The broker's figures, read from the controller every heartbeat by a thread of its own,
    and the learners' pids by generation."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.ahead: list[int] = []
        self.rows: dict[str, dict] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        sock = self.cluster.socket(zmq.DEALER, self.cluster.endpoints["controller"])
        try:
            while not self.stopping.wait(0.25):
                send_message(sock, p.StatusRequest())
                try:
                    reply = recv_message(sock, timeout=2.0)
                except AssertionError:
                    continue
                if isinstance(reply, p.StatusReply):
                    self.take(reply.processes)
        finally:
            sock.close()

    def take(self, rows: list[dict]) -> None:
        by_role = {row["role"]: row for row in rows}
        self.rows = by_role
        ahead = by_role.get("broker", {}).get("outstanding_steps")
        if isinstance(ahead, int):
            self.ahead.append(ahead)

    def caught_up(self) -> bool:
        """Whether the learner has taken in again what its predecessors did not confirm:
        stepping is no more than a window ahead of it."""
        broker = self.rows.get("broker", {})
        return broker.get("outstanding_steps", math.inf) <= broker.get("credit_window", 0)

    def learner(self, generation: int) -> int:
        """The pid of the learner of `generation`, once it reports."""
        row = wait_for(lambda: (r := self.rows.get("trainer", {})).get("generation") ==
                       generation and r, 60, f"learner generation {generation}")
        return int(row["pid"])

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)


@pytest.fixture
def watch(cluster: Cluster) -> Iterator[Watch]:
    w = Watch(cluster)
    yield w
    w.close()


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def updates_by(log: Path, pid: int) -> int:
    """Updates the learner `pid` made (one line each in the algorithm's log)."""
    if not log.exists():
        return 0
    return sum(line.split(" ", 1)[0] == str(pid) for line in log.read_text().splitlines())


def window(rows: list[dict], generation: int, start: int = 0) -> list[dict]:
    """WINDOW records of `generation` after WARM_UP, from the `start`th record on."""
    mine = [r for r in rows[start:] if r["generation"] == generation][WARM_UP:WARM_UP + WINDOW]
    assert len(mine) == WINDOW, f"generation {generation}: {len(mine)} records"
    return mine


def lag(rows: list[dict]) -> tuple[float, float, int]:
    """Mean policy lag p50 and p99 over the records, and the worst p99."""
    return (statistics.fmean(r["policy_lag_p50"] for r in rows),
            statistics.fmean(r["policy_lag_p99"] for r in rows),
            max(r["policy_lag_p99"] for r in rows))


def swap(cluster: Cluster, *flags: str) -> subprocess.Popen:
    """`stepbus trainer swap FLAGS`, which answers once the new learner has run 3 s and
    started."""
    return subprocess.Popen([sys.executable, "-m", "stepbus", "trainer", "swap", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=cluster.env(), cwd=cluster.dir)


def swapped(cmd: subprocess.Popen) -> None:
    out, _ = cmd.communicate(timeout=30)
    assert cmd.returncode == 0, out


def start_pipeline(cluster: Cluster, log: Path) -> dict[str, Proc]:
    """The learner sets the pace (a batch of 64 steps takes 0.05 s: 1.3k steps/s at most), so
    the credit window is what bounds the policy lag. Data of any lag is learned from, so that
    every trajectory is; what the default bound would drop is read from the lag."""
    return {"controller": cluster.start("controller"), "broker": cluster.start("broker"),
            "assembler": cluster.start("assembler"),
            "worker": cluster.start("worker", "--name", "w0", "--envs-per-worker", "4"),
            "trainer": cluster.start("trainer", "--algo", ALGO, "--target-return", "0",
                                     *EVERY_UPDATE,  # policy lag compared update by update
                                     "--batch-steps", "64", "--max-policy-lag", "1000",
                                     env={"STEPBUS_TEST_LEARNED_LOG": str(log)})}


def kill_and_swap_five_times(cluster: Cluster, watch: Watch, log: Path) -> None:
    """Generations 1 to 5 end; the sixth runs with the first one's settings."""
    rows = cluster.metrics
    # 1. Killed right after a checkpoint: its record is out, its receipts go out with it.
    written = len(rows())
    wait_for(lambda: len(rows()) > written, 10, "the next record", interval=0.005)
    kill(watch.learner(1))
    # 2. Swapped for learners that checkpoint only every 30 s (and on exit) ...
    watch.learner(2)
    swapped(swap(cluster, "--checkpoint-interval-s", "30"))
    # 3. ... the first of which is killed two updates after its swap was proven: what it
    # learned in 3 s is lost, it confirmed none of it, and all of it comes again.
    third = watch.learner(3)
    proven = updates_by(log, third)
    wait_for(lambda: updates_by(log, third) >= proven + 2, 30, "two more updates",
             interval=0.01)
    kill(third)
    # 4. Killed as soon as it reports (so before its first checkpoint of learning).
    kill(watch.learner(4))
    # 5. Swapped back to checkpoints every 0.1 s: the hand-over checkpoints on exit.
    watch.learner(5)
    last_swap = swap(cluster, "--checkpoint-interval-s", "0.1")
    watch.learner(6)
    swapped(last_swap)


def assert_every_trajectory_learned(cluster: Cluster, assembler_log: str,
                                    records: list[dict]) -> None:
    """The last checkpoint's record of what the algorithm learned (lost with a kill, as
    learning is) misses only what the assembler still held as not learned from when it
    stopped."""
    stopping = re.search(r"assembler stopping .*?: (\d+) trajectories, .*?(\d+) never taken in "
                         r"by a learner, (\d+) taken in but not learned from", assembler_log)
    assert stopping is not None, assembler_log[-2000:]
    made, never, unlearned = map(int, stopping.groups())
    _, state, progress = checkpoint.load(cluster.runs_dir / "latest" / "checkpoint.npz")
    missing = set(range(made)) - set(state[RecordsLearned.KEY].tolist())
    assert len(missing) <= never + unlearned, (sorted(missing), never, unlearned)
    assert all(r["stale_dropped"] == 0 for r in records), "none was dropped unlearned"
    assert progress["env_steps"] >= records[-1]["env_steps"]


@pytest.mark.solo  # compares policy lag before and after: another test beside it moves it
def test_learners_killed_and_swapped_in_a_row_lose_no_confirmed_learning_nor_credit(
        cluster: Cluster, watch: Watch) -> None:
    log = cluster.dir / "learned.log"
    procs = start_pipeline(cluster, log)
    wait_for(lambda: len(cluster.metrics()) >= WARM_UP + WINDOW, 60,
             "the first learner's updates")
    kill_and_swap_five_times(cluster, watch, log)
    wait_for(watch.caught_up, 60, "the last learner to take in what came again")
    caught_up = len(cluster.metrics())
    wait_for(lambda: len(cluster.metrics()) >= caught_up + WARM_UP + WINDOW, 60,
             "the last learner's updates")
    broker = watch.rows["broker"]
    assert cluster.cli("shutdown").returncode == 0
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    records = cluster.metrics()

    # Nothing confirmed was lost: the counts in metrics.jsonl only ever rise.
    for key in ("env_steps", "episodes", "policy_version"):
        values = [r[key] for r in records]
        assert values == sorted(values), f"{key} went back: {values}"
    assert len({r["policy_version"] for r in records}) == len(records)
    generations = {r["generation"] for r in records}
    assert {1, 6} <= generations and 3 not in generations, "the third confirmed nothing"
    assert_every_trajectory_learned(cluster, procs["assembler"].output(), records)

    # Credit: never negative, never rebased, and lag after five swaps and kills as before.
    assert watch.ahead and min(watch.ahead) >= 0, watch.ahead
    assert broker["credit_rebases"] == 0, broker
    before = lag(window(records, 1))
    after = lag(window(records, 6, caught_up))
    print(f"\npolicy lag p50/p99 (means over {WINDOW} updates), worst p99: before {before}, "
          f"after five swaps and kills {after}; broker ahead "
          f"{min(watch.ahead)}..{max(watch.ahead)}")
    # Lag here moves with how far stepping outruns the learner on a shared 2-core machine:
    # the mean p50 of one window measured 1.4-2.9 from run to run. Counting resent steps
    # twice took it to 16 (p99 18, 19 at worst: dropped at the default bound).
    assert after[0] <= before[0] + 1.0 and after[1] <= before[1] + 1.0, (before, after)
    assert after[2] <= max(before[2], MAX_POLICY_LAG), "none the default bound would drop"
