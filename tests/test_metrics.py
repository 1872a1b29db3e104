"""What a run leaves in its directory: metrics.jsonl and TensorBoard scalars from the same
records, with policy lag, episode length and link throughput, read back as TensorBoard would;
`stepbus plot` draws them; the learner's progress lines keep a steady beat."""

from __future__ import annotations

import collections
import json
import logging
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import EVERY_UPDATE, Cluster
from PIL import Image
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from stepbus.bus import protocol as p
from stepbus.trainer import metrics

UPDATES = 20


@pytest.fixture(scope="module")
def finished_run() -> Iterator[Path]:
    """The run directory of a short real CartPole run that stopped itself after UPDATES, with
    a record per update, so the files can be checked against the updates one by one (the
    default cadence, a record a second, is test_learner_state's)."""
    cluster = Cluster()
    try:
        procs = cluster.start_all(trainer_args=("--target-return", "0", "--max-updates",
                                                str(UPDATES), *EVERY_UPDATE))
        for name, proc in procs.items():
            assert proc.wait(60) == 0, f"{name}\n{cluster.dump()}"
        yield (cluster.runs_dir / "latest").resolve()
    finally:
        cluster.kill_all()
        shutil.rmtree(cluster.dir, ignore_errors=True)


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the run's event files, by tag: TFRecord framing (length, its CRC, the
    Event protobuf, its CRC), CRCs checked, as TensorBoard reads them."""
    out: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
    files = sorted(run_dir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {run_dir}"
    for path in files:
        data, i = path.read_bytes(), 0
        while i < len(data):
            header = data[i:i + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[i + 8:i + 12])[0] == masked_crc32c(header)
            body = data[i + 12:i + 12 + length]
            assert struct.unpack("<I", data[i + 12 + length:i + 16 + length])[0] == \
                masked_crc32c(body)
            i += 16 + length
            event = event_pb2.Event.FromString(body)
            for value in event.summary.value:
                out[value.tag].append((event.step, value.simple_value))
    return out


def test_a_run_writes_metrics_jsonl_and_tensorboard_scalars_from_the_same_records(
        finished_run: Path):
    records = read_records(finished_run)
    assert len(records) == UPDATES
    last = records[-1]
    for key in ("policy_lag_p50", "policy_lag_p99", "mean_length", "trajectories_per_second",
                "intake_bytes_per_second", "entropy", "policy_loss", "steps_per_second"):
        assert key in last, key
    assert all(0 <= r["policy_lag_p50"] <= r["policy_lag_p99"] <= 8 for r in records)
    assert last["mean_length"] > 0 and last["intake_bytes_per_second"] > 0

    scalars = read_scalars(finished_run)
    for tag in ("episode/return_mean", "episode/length_mean", "loss/policy", "loss/value",
                "policy/entropy", "throughput/env_steps_per_s", "policy_lag/p50",
                "policy_lag/p99", "link/assembler_to_learner/trajectories_per_s",
                "link/assembler_to_learner/bytes_per_s"):
        assert tag in scalars, f"{tag} missing; have {sorted(scalars)}"
    # one point per update, on the env-steps axis, with the values metrics.jsonl has
    returns = scalars["episode/return_mean"]
    expected = [(r["env_steps"], r["mean_return"]) for r in records if r["mean_return"]]
    assert [s for s, _ in returns] == [s for s, _ in expected]
    assert np.allclose([v for _, v in returns], [v for _, v in expected], rtol=1e-6)
    assert [v for _, v in scalars["policy_lag/p99"]] == [r["policy_lag_p99"] for r in records]
    assert "digest" not in str(sorted(scalars)), "identities are not curves"


def trajectory(versions: list[int], episode_length: int | None = None) -> p.Trajectory:
    n = len(versions)
    zeros = np.zeros(n, np.float32)
    return p.Trajectory(
        agent="w/0", epoch=0, terminated=episode_length is not None, truncated=False,
        episode_return=None if episode_length is None else float(episode_length),
        episode_length=episode_length, obs=np.zeros((n, 4), np.float32),
        actions=np.zeros(n, np.int64), logp=zeros, values=zeros, rewards=zeros,
        policy_versions=np.asarray(versions, np.int64), bootstrap_obs=np.zeros(4, np.float32),
        assembler="a", seq=0)


def test_policy_lag_is_the_updated_versions_distance_from_each_step_as_p50_and_p99():
    clock = iter([0.0, 2.0, 3.0])
    stats = metrics.IntakeStats(episodes=2, clock=lambda: next(clock))
    stats.add(trajectory([10] * 50))
    stats.add(trajectory([9] * 49 + [5], episode_length=30))
    stats.add(trajectory([10], episode_length=50))
    figures = stats.take(updated_from=10)
    assert figures["policy_lag_p50"] == 0 and figures["policy_lag_p99"] == 1
    assert figures["mean_length"] == 40.0 and figures["trajectories_per_second"] == 1.5
    assert stats.last == {"policy_lag_p50": 0, "policy_lag_p99": 1}
    stats.add(trajectory([5] * 10))
    assert stats.take(updated_from=12)["policy_lag_p99"] == 7, "counting starts afresh"


def test_a_record_of_several_updates_has_the_lag_of_every_step_of_each():
    clock = iter([0.0, 1.0])
    stats = metrics.IntakeStats(episodes=2, clock=lambda: next(clock))
    stats.add(trajectory([10] * 98))
    stats.updated(10)  # lag 0 for 98 steps
    stats.add(trajectory([8, 8]))
    stats.updated(11)  # lag 3 for 2 steps
    assert stats.last == {"policy_lag_p50": 3, "policy_lag_p99": 3}, "status: the last update"
    figures = stats.take()
    assert (figures["policy_lag_p50"], figures["policy_lag_p99"]) == (0, 3), "over both"
    assert figures["trajectories_per_second"] == 2.0


def test_scalars_map_known_keys_to_tags_and_an_algorithms_own_stats_under_algo():
    record = {"time": 1.0, "env_steps": 5, "digest": "ab", "mean_return": None, "updates": 3,
              "interval_mean_return": 9.5, "entropy": 0.5, "my_stat": 2, "no_update": True,
              "bad": float("nan")}
    assert metrics.scalars(record) == [
        ("interval_mean_return", "episode/return_mean_interval", 9.5),
        ("entropy", "policy/entropy", 0.5), ("my_stat", "algo/my_stat", 2.0)]


def test_progress_lines_come_on_a_steady_five_second_beat_with_the_rate_over_the_interval(
        caplog: pytest.LogCaptureFixture):
    now = [0.0]
    progress = metrics.ProgressLog(logging.getLogger("test.progress"), steps=1000,
                                   clock=lambda: now[0])
    logged_at: list[float] = []
    steps = 1000
    with caplog.at_level(logging.INFO, logger="test.progress"):
        while now[0] < 21.0:  # a loop waking every 0.3 s, with one 2.9 s update at 9.0 s
            now[0] = round(now[0] + (2.9 if now[0] == 9.0 else 0.3), 6)
            steps += 300
            progress.maybe(steps, 12.5, version=7)
            if len(caplog.records) > len(logged_at):
                logged_at.append(now[0])
    # the stall delays one line; the ones after it keep the 5 s beat (15, 20), no burst
    assert logged_at == [5.1, 11.9, 15.2, 20.0]
    assert caplog.records[0].getMessage() == (
        "progress: 6100 env steps, 1000 steps/s, mean return 12.5, policy version 7")


def stepbus_plot(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stepbus", "plot", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_stepbus_plot_draws_a_png_of_the_expected_size_from_a_real_run(finished_run: Path):
    res = stepbus_plot(finished_run)
    assert res.returncode == 0, res.stderr
    png = finished_run / "progress.png"
    assert res.stdout.strip() == str(png), "says where it wrote"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1200, 800)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50, "lines and text, not a blank canvas"


def test_stepbus_plot_draws_one_line_per_policy_to_the_output_given(finished_run: Path,
                                                                    tmp_path: Path):
    run = tmp_path / "run"
    (run / "policy-red").mkdir(parents=True)
    shutil.copy(finished_run / "metrics.jsonl", run / "metrics.jsonl")
    shutil.copy(finished_run / "metrics.jsonl", run / "policy-red" / "metrics.jsonl")
    res = stepbus_plot(run, "--output", tmp_path / "out.png")
    assert res.returncode == 0, res.stderr
    with Image.open(tmp_path / "out.png") as image:
        assert image.format == "PNG" and image.size == (1200, 800)
    assert not (run / "progress.png").exists()


def test_stepbus_plot_of_a_directory_without_metrics_exits_1_saying_what_it_looked_for(
        tmp_path: Path):
    res = stepbus_plot(tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"no metrics in {tmp_path}" in res.stderr and "metrics.jsonl" in res.stderr
    (tmp_path / "metrics.jsonl").write_text('{"env_steps": 1, "ti')  # still being written
    assert stepbus_plot(tmp_path).returncode == 1
    assert stepbus_plot(tmp_path / "missing").returncode == 1
