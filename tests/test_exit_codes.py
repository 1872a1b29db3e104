"""The exit codes table (docs/operations.md#exit-codes), walked with real processes: a setting
that cannot work exits 2 with one line and no traceback, from a role, a client command, a
supervisor and the trainer slot alike; a supervisor gives up on it at once and exits 2 too."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stepbus.bus import lane, wiring
from stepbus.bus.exits import Exit

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 20.0  # a hung process fails the test long before this; none should come near it
NOT_INHERITED = ("STEPBUS_KEYS", "STEPBUS_INSECURE", "HONCHO_PROCESS_NAME")


@dataclass
class Ran:
    code: int
    out: str  # stdout and stderr together: logs and the one-line error
    seconds: float


@pytest.fixture
def home() -> Iterator[Path]:
    """A short private directory (ipc paths are limited to 108 bytes) that every endpoint
    points into, so no process reaches another test's run or a default TCP port."""
    path = Path(tempfile.mkdtemp(prefix="sb-exit-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run(home: Path, *args: str, pythonpath: str = "") -> Ran:
    """`python -m stepbus ARGS` in a session of its own, killed with everything it started
    (a supervisor's child, a slot's learner) whatever happens."""
    env = {k: v for k, v in os.environ.items()
           if k not in NOT_INHERITED and not k.startswith("STEPBUS_")}
    env.update({spec.env_var: f"ipc://{home}/{name}" for name, spec in wiring.ENDPOINTS.items()})
    env["STEPBUS_RUNS_DIR"] = str(home / "runs")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "stepbus", *args], cwd=home, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
    return Ran(proc.returncode, out, time.monotonic() - t0)


def assert_setting_error(ran: Ran, *said: str) -> None:
    assert ran.code == Exit.SETTING, ran.out
    assert "Traceback" not in ran.out, ran.out
    for text in said:
        assert text in ran.out, ran.out


def documented_codes() -> set[int]:
    """The codes in the first column of the table under docs/operations.md's "Exit codes"."""
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    return {int(m) for m in re.findall(r"^\| (\d+) \|", section, flags=re.MULTILINE)}


def test_the_table_has_every_code_and_nothing_else():
    assert documented_codes() == {int(code) for code in Exit}


def test_a_bad_number_flag_exits_2_naming_it(home: Path):
    assert_setting_error(run(home, "worker", "--envs-per-worker", "0"),
                         "argument --envs-per-worker: must be 1 to")


def test_a_worker_lane_nobody_reads_or_split_exits_2_naming_it(home: Path):
    """A --lane is made by the vector env that starts the worker: without it there, the
    worker says so at once rather than waiting for a reader."""
    lane_paths = lane.LanePaths.of(home / "lane-w")
    lane_paths.make()
    assert_setting_error(run(home, "worker", "--lane", str(home / "lane-w")),
                         f"--lane: cannot open the lane {lane_paths.to_caller}: nobody reads it")
    assert_setting_error(run(home, "worker", "--lane", str(home / "lane-w"), "--splits", "2"),
                         "--lane takes a whole worker: --splits must be 1, not 2")


def test_a_silence_shorter_than_the_heartbeats_allow_exits_2_naming_it(home: Path):
    assert_setting_error(run(home, "supervise", "--silence-s", "0.5", "assembler"),
                         "--silence-s must be 0 (never) or at least 1", "not 0.5")


def test_a_bind_beyond_loopback_without_keys_is_refused_with_2(home: Path):
    port = wiring.free_tcp_ports(1)[0]
    ran = run(home, "controller", "--controller", f"tcp://0.0.0.0:{port}")
    assert_setting_error(ran, f"stepbus controller: refusing to bind tcp://0.0.0.0:{port}",
                         "--insecure")


def test_a_supervisor_gives_up_at_once_on_a_child_that_exits_2_and_exits_2(home: Path):
    port = wiring.free_tcp_ports(1)[0]
    ran = run(home, "supervise", "controller", "--controller", f"tcp://0.0.0.0:{port}")
    assert_setting_error(ran, "refusing to bind", "restarting cannot help")
    assert ran.out.count("controller started (pid") == 1, "started once, never restarted"
    assert ran.seconds < 10, ran.seconds


def test_a_missing_optional_dependency_exits_2_from_the_broker_and_the_trainer_slot(
        home: Path):
    """PyTorch hidden: an importable `torch` that raises ImportError, as a missing one does.
    The slot's learner exits 2, and the slot gives up on it at once and exits 2 too."""
    hidden = home / "hidden"
    (hidden / "torch").mkdir(parents=True)
    (hidden / "torch" / "__init__.py").write_text(
        'raise ImportError("hidden by the test", name="torch")\n')
    assert_setting_error(run(home, "broker", "--model", "torch", pythonpath=str(hidden)),
                         "--model torch needs PyTorch")
    slot = run(home, "trainer", "--model", "torch", pythonpath=str(hidden))
    assert_setting_error(slot, "--model torch needs PyTorch", "restarting cannot help")
    assert slot.out.count("learner started (pid") == 1, slot.out


def test_trainer_swap_with_learner_flags_that_do_not_parse_exits_2(home: Path):
    ran = run(home, "trainer", "swap", "--lr", "-1")
    assert_setting_error(ran, "stepbus trainer swap:", "--lr")
    assert "unreachable" not in ran.out, "refused before asking the controller"


def test_a_missing_keys_directory_exits_2(home: Path):
    missing = home / "no-keys"
    assert_setting_error(run(home, "broker", "--keys", str(missing)),
                         f"stepbus broker: --keys {missing}: no server.key there")


def test_keys_refuses_to_overwrite_with_2(home: Path):
    wiring.make_keys(str(home / "keys"))
    assert_setting_error(run(home, "keys", "--dir", "keys"), "not overwriting")


def test_status_against_no_controller_exits_2_naming_the_address(home: Path):
    ran = run(home, "status", "--timeout", "0.3")
    assert_setting_error(ran, f"controller unreachable at ipc://{home}/controller")
