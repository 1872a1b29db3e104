"""One run configuration: a file every process reads, presets under it, STEPBUS_* variables
and flags over it, bad keys and values named with their file and line, and the run
directory's record of a run that makes the same run again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EVERY_UPDATE, serial_run

from stepbus import cli, runconfig


def parse(tmp_path: Path, text: str, *argv: str, monkeypatch: pytest.MonkeyPatch
          ) -> object:
    path = tmp_path / "stepbus.toml"
    path.write_text(text)
    monkeypatch.setenv(runconfig.CONFIG_ENV, str(path))
    return cli.build_parser().parse_args(list(argv))


def test_a_file_sets_every_process_and_variables_and_flags_override_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = ("envs_per_worker = 16\nenv_kwargs = {max_episode_steps = 200}\n"
            "[algorithm]\nlearning_rate = 3e-4\nhidden = [32, 32]\nnorm_obs = true\n")
    worker = parse(tmp_path, text, "worker", monkeypatch=monkeypatch)
    assert vars(worker)["envs_per_worker"] == 16
    assert json.loads(vars(worker)["env_kwargs"]) == {"max_episode_steps": 200}
    learner = vars(parse(tmp_path, text, "learner", monkeypatch=monkeypatch))
    assert (learner["lr"], learner["hidden"], learner["norm_obs"]) == (3e-4, (32, 32), True)
    flagged = vars(parse(tmp_path, text, "learner", "--lr", "1e-3", monkeypatch=monkeypatch))
    assert flagged["lr"] == 1e-3, "a flag over the file"
    monkeypatch.setenv("STEPBUS_LEARNING_RATE", "5e-4")
    monkeypatch.setenv("STEPBUS_NORM_OBS", "0")
    varied = vars(parse(tmp_path, text, "learner", monkeypatch=monkeypatch))
    assert (varied["lr"], varied["norm_obs"]) == (5e-4, False), "a variable over the file"


def test_a_preset_is_under_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = vars(parse(tmp_path, 'preset = "pendulum"\nn_epochs = 3\n', "learner",
                      monkeypatch=monkeypatch))
    assert (args["batch_steps"], args["gamma"], args["n_epochs"]) == (4096, 0.9, 3)
    assert set(runconfig.presets()) >= {"cartpole", "acrobot", "pendulum", "halfcheetah",
                                        "hopper"}
    for name in runconfig.presets():  # every shipped preset is made of keys that exist
        runconfig.read_preset(name, cli.config_keys())


@pytest.mark.parametrize("text, says", [
    ("envs_per_worker = 4\n[algorithm]\nlerning_rate = 3e-4\n",
     "line 3: unknown key 'lerning_rate' (did you mean 'learning_rate'?)"),
    ("envs_per_worker = -4\n", "line 1: envs_per_worker: must be 1 to 65536, not -4"),
    ("norm_obs = 3\n", "line 1: norm_obs: true or false is needed, not 3"),
    ('env_kwargs = "[1]"\n', "line 1: env_kwargs: a JSON object of keyword arguments"),
    ("envs_per_worker = \n", "stepbus.toml: Invalid value (at line 1, column 19)"),
])
def test_a_bad_key_or_value_is_one_line_naming_the_file_and_line_and_exit_2(
        tmp_path: Path, text: str, says: str) -> None:
    (tmp_path / "stepbus.toml").write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPBUS_")}
    res = subprocess.run([sys.executable, "-m", "stepbus", "worker"], capture_output=True,
                         text=True, timeout=30, cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and says in res.stderr, res.stderr


def test_the_run_directorys_record_makes_the_same_run_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A --deterministic run from a file; then one from the file its run directory holds:
    every update's digest the same (the serial runner)."""
    made = tmp_path / "made.toml"
    made.write_text("deterministic = true\nseed = 7\nenvs_per_worker = 4\nmax_updates = 3\n"
                    "target_return = 0\n")
    monkeypatch.setenv(runconfig.CONFIG_ENV, str(made))
    first = serial_run(tmp_path / "first", *EVERY_UPDATE)
    record = tmp_path / "first" / "latest" / "config.toml"
    settings = runconfig.read(record, cli.config_keys())
    assert settings["seed"].value == 7 and settings["deterministic"].value is True
    monkeypatch.setenv(runconfig.CONFIG_ENV, str(record))
    again = serial_run(tmp_path / "again", *EVERY_UPDATE)
    assert [r["digest"] for r in first] == [r["digest"] for r in again]
    assert len(first) == 3
