"""Reproducible runs: with `stepbus broker --deterministic`, one worker and one seed, two runs
make the same trajectories, metrics and weights, whatever the timing and whichever runner;
another seed does not."""

from __future__ import annotations

import contextlib
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from conftest import EVERY_UPDATE, Cluster, Proc, serial_run, wait_for

UPDATES = 30
# what may differ between identical runs: the clock, and every rate (`*_per_second`)
TIMING = ("time", "wall_s", "steps_per_second", "trajectories_per_second",
          "intake_bytes_per_second")


@contextlib.contextmanager
def cluster_of_its_own() -> Iterator[Cluster]:
    """The `cluster` fixture's cleanup, for a test that runs several pipelines."""
    c = Cluster()
    try:
        yield c
    except BaseException:
        print(c.dump())
        raise
    finally:
        c.kill_all()
        shutil.rmtree(c.dir, ignore_errors=True)


def checkpoint_arrays(runs_dir: Path) -> dict[str, np.ndarray]:
    """The latest run's checkpoint: every array but its metadata."""
    with np.load(runs_dir / "latest" / "checkpoint.npz") as saved:
        return {k: saved[k].copy() for k in saved.files if k != "meta"}


def run_serial(seed: int, runs_dir: Path) -> dict[str, Any]:
    """`run_pipeline`'s pipeline and flags on the serial runner (every role on one thread in
    this process): the metrics records and the checkpoint's arrays."""
    s = str(seed)
    records = serial_run(runs_dir, "--seed", s, "--deterministic", "--workers", "1",
                         "--target-return", "0", "--max-updates", str(UPDATES), *EVERY_UPDATE)
    return {"records": records, "arrays": checkpoint_arrays(runs_dir)}


def run_pipeline(seed: int, meddle: Callable[[Cluster, dict[str, Proc]], None] | None = None,
                 broker_args: tuple[str, ...] = ("--deterministic",),
                 meanwhile: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Controller, broker, one worker, assembler and a learner that stops the pipeline after
    UPDATES updates; the metrics records and the checkpoint's arrays. `meddle` runs on a
    thread of its own while the pipeline runs, and `meanwhile` (serial runs, which need the
    main thread for their signal handlers) on this one: what it returns is "meanwhile"."""
    with cluster_of_its_own() as c:
        s = str(seed)
        procs = {"controller": c.start("controller"),
                 "broker": c.start("broker", "--seed", s, *broker_args),
                 "assembler": c.start("assembler"),
                 "worker": c.start("worker", "--name", "w0", "--seed", s),
                 # a record per update: the runs are compared update by update
                 "learner": c.start("learner", "--seed", s, "--target-return", "0",
                                    "--max-updates", str(UPDATES), *EVERY_UPDATE)}
        with ThreadPoolExecutor(1) as pool:
            meddling = None if meddle is None else pool.submit(meddle, c, procs)
            beside = None if meanwhile is None else meanwhile()
            if meddling is not None:
                meddling.result()  # its failure (a wait that timed out) fails the test
        codes = {name: proc.wait(60) for name, proc in procs.items()}
        assert set(codes.values()) == {0}, codes
        assert "max-updates" in procs["learner"].output()
        return {"records": c.metrics(), "arrays": checkpoint_arrays(c.runs_dir),
                "meanwhile": beside}


def pauses(c: Cluster, procs: dict[str, Proc]) -> None:
    """Other timing: freeze the learner, later the worker, for a moment each (well inside the
    1.5 s after which a worker counts as lost). Without --deterministic the broker would act
    with other policy versions meanwhile."""
    for name, after in (("learner", 3), ("worker", 10)):
        def updated(n: int = after) -> bool:
            return len(c.metrics()) >= n

        wait_for(updated, 30, f"{after} updates")
        procs[name].signal(signal.SIGSTOP)
        time.sleep(0.4)
        procs[name].signal(signal.SIGCONT)


def test_two_deterministic_runs_are_bitwise_identical_and_another_seed_is_not(tmp_path: Path):
    """One run on the serial runner (every role on one thread in this process), the other as
    real processes whose learner and worker are frozen for a moment (SIGSTOP, which only
    processes have): neither the timing nor the runner changes a bit of what is learned. The
    other seed's run is serial too. The serial runs go on while the processes run: more
    timing to disturb them, and the test takes the time of the slowest."""
    def both_serial() -> tuple[dict[str, Any], dict[str, Any]]:
        return run_serial(3, tmp_path / "serial"), run_serial(4, tmp_path / "other")

    paused = run_pipeline(3, meddle=pauses, meanwhile=both_serial)
    serial, other = paused["meanwhile"]
    runs = [serial, paused]

    first, second = ([{k: v for k, v in r.items() if k not in TIMING} for r in run["records"]]
                     for run in runs)
    assert len(first) == len(second) == UPDATES  # --max-updates stops at exactly that many
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        assert a == b, f"record {i} differs"
    assert first[-1]["env_steps"] > UPDATES * 256 and first[-1]["episodes"] > 0
    arrays = [run["arrays"] for run in runs]
    assert arrays[0].keys() == arrays[1].keys() and any(k.startswith("param/") for k in arrays[0])
    for key in arrays[0]:
        assert arrays[0][key].tobytes() == arrays[1][key].tobytes(), key

    # The comparison can fail: another seed gives other trajectories from the first update on.
    others = other["records"]
    assert len(others) == UPDATES
    assert all(o["digest"] != a["digest"] for o, a in zip(others, first, strict=True))
    assert other["arrays"]["param/pi.0.w"].tobytes() != arrays[0]["param/pi.0.w"].tobytes()
