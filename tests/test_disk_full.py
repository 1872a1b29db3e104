"""The checkpoint disk full (a small tmpfs, filled mid-run): the last good checkpoint stays
intact and loadable, the learner says so in one line and goes on learning in memory while
what waits for a checkpoint (receipts, metrics records) waits, and it writes the checkpoint
as soon as the space returns; metrics.jsonl never holds a torn line. /dev/shm full: a worker's
observations go on the socket."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_for
from test_learner_state import STEPS, Bench, saved, trajectory

from stepbus.bus import node, shm
from stepbus.bus import protocol as p
from stepbus.trainer import checkpoint, metrics
from stepbus.workers.worker import Config, Worker


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 512 KiB tmpfs of its own (mounting needs root, as CI runs)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = Path(tempfile.mkdtemp(prefix="sb-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def fill(disk: Path) -> Path:
    """Every free byte taken by one file."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_keeps_the_last_checkpoint_and_learning_waits_for_the_space(
        small_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    bench = Bench(small_disk)
    bench.deliver(*(trajectory(seq) for seq in range(4)))  # an update, checkpointed
    assert saved(small_disk)["env_steps"] == 4 * STEPS
    filler = fill(small_disk)
    with caplog.at_level(logging.WARNING):
        bench.deliver(*(trajectory(seq) for seq in range(4, 12)))  # two updates, in memory
        bench.later(checkpoint.RETRY_AFTER_FAILURE_S)  # tried again: still full
    assert bench.learner.counts.updates == 3, "learning went on"
    assert saved(small_disk)["env_steps"] == 4 * STEPS, "the last good checkpoint, loadable"
    assert sorted(p.name for p in small_disk.iterdir()
                  if p.name.endswith(".tmp")) == [], "no half-written file holds the space"
    warnings = [r.getMessage() for r in caplog.records if "cannot write checkpoint" in r.message]
    assert len(warnings) == 1, "said once while the disk stays full"
    learned = {s for r in bench.receipts() for s in r.learned.tolist()}
    assert learned == {0, 1, 2, 3}, "only what a checkpoint holds is receipted"
    assert bench.learner.unsaved.failures >= 2

    filler.unlink()
    with caplog.at_level(logging.WARNING):
        bench.later(checkpoint.RETRY_AFTER_FAILURE_S)
    assert saved(small_disk)["env_steps"] == 12 * STEPS, "written as soon as the space is back"
    assert any("written again" in r.getMessage() for r in caplog.records)
    bench.later(1.0)
    learned |= {s for r in bench.receipts() for s in r.learned.tolist()}
    assert learned == set(range(12))
    lines = (small_disk / "metrics.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(line) for line in lines[:-1]), "no torn line"
    bench.learner.metrics.close()


def test_a_line_the_full_disk_cuts_short_is_taken_back_whole(small_disk: Path) -> None:
    """The file's last page has 96 bytes free when the disk fills: a 200-byte line gets 96 of
    them written, and is taken back, so the file ends with the last whole line."""
    path = small_disk / "metrics.jsonl"
    path.write_bytes(b"x" * 3999 + b"\n")
    fill(small_disk)
    with path.open("ab", buffering=0) as f:
        assert not metrics.append_whole(f.fileno(), b"y" * 199 + b"\n")
        assert path.stat().st_size == 4000 and path.read_bytes().endswith(b"x\n")
        assert metrics.append_whole(f.fileno(), b"z\n"), "a line that fits the page goes in"
    assert path.read_bytes().endswith(b"x\nz\n")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_tensorboard_dead_of_a_full_disk_never_holds_the_learner_up(
        small_disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tensorboardX's writer thread dies on the full disk; once the space is back, records
    still go into metrics.jsonl at once (its bounded queue would have blocked the learner for
    ever) and closing returns."""
    monkeypatch.setattr(metrics, "FLUSH_S", 0.05)
    files = metrics.MetricsFiles(small_disk)
    record = {"env_steps": 1, "time": 0.0, "mean_return": 1.0, "loss": 0.5}
    assert files.write(record) and files.events_alive()
    filler = fill(small_disk)
    wait_for(lambda: (files.events.add_scalar("x", 1.0) or not files.events_alive()), 10,
             "the writer thread to die of the full disk", interval=0.05)
    filler.unlink()
    assert all(files.write({**record, "env_steps": i}) for i in range(2, 60))
    files.close()
    lines = (small_disk / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["env_steps"] for line in lines] == [1, *range(2, 60)]


def test_shared_memory_that_cannot_be_had_sends_the_rows_on_the_socket(
        small_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """/dev/shm full (here a 512 KiB tmpfs in its place): the segment is refused when it is
    made, not by SIGBUS at some later write into a page the tmpfs never had, and the worker says
    so in one line and steps with its rows on the socket."""
    monkeypatch.setattr(shm, "DIR", str(small_disk))
    with pytest.raises(OSError):  # 16 slots of 64 rows of 1 KiB: 1 MiB on a 512 KiB disk
        shm.Writer("stepbus-big-1", np.zeros((64, 256), np.float32))
    assert list(small_disk.iterdir()) == [], "nothing left of the refused segment"
    fill(small_disk)
    caplog.set_level(logging.WARNING)
    out = node.Outbox()
    w = Worker(Config(envs_per_worker=2, name="w", shm_frames=True,
                      shm_min_batch_bytes=0), out,
               logging.getLogger("test.worker"))
    try:
        assert w.segment is None
        [line] = [r.getMessage() for r in caplog.records if "--shm-frames" in r.getMessage()]
        assert "cannot create a segment" in line and "on the socket" in line, line
        w.deliver(b"", p.Reset(epoch=0, seq=1, options={}))
        w.deliver(b"", p.Step(epoch=0, seq=2, policy_version=0, actions=np.zeros(2, np.int64)))
        [_, stepped] = out.take(p.StepResult, port="steps")
        assert stepped.seq == 2 and stepped.obs_slot < 0
        assert isinstance(stepped.obs, np.ndarray) and stepped.obs.shape == (2, 4)
    finally:
        w.close()


def test_a_checkpoint_that_cannot_take_its_place_leaves_no_temp_file(tmp_path: Path) -> None:
    """The rename fails (here a directory holds the checkpoint's name): the error is the
    caller's to handle, and no temp file is left to take the space of the next try."""
    path = tmp_path / "checkpoint.npz"
    (path / "in-the-way").mkdir(parents=True)
    with pytest.raises(OSError):
        checkpoint.save(path, {"w": np.zeros(3)}, {}, {"env_steps": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz"]
