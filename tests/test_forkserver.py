"""The fork server the suite starts its roles from (bus/forkserver.py): a forked role is a
process of its own as `python -m stepbus ROLE` is (session, working directory, environment,
PYTHONPATH, log, exit code or signal), and none outlives the server. (Its /proc/PID/environ
is the server's: a forked process never execs, so the kernel's copy is not its own.)"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for

from stepbus.bus import forkserver, launch
from stepbus.bus.forkserver import ForkServer


@pytest.fixture
def server() -> Iterator[ForkServer]:
    forks = ForkServer()
    try:
        yield forks
    finally:
        forks.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """ipc:// paths must stay short: not pytest's tmp_path."""
    with tempfile.TemporaryDirectory(prefix="sb-") as name:
        yield Path(name)


def controller_endpoints(short_dir: Path) -> dict[str, str]:
    """Both sockets a controller binds, in the test's own directory: a default TCP port would
    be taken by the controller of a test running beside it."""
    return {"controller": f"ipc://{short_dir}/controller",
            "broadcast": f"ipc://{short_dir}/broadcast"}


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_setting_error_is_its_exit_2_and_its_line_in_the_log(server: ForkServer,
                                                                short_dir: Path) -> None:
    group = launch.Group(short_dir, forkserver=server)
    bad = group.start_role("worker", "--controller", "notanendpoint", log=short_dir / "w.log",
                           env=launch.environment({}))
    assert bad.wait(30) == 2
    assert "notanendpoint" in bad.output() and "Traceback" not in bad.output()


def test_a_command_s_two_streams_go_to_two_files_when_asked(server: ForkServer,
                                                             short_dir: Path) -> None:
    """As `subprocess.run(capture_output=True)` keeps them apart: what a command prints on
    stdout in one file, its error line in the other."""
    out, err = short_dir / "out", short_dir / "err"
    ok = server.start(["keys", "--dir", str(short_dir / "keys")], env=launch.environment({}),
                      cwd=short_dir, log=out, err=err)
    assert ok.wait(30) == 0 and "client.key" in out.read_text() and err.read_text() == ""
    bad = server.start(["status", "--controller", "nowhere"], env=launch.environment({}),
                       cwd=short_dir, log=out, err=err)
    assert bad.wait(30) == 2 and out.read_text() == ""
    assert "nowhere" in err.read_text() and "Traceback" not in err.read_text()


def test_a_child_whose_exit_is_read_before_its_start_returns_keeps_its_exit_code() -> None:
    """A child that exits at once (a setting error) may have its exit read right after its
    pid, before `start` takes the pid: that exit is its own, not a reused pid's last
    holder's (taken for one, it left the child's wait hanging until its timeout)."""
    replies, server_out = os.pipe()
    os.write(server_out, b'{"exit": 7, "code": 0}\n{"pid": 7}\n{"exit": 7, "code": 2}\n')
    os.close(server_out)
    stand_in = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        with open(replies, "rb") as stream:
            stand_in.stdout = stream
            forks = ForkServer(process=stand_in)
            wait_for(lambda: forks._gone, 10, "the replies read")
            child = forks.start(["broker"], env={}, cwd="/", log=None)
    finally:
        forks.close()
    assert child.pid == 7 and child.wait(0) == 2, "its own exit, not the last holder's"


def test_a_forked_role_has_its_own_session_directory_environment_and_path(
        server: ForkServer, short_dir: Path) -> None:
    # an env module only the child's PYTHONPATH holds, which says when the worker made it
    # (written whole, then renamed: the test must never read it half written)
    (short_dir / "mods").mkdir()
    (short_dir / "mods" / "marked_env.py").write_text(
        "import os, pathlib, gymnasium\n"
        "def make(**kwargs):\n"
        "    pathlib.Path('made.part').write_text(os.environ['MARK'] + ' ' + os.getcwd())\n"
        "    os.replace('made.part', 'made')\n"
        "    return gymnasium.make('CartPole-v1')\n")
    env = launch.environment(controller_endpoints(short_dir),
                             extra={"PYTHONPATH": "mods", "MARK": "forked"})  # from cwd
    group = launch.Group(short_dir, forkserver=server)
    controller = group.start_role("controller", log=short_dir / "c.log", env=env)
    wait_for(lambda: (short_dir / "controller").exists(), 30, "the controller's socket")
    assert os.getsid(controller.pid) == controller.pid != os.getsid(0)
    assert Path(f"/proc/{controller.pid}/cwd").resolve() == short_dir.resolve()
    worker = group.start_role("worker", "--env", "marked_env:make", "--envs-per-worker", "1",
                              log=short_dir / "w.log", env=env)
    wait_for(lambda: (short_dir / "made").exists() or worker.poll() is not None, 30,
             "the worker to make its env")
    assert worker.poll() is None, worker.output()
    assert (short_dir / "made").read_text() == f"forked {short_dir}"
    controller.signal(signal.SIGKILL)
    assert controller.wait(10) == -signal.SIGKILL
    group.stop()
    assert worker.poll() is not None


def test_no_child_outlives_the_server(short_dir: Path) -> None:
    forks = ForkServer()
    group = launch.Group(short_dir, forkserver=forks)
    env = launch.environment(controller_endpoints(short_dir))
    controller = group.start_role("controller", log=short_dir / "c.log", env=env)
    wait_for(lambda: (short_dir / "controller").exists(), 30, "the controller's socket")
    forks.close()
    wait_for(lambda: not alive(controller.pid), 10, "the controller to end with its server")


def test_the_shared_server_outlives_the_thread_that_asked_and_is_started_again_once_dead(
        short_dir: Path) -> None:
    asked: list[ForkServer] = []
    thread = threading.Thread(target=lambda: asked.append(forkserver.started_from_keeper()))
    thread.start()
    thread.join(30)
    try:
        child = asked[0].start(["keys", "--dir", str(short_dir / "keys")],
                               env=launch.environment({}), cwd=short_dir, log=None)
        assert child.wait(30) == 0, "its parent is the keeper thread, not the one that ended"
    finally:
        asked[0].close()
    first = forkserver.shared()
    assert forkserver.shared() is first
    first.process.kill()
    first.process.wait(10)
    again = forkserver.shared()
    assert again is not first and again.alive()
