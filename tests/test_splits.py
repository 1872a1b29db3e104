"""Double-buffered workers (`stepbus worker --splits N`): each split is a worker of its own to
the broker, yet env seeds, agent ids, per-agent trajectories and deterministic digests are
those of the whole worker."""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from conftest import EVERY_UPDATE, Cluster, serial_run, wait_for
from controller_probe import status_rows

from stepbus.bus import node
from stepbus.bus import protocol as p
from stepbus.processor.buffers import agent_ids
from stepbus.workers import worker
from stepbus.workers.worker import Config, Splits, Worker

LOG = logging.getLogger("test.splits")


def reset_seeds(cfg: Config) -> list[int]:
    """Each env's first episode seed, over every split, in env order."""
    seeds: list[int] = []
    for envs in worker.make_split_envs(cfg, LOG):
        try:
            envs.reset({})
            seeds += [int(s) for s in envs.episode_seed]
        finally:
            envs.close()
    return seeds


def test_split_envs_get_the_seeds_the_whole_worker_gives_them():
    whole = reset_seeds(Config(seed=3, worker_index=1, envs_per_worker=7, name="w"))
    split = reset_seeds(Config(seed=3, worker_index=1, envs_per_worker=7, name="w", splits=3))
    assert len(set(whole)) == 7 and split == whole
    assert worker.split_sizes(7, 3) == [3, 2, 2]


def test_more_splits_than_envs_is_refused_in_one_line_with_exit_2():
    res = subprocess.run([sys.executable, "-m", "stepbus", "worker", "--envs-per-worker", "2",
                          "--splits", "3", "--controller", "ipc:///nonexistent/c"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    lines = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "--splits must be 1 to" in lines[0], lines


@contextlib.contextmanager
def split_workers(splits: int, envs: int
                  ) -> Iterator[tuple[list[Worker], list[node.Outbox]]]:
    """Worker "w"'s splits in-process, each on an outbox of its own; closed afterwards."""
    cfg = Config(envs_per_worker=envs, name="w", splits=splits)
    workers, outs = [], []
    for i, envset in enumerate(worker.make_split_envs(cfg, LOG)):
        out = node.Outbox()
        split = Config(envs_per_worker=len(envset.envs), name=worker.split_name("w", i))
        workers.append(Worker(split, out, LOG, envs=envset, split_of="w"))
        outs.append(out)
    try:
        yield workers, outs
    finally:
        for w in workers:
            w.close()


def test_each_split_says_hello_as_its_own_worker_naming_the_whole_one_and_its_first_env():
    with split_workers(2, 5) as (workers, _):
        hellos = [w.hello for w in workers]
        assert [(h.worker, h.split_of, h.first_env, h.num_envs) for h in hellos] == [
            ("w:0", "w", 0, 3), ("w:1", "w", 3, 2)]
        assert len({h.incarnation for h in hellos}) == 2  # each its own stream to the broker
        # The assembler names their agents as the whole worker's.
        ids = [a for h in hellos for a in agent_ids(h.split_of, [], h.num_envs, h.first_env)]
        assert ids == agent_ids("w", [], 5)


def test_a_split_steps_while_the_other_waits_and_each_keeps_its_own_seq():
    with split_workers(2, 4) as (workers, outs):
        for w, out in zip(workers, outs, strict=True):
            w.deliver(b"", p.Reset(epoch=1, seq=10, options={}))
            (first,) = out.take(p.StepResult, port="steps")
            assert first.first and isinstance(first.obs, np.ndarray) and first.obs.shape == (2, 4)
        # Split 0 steps three times while split 1 has not been answered: nothing waits on it.
        for seq in (11, 12, 13):
            workers[0].deliver(b"", p.Step(epoch=1, seq=seq, policy_version=0,
                                           actions=np.zeros(2, np.int64)))
        assert [r.seq for r in outs[0].take(p.StepResult, port="steps")] == [11, 12, 13]
        assert outs[1].take(p.StepResult, port="steps") == []
        workers[1].deliver(b"", p.Step(epoch=1, seq=11, policy_version=0,
                                       actions=np.zeros(2, np.int64)))
        assert [r.seq for r in outs[1].take(p.StepResult, port="steps")] == [11]


def test_while_one_splits_env_code_runs_every_split_heartbeats():
    """The heartbeat thread beats for every split while one split's env code runs (the gate
    open), and never while the loop holds the gate."""
    with split_workers(2, 2) as (workers, outs):
        splits = Splits(workers)
        beats = worker.BusyBeats(splits.beat_all, threading.Lock())
        for w, out in zip(workers, outs, strict=True):
            w.envs.gate = beats.gate
            w.busy_beat_at = -1e9  # a beat is due
            out.take()
        beats.gate.acquire()  # as the loop holds it
        workers[0].envs.in_env = True  # split 0's env code runs: the gate opens
        beats.thread.start()
        try:
            wait_for(lambda: all(w.busy_beat_at > 0 for w in workers), 5,
                     "the heartbeat thread beating for both splits")
            workers[0].envs.in_env = False  # the loop takes the gate back
            assert all(len(out.take(p.Heartbeat, port="steps")) == 1 for out in outs)
            for w in workers:
                w.busy_beat_at = -1e9
            beats.stopping.wait(3 * worker.BUSY_BEAT_S)  # the loop holds the gate: none sent
            assert all(out.take(p.Heartbeat, port="steps") == [] for out in outs)
        finally:
            beats.stop()


def test_deterministic_runs_with_and_without_splits_learn_the_same_trajectories(tmp_path: Path):
    """Same digests (every trajectory, agent ids included, in order), same metrics: with
    --deterministic the broker batches the splits by name, which is env order."""
    flags = ("--seed", "5", "--deterministic", "--workers", "1", "--envs-per-worker", "6",
             "--target-return", "0", "--max-updates", "5", *EVERY_UPDATE)
    whole = serial_run(tmp_path / "whole", *flags)
    split = serial_run(tmp_path / "split", *flags, "--splits", "3")
    timing = ("time", "wall_s", "steps_per_second", "trajectories_per_second",
              "intake_bytes_per_second")
    assert len(whole) == len(split) == 5
    for a, b in zip(whole, split, strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == {
            k: v for k, v in b.items() if k not in timing}
    other = serial_run(tmp_path / "other", *flags[:1], "6", *flags[2:], "--splits", "3")
    assert other[-1]["digest"] != split[-1]["digest"]  # the comparison can fail


def test_a_killed_split_worker_is_lost_and_its_restart_served(cluster: Cluster):
    args = ("--envs-per-worker", "4", "--splits", "2")
    procs = cluster.start_all(worker_args=args, trainer_args=("--target-return", "0"))

    def broker() -> dict:
        return next((r for r in status_rows(cluster) if r["role"] == "broker"), {})

    def learned() -> int:
        rows = cluster.metrics()
        return rows[-1]["env_steps"] if rows else 0

    wait_for(lambda: broker().get("workers") == 2 and learned() > 0, 60, "both splits served")
    procs["worker0"].signal(signal.SIGKILL)
    procs["worker0"].wait(5)
    wait_for(lambda: broker().get("workers_lost", 0) >= 2, 20, "both splits noticed lost")
    before = learned()
    cluster.start("worker", "--name", "w0", "--worker-index", "0", *args)
    wait_for(lambda: broker().get("workers") == 2, 30, "the restarted splits served")
    wait_for(lambda: learned() > before, 30, "learning going on from the restarted worker")
