"""`stepbus eval RUN`: the run's policy played on the run's env, its summary as JSON, the same
episodes whether one process plays them or several, an MP4 per episode with --record-video,
each agent's return of a PettingZoo env, and paths that are no run refused in one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import serial_run

from stepbus import evaluate

QUICK = ("--target-return", "0", "--max-updates", "2", "--checkpoint-interval-s", "0")


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CartPole run two updates long: a policy that plays short episodes, quickly."""
    runs = tmp_path_factory.mktemp("runs")
    serial_run(runs, *QUICK)
    return runs / "latest"


def stepbus_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stepbus", "eval", *args], capture_output=True,
                          text=True, timeout=120)


def test_eval_json_on_a_run_directory_gives_its_figures_and_exit_0(cartpole_run: Path) -> None:
    done = stepbus_eval(str(cartpole_run), "--episodes", "3", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["env"] == "CartPole-v1" and result["deterministic"] is True
    assert [e["seed"] for e in result["episodes"]] == [0, 1, 2]
    returns = [e["return"] for e in result["episodes"]]
    assert result["mean_return"] == pytest.approx(sum(returns) / 3)
    assert result["std_return"] >= 0 and result["mean_length"] == pytest.approx(
        sum(e["length"] for e in result["episodes"]) / 3)
    assert all(e["return"] == e["length"] for e in result["episodes"])  # CartPole: 1 a step
    text = stepbus_eval(str(cartpole_run), "--episodes", "2", "--stochastic", "--seed", "4")
    assert text.returncode == 0 and "2 episodes (sampled): return" in text.stdout


def test_episodes_played_in_several_processes_are_those_played_in_one(cartpole_run: Path
                                                                      ) -> None:
    one = evaluate.play(evaluate.EvalConfig(run=str(cartpole_run), episodes=5, seed=3))
    three = evaluate.play_all(evaluate.EvalConfig(run=str(cartpole_run), episodes=5, seed=3,
                                                  envs=3))
    assert [(e.seed, e.ret, e.length) for e in three] == [(e.seed, e.ret, e.length) for e in one]
    assert [e.seed for e in one] == [3, 4, 5, 6, 7]


def test_record_video_leaves_an_mp4_a_decoder_reads(cartpole_run: Path, tmp_path: Path) -> None:
    iio = pytest.importorskip("imageio.v3")
    pytest.importorskip("moviepy")
    videos = tmp_path / "videos"
    done = stepbus_eval(str(cartpole_run), "--episodes", "1", "--record-video", str(videos))
    assert done.returncode == 0, done.stderr
    (mp4,) = videos.glob("*.mp4")
    frames = iio.imread(mp4)  # every frame, decoded by imageio's ffmpeg
    assert len(frames) > 0 and frames[0].ndim == 3 and frames.any()


def test_an_env_that_cannot_render_frames_is_refused_for_video(cartpole_run: Path,
                                                               tmp_path: Path) -> None:
    done = stepbus_eval(str(cartpole_run), "--env", "space_envs:masked_info", "--record-video",
                        str(tmp_path / "v"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "render" in done.stderr


def test_each_agent_of_a_pettingzoo_env_has_its_return(tmp_path: Path) -> None:
    serial_run(tmp_path, "--env", "space_envs:masked_pair_info", *QUICK)
    result = evaluate.summary(evaluate.play(evaluate.EvalConfig(
        run=str(tmp_path / "latest"), episodes=2)), "pair", 0, True)
    assert set(result["agents"]) == {"left", "right"}
    for episode in result["episodes"]:
        assert episode["return"] == pytest.approx(sum(episode["returns"].values()))
        assert episode["returns"]["left"] > 0


def test_paths_that_are_no_run_exit_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for path, says in ((tmp_path / "nowhere", "no such run directory"),
                       (tmp_path / "empty", "holds no checkpoint")):
        done = stepbus_eval(str(path), "--json")
        assert done.returncode == 2 and done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1 and says in done.stderr
