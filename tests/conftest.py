"""Real processes on real sockets, and nothing left behind even when a test fails."""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pluggy
import pytest
import zmq

from stepbus.bus import forkserver, launch, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.forkserver import ForkServer
from stepbus.models import mlp
from stepbus.policy import ActionSpace

TESTS_DIR = Path(__file__).parent
REPO = TESTS_DIR.parent
ROLES = ("controller", "broker", "worker", "assembler", "trainer")
# Learner flags for a test that counts metrics records as policy updates (or compares records
# update by update): a record per update, where by default there is one a second at most.
EVERY_UPDATE = ("--metrics-interval-s", "0")


Proc = launch.Child  # a process a test started: name, popen, pid, output, wait, signal


def hung_stacks(pid: int, settle_s: float = 0.5) -> None:
    """A hung stepbus process's threads' stacks, into its stderr (SIGUSR2, `stepbus.entry`),
    before it is killed: what it waited on. `settle_s`: faulthandler writes from the signal
    handler at once; this covers a process that the machine's load keeps from running."""
    try:
        os.kill(pid, signal.SIGUSR2)
    except ProcessLookupError:
        return
    time.sleep(settle_s)


def hung(args: tuple[str, ...], timeout: float, stderr: str) -> AssertionError:
    """The failure of a command that outlived its timeout: its stderr, stacks last."""
    return AssertionError(f"`stepbus {shlex.join(args)}` did not exit within {timeout}s; its "
                          f"stderr, stacks last:\n{stderr[-6000:]}")


def shared_forkserver() -> ForkServer | None:
    """Where a Cluster forks its roles from: this test process's fork server (each role then
    starts in milliseconds, not 0.3-0.5 s of imports), or None with STEPBUS_TEST_FORKSERVER=0
    (every role a fresh interpreter, as a Procfile line starts it)."""
    if os.environ.get("STEPBUS_TEST_FORKSERVER", "1") == "0":
        return None
    return forkserver.shared()


class Cluster:
    """Starts stepbus processes wired on ipc:// endpoints in a private temp dir."""

    def __init__(self) -> None:
        # ipc paths must stay short (108 bytes), so not pytest's long tmp_path.
        self.dir = Path(tempfile.mkdtemp(prefix="sb-"))
        self.endpoints = {name: f"ipc://{self.dir}/{name}" for name in wiring.ENDPOINTS}
        self.group = launch.Group(self.dir, forkserver=shared_forkserver())
        self.commands = 0  # `cli` commands run, which name their output files

    @property
    def procs(self) -> list[Proc]:
        return self.group.procs

    @property
    def runs_dir(self) -> Path:
        return self.dir / "runs"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = launch.environment(self.endpoints, self.runs_dir)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR),
                                                          env.get("PYTHONPATH", "")]))
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra or {})
        return env

    def start(self, role: str, *args: str, name: str | None = None,
              env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> Proc:
        """`prefix`: a command that runs it, e.g. ("ip", "netns", "exec", NS)."""
        name = name or f"{role}{sum(p.name.startswith(role) for p in self.procs)}"
        return self.group.start_role(role, *args, name=name, log=self.dir / f"{name}.log",
                                     env=self.env(env), prefix=prefix)

    def start_all(self, trainer_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = (),
                  workers: int = 1, trainer: str = "trainer") -> dict[str, Proc]:
        """Every process; `trainer` is the trainer slot, or "learner" for a bare learner."""
        procs = {"controller": self.start("controller"), "broker": self.start("broker"),
                 "assembler": self.start("assembler")}
        for i in range(workers):
            procs[f"worker{i}"] = self.start("worker", "--name", f"w{i}", "--worker-index",
                                             str(i), *worker_args)
        procs["trainer"] = self.start(trainer, *trainer_args)
        return procs

    def socket(self, kind: int, endpoint: str, *, bind: bool = False) -> zmq.Socket:
        """A socket of the test's own, standing in for a peer."""
        return topology.stand_in(kind, endpoint, bind=bind)

    def cli(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """`stepbus ARGS` as a user runs it, what it printed on each stream and its exit code:
        forked from the fork server when there is one (a Python start-up saved per command)."""
        argv = [sys.executable, "-m", "stepbus", *args]
        server = shared_forkserver()
        if server is None:
            run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=self.env(), cwd=self.dir)
            try:
                out_text, err_text = run.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                hung_stacks(run.pid)
                run.kill()
                err_text = run.communicate()[1]
                raise hung(args, timeout, err_text) from None
            return subprocess.CompletedProcess(argv, run.returncode, out_text, err_text)
        self.commands += 1
        out, err = (self.dir / f"command{self.commands}.{s}" for s in ("out", "err"))
        command = server.start(args, env=self.env(), cwd=self.dir, log=out, err=err)
        try:
            code = command.wait(timeout)
        except subprocess.TimeoutExpired:
            hung_stacks(command.pid)
            command.kill()
            raise hung(args, timeout, err.read_text()) from None
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())

    def metrics(self) -> list[dict[str, Any]]:
        path = self.runs_dir / "latest" / "metrics.jsonl"  # the trainer links the newest run
        if not path.exists():
            return []
        text = path.read_text()
        if not text.endswith("\n"):  # the trainer is writing the last line right now
            text = text.rpartition("\n")[0]
        return [json.loads(line) for line in text.splitlines() if line]

    def strays(self) -> list[int]:
        """Pids of live processes working in our temp dir: what honcho started, for one,
        whose children each run in a session of their own."""
        return self.group.strays()

    def kill_all(self) -> None:
        self.group.stop()

    def stacks_of_the_living(self) -> None:
        """Every process still running prints its threads' stacks into its log (SIGUSR2), so
        a failed test's dump shows where a hung one waited."""
        living = [proc for proc in self.procs if proc.poll() is None]
        for proc in living:
            hung_stacks(proc.pid, settle_s=0.0)
        if living:
            time.sleep(0.5)

    def dump(self) -> str:
        return "\n".join(f"----- {p.name} (rc={p.popen.poll()}) -----\n{p.output()[-4000:]}"
                         for p in self.procs)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """As stepbus processes run torch (--torch-threads 1): on a busy machine, torch's default
    of a thread per core made torch tests ten times slower, its threads waiting on each other.
    A module of torch tests says `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            c.stacks_of_the_living()
        c.kill_all()
        if failed is not None and failed.failed:
            print(c.dump())
        shutil.rmtree(c.dir, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class SolvedRun:
    """What `stepbus run` printed and left when it solved CartPole."""

    returncode: int
    stdout: str
    stderr: str
    runs_dir: Path


SOLVE_TIMEOUT_S = 90  # under the suite's 120 s per test, which counts a fixture's setup


@pytest.fixture(scope="session")
def solved_cartpole(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> SolvedRun:
    """`stepbus run` (CartPole to its threshold, seed 0) in a fresh interpreter, once for the
    whole session: the first test to ask runs it while any other xdist worker asking waits on
    the lock, and both read what it left. Tests that need a solved run share it (a solve is
    the suite's most expensive step), and each checks its own claim on it."""
    shared = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):
        shared = shared.parent  # one directory for every worker of this session
    with (shared / "solved-cartpole.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = shared / "solved-cartpole.json"
        if not record.exists():
            cwd = shared / "solved-cartpole"
            shutil.rmtree(cwd, ignore_errors=True)  # a solve interrupted before its record
            cwd.mkdir()
            record.write_text(json.dumps({**_solve(cwd), "runs_dir": str(cwd / "runs")}))
    fields = json.loads(record.read_text())
    return SolvedRun(**{**fields, "runs_dir": Path(fields["runs_dir"])})


def _solve(cwd: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPBUS_")}
    try:
        res = subprocess.run([sys.executable, "-m", "stepbus", "run", "--max-env-steps",
                              "300000"], capture_output=True, text=True,
                             timeout=SOLVE_TIMEOUT_S, cwd=cwd, env=env)
    except subprocess.TimeoutExpired:  # every test that shares it fails, saying so
        return {"returncode": -1, "stdout": "",
                "stderr": f"no exit within {SOLVE_TIMEOUT_S} s"}
    return {"returncode": res.returncode, "stdout": res.stdout, "stderr": res.stderr}


def pytest_configure(config: pytest.Config) -> None:
    """Once per run (in xdist's controller, or the one process of -n 0), before any test starts
    a process: stepbus's bytecode compiled where every child finds it. With
    PYTHONDONTWRITEBYTECODE set (as on some machines; `.ci/run` unsets it) no process writes
    it, and each of the suite's hundreds of children would compile stepbus's modules again
    (0.08 s of CPU each)."""
    if hasattr(config, "workerinput"):
        return
    import compileall

    for part in ("stepbus", "bus", "processor", "trainer", "workers", "tests"):
        # The package's subpackages are symlinks, which compile_dir does not follow: each is
        # compiled where it lives, and a child importing through the link reads the same file.
        compileall.compile_dir(REPO / part, quiet=1, workers=1)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`-m solo` runs three tests alone: a test module that marks none solo is not imported
    (collecting them all imports torch, hypothesis and the rest, 6 s of the solo run)."""
    if (config.getoption("markexpr") == "solo" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        return "mark.solo" not in collection_path.read_text() or None
    return None


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(
        item: pytest.Item, call: pytest.CallInfo[None],
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


def serial_run(runs_dir: Path, *flags: str) -> list[dict[str, Any]]:
    """`stepbus run FLAGS` in this process (controller, broker, workers, assembler and learner
    on one thread, sockets on inproc://); it must exit 0. Its metrics records. For tests that
    train or check a training behaviour: what only real processes show (kills, freezes,
    supervision, CURVE, TCP) stays on `Cluster`. An env's, a model's or an algorithm's
    exception raises here, failing the test with its own traceback."""
    from stepbus import cli, serial

    assert serial.run(cli.serial_roles(["--runs-dir", str(runs_dir), *flags])) == 0
    text = (runs_dir / "latest" / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.05) -> Any:
    """Poll a cheap predicate until it holds; fail with `what` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def honcho(cluster: Cluster, *args: str, target: str | None = None) -> subprocess.Popen:
    """`honcho start` on the repo's Procfile, endpoints on free TCP ports."""
    procfile = cluster.dir / "Procfile"
    text = (REPO / "Procfile").read_text()
    if target is not None:
        text = text.replace("exec stepbus trainer",
                            f"exec stepbus trainer --target-return {target}")
    procfile.write_text(text)
    names = list(wiring.ENDPOINTS)  # the cluster's CLI commands follow them
    cluster.endpoints = {n: f"tcp://127.0.0.1:{port}"
                         for n, port in zip(names, wiring.free_tcp_ports(len(names)), strict=True)}
    env = cluster.env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    honcho_bin = shutil.which("honcho", path=env["PATH"])
    assert honcho_bin, "honcho is a dependency"
    return cluster.group.start([honcho_bin, "start", *args], name="honcho",
                               log=cluster.dir / "honcho.out", env=env).popen


def never_taken_in(assembler_log: str) -> int:
    """From the assembler's last line: trajectories no learner ever took in."""
    line = [ln for ln in assembler_log.splitlines() if "assembler stopping" in ln][-1]
    found = re.search(r"(\d+) never taken in by a learner", line)
    assert found is not None, line
    return int(found.group(1))


def interrupt_honcho(cluster: Cluster, proc: subprocess.Popen) -> str:
    """Ctrl-C to `honcho start`: every process stops with rc 0 within 5 s, without a traceback,
    and none is left. Returns honcho's output."""
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    proc.wait(timeout=10)
    elapsed = time.monotonic() - t0
    out = (cluster.dir / "honcho.out").read_text()
    assert elapsed < 5, out[-3000:]
    assert out.count("stopped (rc=0)") == 5, out[-5000:]
    assert "Traceback" not in out
    assert cluster.strays() == [], "no process is left behind"
    return out


def act_as_trainer(cluster: Cluster, obs_dim: int) -> tuple[zmq.Socket, TrajectoryInbox]:
    """The test in the trainer's place: it publishes weights for a 2-action policy (so the
    broker steps) and takes the assembler's trajectories. Returns (weights, trajectories)."""
    trainer = cluster.socket(zmq.DEALER, cluster.endpoints["policy"])
    params = mlp.init_params(obs_dim, ActionSpace("discrete", n=2), (8,),
                             np.random.default_rng(0))
    send_message(trainer, p.Weights(trainer="t", incarnation="t1", policy="default", version=1,
                                    consumed_steps=0, batch_steps=256, starving=False,
                                    params=params))
    return trainer, TrajectoryInbox(cluster.socket(zmq.PULL, cluster.endpoints["trajectories"]))


def recv_message(sock: zmq.Socket, timeout: float = 5.0) -> p.Message:
    """The next message on a socket, or an assertion error after `timeout` seconds."""
    if not sock.poll(int(timeout * 1000)):
        raise AssertionError(f"no message within {timeout}s")
    return p.decode(sock.recv_multipart(copy=False))


class TrajectoryInbox:
    """A test's trajectories socket, read one trajectory at a time as a learner takes them in:
    the assembler sends several in one TRAJECTORIES message, and sends again what no learner
    confirmed when one connects (its handshake may be seen after a first send), so a numbered
    one taken in already is skipped, as a learner does."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.queue: collections.deque[p.Trajectory] = collections.deque()
        self.taken: set[tuple[str, int]] = set()

    def poll(self, timeout_ms: int = 0) -> bool:
        return bool(self.queue) or bool(self.sock.poll(timeout_ms))

    def recv(self, timeout: float = 5.0) -> p.Trajectory:
        """The next trajectory not taken in before, or an assertion error after `timeout`
        seconds."""
        deadline = time.monotonic() + timeout
        while not self.queue:
            msg = recv_message(self.sock, max(0.0, deadline - time.monotonic()))
            assert isinstance(msg, p.Trajectories | p.Trajectory), msg
            for t in msg.split() if isinstance(msg, p.Trajectories) else [msg]:
                if not t.assembler or (t.assembler, t.seq) not in self.taken:
                    self.taken.add((t.assembler, t.seq))
                    self.queue.append(t)
        return self.queue.popleft()

    def close(self) -> None:
        self.sock.close()


def send_message(sock: zmq.Socket, msg: p.Message) -> None:
    sock.send_multipart(p.encode(msg), copy=False)


class ManualClock:
    """A clock a test moves by hand (`clock.t += s`): process objects read time only from it,
    so their timers and liveness are tested without sleeping."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
