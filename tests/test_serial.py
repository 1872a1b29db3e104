"""The serial runner: the whole pipeline in one OS process, solving CartPole, and an env's bug
raised in the user's terminal with its own traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import TESTS_DIR, SolvedRun

from stepbus import cli, serial


def _environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPBUS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    return env


def test_stepbus_run_solves_cartpole_in_one_process_and_exits_0(
        solved_cartpole: SolvedRun) -> None:
    res = solved_cartpole
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "solved: mean return" in res.stdout, res.stdout[-3000:]
    assert "Traceback" not in res.stdout + res.stderr
    (run_dir,) = [d for d in res.runs_dir.iterdir() if d.name != "latest"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["mean_return"] >= 475


def test_an_env_that_raises_shows_its_own_traceback_and_exits_1(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "stepbus", "run", "--env",
                          "scripted_envs:hundredth_step_raises", "--envs-per-worker", "2"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=_environ())
    assert res.returncode == 1, res.stderr[-3000:]
    source = (TESTS_DIR / "scripted_envs.py").read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "# HUNDREDTH LINE" in text)
    assert f'scripted_envs.py", line {line}, in step' in res.stderr, res.stderr[-3000:]
    assert res.stderr.rstrip().endswith(
        "ZeroDivisionError: the hundredth step divides by zero"), res.stderr[-3000:]


def test_a_serial_run_in_a_test_process_learns_and_gives_back_the_signal_handlers(
        tmp_path: Path) -> None:
    """The serial runner in-process, as training tests use it."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    roles = cli.serial_roles(["--runs-dir", str(tmp_path), "--max-env-steps", "4096",
                              "--target-return", "1000"])
    assert serial.run(roles) == 0
    assert signal.getsignal(signal.SIGINT) is before
    records = [json.loads(line)
               for line in (tmp_path / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["env_steps"] >= 4096
