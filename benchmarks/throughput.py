"""Steps per second of the stepbus pipeline next to Python's vectorizers, in one invocation.

    python benchmarks/throughput.py                    # every scenario, full grids (~10 min)
    python benchmarks/throughput.py --quick            # smaller grids, shorter windows
    python benchmarks/throughput.py --scenario cartpole --seconds 5
    python benchmarks/throughput.py --smoke            # ~10 s: proves it still works

Scenarios (the envs ship in `stepbus.workers.bench_envs`):
- cartpole: CartPole-v1, stepbus at envs per worker 1, 8, 32, 128 and workers 1, 2, 4.
- heavy: steps cost 1 ms of CPU (p 0.9) or 10 ms (p 0.1); figures as % of the ideal,
  cores / mean step time.
- frames: 84x84x4 uint8 observations at about zero step cost, against AsyncVectorEnv with
  shared memory.
- scaling: a 1 ms CPU-bound env with 1, 2, 4, 8, 16 workers.

stepbus runs as real processes (controller, broker, workers, assembler, and a trainer slot whose
learner consumes with `stepbus.trainer.consume:ConsumeOnly`, so the consumer is not the
bottleneck; the broker still infers with a real 64-64 MLP). Its figure is the assembler's step
count over a measured window after warm-up, read from the controller's status (the same figures
`stepbus status` prints); the learner's count and each process's CPU use over the window are
kept too. Peers run in a child process each, with random actions: gymnasium's AsyncVectorEnv
(best over env counts and start methods), Stable-Baselines3's SubprocVecEnv, PufferLib's
multiprocessing backend and EnvPool when importable (never required), and one process stepping
one env in a loop (the per-core ceiling). Every process started is in a process group of its
own, killed on every way out (`stepbus.bus.launch`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import itertools
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from stepbus.bus import launch

CONSUME = "stepbus.trainer.consume:ConsumeOnly"
ENVS = {"cartpole": "CartPole-v1",
        "heavy": "stepbus.workers.bench_envs:heavy_tailed",
        "frames": "stepbus.workers.bench_envs:frames",
        "scaling": "stepbus.workers.bench_envs:cpu_bound"}
SCENARIOS = tuple(ENVS)
PEER_TIMEOUT_S = 90.0  # one peer measurement, start-up and teardown included


@dataclasses.dataclass(frozen=True)
class Setup:
    """One stepbus configuration."""

    workers: int
    envs_per_worker: int
    hidden: str = ""  # the policy MLP's widths (`--hidden`); "" for the default 64,64
    # Observations through shared memory: None as workers choose by default (batches of
    # shm.MIN_BATCH_BYTES and up), True for every batch, False never (on the socket).
    shm_frames: bool | None = None
    splits: int = 1  # workers with --splits (each split is a worker to the broker)

    def label(self) -> str:
        return f"{self.workers}w x {self.envs_per_worker}" + (
            f"/{self.splits}" if self.splits > 1 else "") + (
            f", mlp {self.hidden}" if self.hidden else "") + (
            {None: "", True: ", shm", False: ", socket"}[self.shm_frames])

    def shm_flags(self) -> tuple[str, ...]:
        if self.shm_frames is None:
            return ()
        return ("--shm-frames", "--shm-min-batch-bytes", "0") if self.shm_frames else (
            "--no-shm-frames",)


def grid(workers: tuple[int, ...], envs: tuple[int, ...], hidden: str = "",
         shm_frames: bool | None = None) -> list[Setup]:
    return [Setup(w, k, hidden, shm_frames) for w in workers for k in envs]


@dataclasses.dataclass
class Plan:
    """What one scenario measures."""

    stepbus: list[Setup]
    async_envs: list[int]  # AsyncVectorEnv env counts
    methods: list[str]  # multiprocessing start methods for the peers
    others: bool = True  # SB3 / PufferLib / EnvPool when importable
    # PufferLib's busy-polling workers each step a block of envs per wake-up: it needs far more
    # envs than AsyncVectorEnv to reach its best (CartPole: 11k at 64 envs, 91k at 1024).
    puffer_envs: tuple[int, ...] = (256, 1024)


def parse_flags(text: str) -> tuple[str, list[str]]:
    """`broker=--batch-wait-ms 0.2` -> ("broker", ["--batch-wait-ms", "0.2"])."""
    role, eq, flags = text.partition("=")
    if not eq or role not in ("controller", "broker", "worker", "assembler", "trainer"):
        raise argparse.ArgumentTypeError(f"expected ROLE=FLAGS with a stepbus role, got {text!r}")
    return role, shlex.split(flags)


GRID_ITEM = "WxK[/N][:hidden][+shm|+socket]"


def parse_grid(text: str) -> list[Setup]:
    """`1x8,2x128:1,1x64:1+shm,1x8/2` -> setups (workers x envs per worker[:hidden widths],
    `+shm`: every batch through shared memory, `+socket`: none, `/N`: workers with --splits
    N)."""
    setups = []
    for given in text.split(","):
        item, plus, shm_flag = given.strip().partition("+")
        if plus and shm_flag not in ("shm", "socket"):
            raise argparse.ArgumentTypeError(f"expected {GRID_ITEM}, got {given!r}")
        size, _, hidden = item.partition(":")
        size, _, splits = size.partition("/")
        workers, x, envs = size.partition("x")
        if not (x and workers.isdigit() and envs.isdigit() and (splits or "1").isdigit()):
            raise argparse.ArgumentTypeError(f"expected {GRID_ITEM}, got {given!r}")
        setups.append(Setup(int(workers), int(envs), hidden,
                            shm_flag == "shm" if plus else None, int(splits or 1)))
    return setups


def plans(mode: str) -> dict[str, Plan]:
    """The grids per scenario; `mode` is full, quick or smoke."""
    if mode == "smoke":
        return {"cartpole": Plan(stepbus=grid((1,), (8,)), async_envs=[2], methods=["fork"],
                                 others=False)}
    # Frames: the default 64-64 MLP's first layers (28,224 inputs each, for the policy and the
    # value) cost the broker ~0.18 ms per observation (float32), more than moving the frame; a
    # 1-unit MLP measures the pipeline's data path, the default one what a pixel MLP costs.
    # One worker with 64 envs sends fewer, larger batches: the best data path measured, with
    # frames through shared memory to the broker and assembler (the default for batches this
    # big) and on the socket.
    if mode == "quick":
        return {"cartpole": Plan(stepbus=grid((1,), (8, 32)) + grid((2,), (32,)),
                                 async_envs=[4, 16], methods=["fork"]),
                "heavy": Plan(stepbus=grid((2,), (1, 8)), async_envs=[2, 16], methods=["fork"]),
                "frames": Plan(stepbus=grid((1, 2), (8,), "1") + grid((1,), (64,), "1")
                               + grid((1,), (64,), "1", shm_frames=False) + grid((2,), (8,)),
                               async_envs=[4, 16], methods=["fork"]),
                "scaling": Plan(stepbus=grid((1, 2, 4, 16), (8,)), async_envs=[],
                                methods=["fork"], others=False)}
    # CartPole: workers x envs per worker, and 2 x 256, where per-message costs matter least.
    return {"cartpole": Plan(stepbus=grid((1, 2, 4), (1, 8, 32, 128)) + grid((2,), (256,)),
                             async_envs=[2, 4, 8, 16], methods=["fork", "forkserver", "spawn"]),
            # 2 x 128: per-message costs (broker ~0.9 ms, assembler ~0.4 ms of CPU) spread over
            # 128 steps, the setup that reaches 95% of the ideal (2 x 32 stays near 94%).
            "heavy": Plan(stepbus=grid((2, 4), (1, 8)) + grid((2,), (128,)),
                          async_envs=[2, 4, 8, 16], methods=["fork"]),
            "frames": Plan(stepbus=grid((1, 2), (8, 32), "1") + grid((1,), (64,), "1")
                           + grid((1,), (64,), "1", shm_frames=False) + grid((2,), (8,)),
                           async_envs=[2, 4, 8, 16], methods=["fork", "forkserver"]),
            # Scaling at 32 envs per worker too: a worker idles while its batch's actions are
            # inferred, a share that shrinks as its batches grow (1 -> 2 workers: 1.75x at 8).
            "scaling": Plan(stepbus=grid((1, 2, 4, 8, 16), (8, 32)), async_envs=[2, 16],
                            methods=["fork"], others=False)}


@dataclasses.dataclass
class Row:
    scenario: str
    system: str
    config: str
    envs: int
    steps_per_s: float | None
    note: str = ""
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- process groups

def _stat(pid: int | str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (None once it is gone)."""
    fields = _stat(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / CLK_TCK


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of a process (libzmq's I/O threads are `ZMQbg/...`)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def _zmq_threads(pid: int) -> float:
    return sum(v for k, v in threads_cpu(pid).items() if k.startswith("ZMQbg"))


def groups_cpu(pgids: set[int]) -> float:
    """CPU seconds used so far by the live processes of these process groups."""
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(entry)
            if fields is not None and int(fields[2]) in pgids:
                total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def machine_busy() -> float:
    """CPU seconds every core of the machine has spent not idle, so far."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values[:8]) - idle) / CLK_TCK


class LoadMeter:
    """How much CPU processes outside the given process groups used over a window, in % of
    one core: the noise figure, since other people's work on a shared machine changes ours."""

    def __init__(self, pgids: set[int]) -> None:
        self.pgids = pgids
        self.t0, self.busy0, self.ours0 = time.monotonic(), machine_busy(), groups_cpu(pgids)

    def other_percent(self) -> float:
        window = max(time.monotonic() - self.t0, 1e-9)
        ours = groups_cpu(self.pgids) - self.ours0
        return max(0.0, 100 * (machine_busy() - self.busy0 - ours) / window)


CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- stepbus

class Pipeline:
    """The five stepbus roles as real processes on ipc:// (or TCP loopback) endpoints."""

    def __init__(self, group: launch.Group, env: str, setup: Setup, transport: str,
                 batch_steps: int, flags: dict[str, list[str]] | None = None) -> None:
        from stepbus.bus import wiring

        self.dir = Path(tempfile.mkdtemp(prefix="sb-tp-"))
        names = list(wiring.ENDPOINTS)
        if transport == "tcp":
            ports = wiring.free_tcp_ports(len(names))
            self.endpoints = {n: f"tcp://127.0.0.1:{port}" for n, port in zip(names, ports,
                                                                              strict=True)}
        else:  # ipc paths must stay short (108 bytes): a short temp dir
            self.endpoints = {n: f"ipc://{self.dir}/{n}" for n in names}
        env_vars = launch.environment(self.endpoints, self.dir / "runs",
                                      {"STEPBUS_LOG_LEVEL": "WARNING"})
        # What the broker and the controller count as workers: every split of each.
        self.group, self.env_vars = group, env_vars
        self.workers = setup.workers * setup.splits
        self.flags = flags or {}
        self.start("controller")
        self.start("broker")
        self.start("assembler")
        for i in range(setup.workers):
            self.start("worker", "--name", f"w{i}", "--worker-index", str(i), "--env", env,
                       "--envs-per-worker", str(setup.envs_per_worker),
                       *setup.shm_flags(),
                       *(("--splits", str(setup.splits)) if setup.splits > 1 else ()))
        self.start("trainer", "--algo", CONSUME, "--target-return", "0", "--batch-steps",
                   str(batch_steps), "--checkpoint-interval-s", "1",
                   *(("--hidden", setup.hidden) if setup.hidden else ()))

    def start(self, role: str, *args: str) -> None:
        name = f"{role}-{len(self.group.procs)}"
        self.group.start_role(role, *args, *self.flags.get(role, []), name=name,
                              log=self.dir / f"{name}.log", env=self.env_vars, cwd=self.dir)

    def status(self, timeout_s: float = 3.0) -> tuple[float, list[dict]]:
        """(when the reply came, monotonic; status rows) from the controller."""
        import zmq

        from stepbus.bus import node, topology
        from stepbus.bus import protocol as p
        from stepbus.bus.topology import PortName, Role
        from stepbus.cli import STATUS_REPLY_MAX_BYTES

        ctx: zmq.Context = zmq.Context.instance()
        sock = topology.open_role(ctx, Role.CLIENT, self.endpoints)[PortName.CONTROLLER]
        try:
            node.send(sock, p.StatusRequest())
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if sock.poll(int(left * 1000) + 1):
                    msg = p.decode(sock.recv_multipart(copy=False),
                                   max_header_bytes=STATUS_REPLY_MAX_BYTES)
                    if isinstance(msg, p.StatusReply):
                        return time.monotonic(), msg.processes
            raise TimeoutError(f"the controller at {self.endpoints['controller']} did not answer")
        finally:
            sock.close(0)

    def full_status(self, tries: int = 10) -> tuple[float, list[dict]]:
        """Status with a row for every role: a process busy draining a long queue on a loaded
        machine can miss heartbeats and drop out of the controller's table for a moment."""
        for _ in range(tries):
            t, rows = self.status()
            roles = [r.get("role") for r in rows]
            if (all(role in roles for role in ("broker", "assembler", "trainer"))
                    and roles.count("worker") == self.workers):
                return t, rows
            time.sleep(0.1)  # until the next heartbeats (every 0.5 s)
        return t, rows

    def check_alive(self) -> None:
        dead = [proc for proc in self.group.procs if proc.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited {dead[0].poll()}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}"
                         for path in sorted(self.dir.glob("*.log")))

    def wait_ready(self, timeout_s: float) -> None:
        """Until every worker is served and trajectories reach the learner."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(TimeoutError):
                _, rows = self.status(1.0)
                broker = _row(rows, "broker")
                learner = _row(rows, "trainer")
                if (broker and broker.get("workers") == self.workers and learner
                        and (learner.get("env_steps") or 0) > 0):
                    return
            time.sleep(0.2)  # a benchmark waiting for start-up, not a test's synchronisation
        raise TimeoutError(f"pipeline not stepping within {timeout_s:.0f}s\n{self.logs()}")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _row(rows: list[dict], role: str) -> dict | None:
    return next((r for r in rows if r.get("role") == role), None)


def _counts(t: float, rows: list[dict]) -> dict[str, tuple[float, float]]:
    """(time the figures were sent, cumulative steps) for the assembler and the learner."""
    out = {}
    for role, key in (("assembler", "steps"), ("trainer", "env_steps")):
        row = _row(rows, role)
        if row is not None and isinstance(row.get(key), int):
            out[role] = (t - float(row.get("last_heartbeat_s", 0.0)), float(row[key]))
    return out


@dataclasses.dataclass
class Edge:
    """One end of a measured window: when the controller's status came, its rows, and the CPU
    seconds each process (role:name) had used so far, in all and in libzmq's I/O threads."""

    t: float
    rows: list[dict]
    cpu: dict[str, float | None]
    zmq: dict[str, float]


def window_edge(t: float, rows: list[dict], pids: dict[str, int]) -> Edge:
    cpu = {k: cpu_seconds(pid) for k, pid in pids.items()}
    zmq = {k: _zmq_threads(pid) for k, pid in pids.items()}
    return Edge(t, rows, cpu, zmq)


def measure_stepbus(env: str, setup: Setup, args: argparse.Namespace,
                    on_running: Callable[[list[dict]], Callable[[], None]] | None = None) -> Row:
    """One stepbus figure; `on_running(status rows)` is called as the window opens (a profiler)
    and what it returns as the window closes."""
    group = launch.Group()
    pipeline = None
    try:
        pipeline = Pipeline(group, env, setup, args.transport, args.batch_steps, args.flags)
        pipeline.wait_ready(30 + 3 * setup.workers)
        time.sleep(args.warmup)
        t0, rows0 = pipeline.full_status()
        pids = {f"{r['role']}:{r['name']}": r["pid"] for r in rows0 if isinstance(r.get("pid"),
                                                                                   int)}
        start = window_edge(t0, rows0, pids)
        meter = LoadMeter({proc.pid for proc in group.procs})
        window_closed = on_running(rows0) if on_running is not None else None
        time.sleep(args.seconds)
        pipeline.check_alive()
        t1, rows1 = pipeline.full_status()
        end = window_edge(t1, rows1, pids)
        other = meter.other_percent()
        if window_closed is not None:
            window_closed()
        return stepbus_row(setup, start, end, other)
    except (RuntimeError, TimeoutError) as exc:
        return Row("", "stepbus", setup.label(), setup.workers * setup.envs_per_worker,
                   None, f"failed: {str(exc).splitlines()[0]}",
                   {"logs": pipeline.logs() if pipeline else ""})
    finally:
        group.stop()
        if pipeline is not None:
            pipeline.close()


def stepbus_row(setup: Setup, start: Edge, end: Edge, other: float) -> Row:
    """The figures of one window: steps/s, and the CPU each process and role used for them;
    `other`: the CPU processes outside the pipeline used meanwhile (% of one core)."""
    c0, c1 = _counts(start.t, start.rows), _counts(end.t, end.rows)
    rates = {role: (c1[role][1] - c0[role][1]) / max(c1[role][0] - c0[role][0], 1e-9)
             for role in c0.keys() & c1.keys()}
    window = end.t - start.t
    cpu = {k: round(100 * (e - s) / window) for k in start.cpu
           if (s := start.cpu[k]) is not None and (e := end.cpu[k]) is not None}
    # of which libzmq's I/O threads (the rest is the Python thread)
    zmq_io = {k: round(100 * (end.zmq[k] - start.zmq[k]) / window) for k in cpu}
    # The assembler's count; the learner's if the assembler's row was missing both times.
    rate = rates.get("assembler") or rates.get("trainer") or 0.0
    busiest = sorted(cpu.items(), key=lambda kv: -kv[1])[:2]
    broker = _row(end.rows, "broker") or {}
    return Row("", "stepbus", setup.label(), setup.workers * setup.envs_per_worker,
               rate or None,
               f"other load {other:.0f}%; cpu " + ", ".join(
                   f"{k.split(':')[0]} {v}%" for k, v in busiest),
               {"other_load_percent": round(other),
                "learner_steps_per_s": round(rates.get("trainer", 0.0)),
                "broker_steps_per_s": broker.get("steps_per_s"), "cpu_percent": cpu,
                "cpu_us_per_step": cpu_us_per_step(cpu, rate), "zmq_io_thread_percent": zmq_io,
                "outstanding": broker.get("outstanding_steps"),
                "credit_window": broker.get("credit_window")})


def cpu_us_per_step(cpu: dict[str, int], rate: float) -> dict[str, float | None]:
    """CPU per step of each role, all its processes together (`cpu`: % of one core by
    role:name): how far each role is from saturating its core(s), even on a busy machine."""
    by_role: dict[str, float] = {}
    for key, percent in cpu.items():
        role = key.split(":")[0]
        by_role[role] = by_role.get(role, 0) + percent
    return {role: round(1e4 * percent / rate, 1) if rate else None
            for role, percent in by_role.items()}


# ----------------------------------------------------------------------------- profiles

PROFILED = ("broker", "worker", "assembler", "trainer")  # one of each role (trainer: learner)


def profile(args: argparse.Namespace, label: str, rows: list[dict]) -> Callable[[], None]:
    """Start py-spy on one process of each role for the window; returns what ends it and
    writes DIR/<label>-<role>.txt (collapsed stacks) and DIR/<label>.summary.txt."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    args.profile.mkdir(parents=True, exist_ok=True)
    name = "".join(c if c.isalnum() or c in "-." else "_" for c in label)
    group, outputs = launch.Group(), {}
    for role in PROFILED:
        row = _row(rows, role)
        if row is None:
            continue
        outputs[role] = args.profile / f"{name}-{role}.txt"
        # --idle: waiting in poll shows as such; --nonblocking: never pause the process.
        group.start([spy, "record", "--pid", str(row["pid"]), "--duration",
                     str(max(1, round(args.seconds))), "--rate", "100", "--idle",
                     "--nonblocking", "--format", "raw", "-o", str(outputs[role])],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def window_closed() -> None:
        deadline = time.monotonic() + 10
        for proc in group.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.05, deadline - time.monotonic()))
        group.stop()
        text = "\n\n".join(summarise(role, path) for role, path in outputs.items())
        (args.profile / f"{name}.summary.txt").write_text(text + "\n")
        print(text, file=sys.stderr, flush=True)

    return window_closed


# Leaf frames of a thread that waits: poll loops, and pyzmq's zero-copy garbage collector
# thread blocked in its recv.
IDLE_LEAVES = ("Poller.poll ", "select ", "Condition.wait ", "sleep ", "Event.wait ",
               "GarbageCollectorThread.run ")


def summarise(role: str, path: Path, top: int = 12) -> str:
    """Top functions of one py-spy raw profile (main thread and any other Python thread), as
    shares of the samples where the process was not waiting (a leaf in IDLE_LEAVES): spent in
    the function itself (self) and with it on the stack (inclusive)."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = idle = 0
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            stack, _, count_text = line.rpartition(" ")
            if not count_text.isdigit():
                continue
            count = int(count_text)
            frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
            total += count
            if not frames or frames[-1].startswith(IDLE_LEAVES):
                idle += count
                continue
            own[frames[-1]] = own.get(frames[-1], 0) + count
            for frame in set(frames):
                inclusive[frame] = inclusive.get(frame, 0) + count
    busy = total - idle
    if not busy:
        return f"{role}: no busy samples of {total} ({path})"
    lines = [f"{role}: {total} samples ({path.name}), {100 * idle / total:.0f}% waiting; "
             f"shares of the {busy} busy ones:", "  self%  incl%  function"]
    for frame, count in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {100 * count / busy:5.1f}  {100 * inclusive[frame] / busy:5.1f}  "
                     f"{frame}")
    lines.append("  inclusive, top (below the entry point):")
    entry = ("<module> ", "_run_code ", "_run_module_as_main ", "main ")
    for frame, count in sorted(inclusive.items(), key=lambda kv: -kv[1])[:top + 5]:
        if not frame.startswith(entry):
            lines.append(f"  {'':5}  {100 * count / busy:5.1f}  {frame}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- peers

def run_peer(spec: dict[str, Any], timeout_s: float = PEER_TIMEOUT_S) -> dict[str, Any]:
    """One peer measurement in a child process (its own process group, killed on the way
    out), so the peers' subprocesses can never outlive the benchmark."""
    group = launch.Group()
    try:
        proc = group.start([sys.executable, __file__, "--peer", json.dumps(spec)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.popen.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {timeout_s:.0f}s"}
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if proc.poll() != 0 or not lines:
            return {"error": (err.strip().splitlines() or [f"exit {proc.poll()}"])[-1]}
        return json.loads(lines[-1])
    finally:
        group.stop(grace_s=2.0)


def _timed(step: Callable[[], None], per_call: int, seconds: float,
           warmup: float) -> tuple[float, float]:
    """Steps/s of `step` (each call takes `per_call` env steps) over `seconds` after warm-up,
    and the CPU other processes than this one's group used meanwhile (% of one core)."""
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        step()
    meter = LoadMeter({os.getpgrp()})  # run_peer started us as a group leader
    calls, t0 = 0, time.perf_counter()
    while (t := time.perf_counter()) - t0 < seconds:
        step()
        calls += 1
    return calls * per_call / (t - t0), meter.other_percent()


def _timed_actions(send: Callable[[np.ndarray], object], actions: np.ndarray, per_call: int,
                   seconds: float, warmup: float) -> tuple[float, float]:
    """`_timed` for a vectorizer that takes one row of `actions` per call, cycling through
    them (random actions drawn once, so drawing them is not what is measured)."""
    counter = itertools.count()

    def step() -> None:
        send(actions[next(counter) % len(actions)])

    return _timed(step, per_call, seconds, warmup)


def _action_n(space: Any) -> int:
    """How many actions a Discrete space has (any space object: the peers' own types)."""
    return int(space.n)


def peer_main(spec: dict[str, Any]) -> int:
    """Child side of `run_peer`: measure, print one JSON line."""
    from stepbus.workers.envs import make_env

    kind, env_id, n = spec["kind"], spec["env"], spec.get("num_envs", 1)
    method, seconds, warmup = spec.get("method", "fork"), spec["seconds"], spec["warmup"]
    rng = np.random.default_rng(0)
    make = functools.partial(make_env, env_id)
    if kind == "loop":
        rate, other = _loop_peer(make, rng, seconds, warmup)
    elif kind == "async":
        rate, other = _async_peer(make, n, method, spec.get("shared", True), rng, seconds,
                                  warmup)
    elif kind == "sb3":
        rate, other = _sb3_peer(make, n, method, rng, seconds, warmup)
    elif kind == "puffer":
        rate, other = _puffer_peer(make, n, spec["workers"], rng, seconds, warmup)
    elif kind == "envpool":
        rate, other = _envpool_peer(env_id, n, rng, seconds, warmup)
    else:
        raise SystemExit(f"unknown peer kind {kind}")
    print(json.dumps({"steps_per_s": rate, "other_load_percent": round(other)}), flush=True)
    return 0


def _loop_peer(make: Callable[[], Any], rng: np.random.Generator, seconds: float,
               warmup: float) -> tuple[float, float]:
    """One process stepping one env in a loop: the per-core ceiling."""
    env = make()
    actions = rng.integers(_action_n(env.action_space), size=4096).tolist()
    env.reset(seed=0)
    counter = itertools.count()

    def step() -> None:
        _, _, terminated, truncated, _ = env.step(actions[next(counter) & 4095])
        if terminated or truncated:
            env.reset()

    return _timed(step, 1, seconds, warmup)


def _async_peer(make: Callable[[], Any], n: int, method: str, shared: bool,
                rng: np.random.Generator, seconds: float, warmup: float) -> tuple[float, float]:
    import gymnasium as gym

    vec = gym.vector.AsyncVectorEnv([make] * n, shared_memory=shared, context=method)
    try:
        vec.reset(seed=0)
        return _timed_actions(
            vec.step, rng.integers(_action_n(vec.single_action_space), size=(256, n)), n,
            seconds, warmup)
    finally:
        vec.close(terminate=True)


def _sb3_peer(make: Callable[[], Any], n: int, method: str, rng: np.random.Generator,
              seconds: float, warmup: float) -> tuple[float, float]:
    from stable_baselines3.common.vec_env import SubprocVecEnv

    vec = SubprocVecEnv([make] * n, start_method=method)
    try:
        vec.reset()
        return _timed_actions(
            vec.step, rng.integers(_action_n(vec.action_space), size=(256, n)), n, seconds,
            warmup)
    finally:
        vec.close()


def _puffer_peer(make: Callable[[], Any], n: int, workers: int, rng: np.random.Generator,
                 seconds: float, warmup: float) -> tuple[float, float]:
    import pufferlib.emulation
    import pufferlib.vector

    def creator(**kwargs: Any) -> Any:
        return pufferlib.emulation.GymnasiumPufferEnv(env_creator=make)

    batch = n // 2 or 1
    vec = pufferlib.vector.make(creator, num_envs=n, num_workers=workers, batch_size=batch,
                                backend=pufferlib.vector.Multiprocessing)
    try:
        vec.async_reset(0)

        def recv_send(actions: np.ndarray) -> None:
            vec.recv()
            vec.send(actions)

        return _timed_actions(recv_send, rng.integers(2, size=(256, batch)), batch,
                              seconds, warmup)
    finally:
        vec.close()


def _envpool_peer(env_id: str, n: int, rng: np.random.Generator, seconds: float,
                  warmup: float) -> tuple[float, float]:
    import envpool

    batch = n // 2 or 1
    pool = envpool.make_gymnasium(env_id, num_envs=n, batch_size=batch)
    try:
        pool.async_reset()
        return _timed_actions(
            lambda actions: pool.send(actions, pool.recv()[-1]["env_id"]),
            rng.integers(2, size=(256, batch)), batch, seconds, warmup)
    finally:
        pool.close()


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def measure_peers(scenario: str, plan: Plan, args: argparse.Namespace) -> list[Row]:
    env = ENVS[scenario]
    timing = {"seconds": args.seconds, "warmup": args.warmup}
    rows = []

    def peer(system: str, config: str, envs: int, spec: dict[str, Any]) -> None:
        result = run_peer({"env": env, **timing, **spec})
        note = (f"failed: {result['error']}" if "error" in result
                else f"other load {result['other_load_percent']}%")
        rows.append(Row(scenario, system, config, envs, result.get("steps_per_s"), note))
        progress(rows[-1])

    peer("1 process, 1 env", "loop", 1, {"kind": "loop"})
    shared = True  # gymnasium's default; what the frames scenario is asked to compare with
    for n in plan.async_envs:
        for method in plan.methods:
            peer("AsyncVectorEnv", f"{n} envs, {method}{', shm' if shared else ''}", n,
                 {"kind": "async", "num_envs": n, "method": method, "shared": shared})
    if plan.others and plan.async_envs:
        if _importable("stable_baselines3"):
            for n in plan.async_envs:
                peer("SB3 SubprocVecEnv", f"{n} envs, forkserver", n,
                     {"kind": "sb3", "num_envs": n, "method": "forkserver"})
        if _importable("pufferlib"):
            for n in sorted({*plan.async_envs, *plan.puffer_envs}):
                peer("PufferLib mp", f"{n} envs, 2 workers", n,
                     {"kind": "puffer", "num_envs": max(n, 2), "workers": 2})
        if _importable("envpool") and env == "CartPole-v1":
            for n in plan.async_envs:
                peer("EnvPool", f"{n} envs, async", n, {"kind": "envpool", "num_envs": n})
    for row in rows:
        row.scenario = scenario
    return rows


# ----------------------------------------------------------------------------- report

def progress(row: Row) -> None:
    """One line per figure as it comes (stderr), so a long run shows it is alive."""
    costs = row.detail.get("cpu_us_per_step")
    print(f"# {row.scenario} {row.system} {row.config}: {row.steps_per_s or 0:.0f} steps/s "
          f"{row.note}" + (f"; cpu us/step {costs}" if costs else ""), file=sys.stderr,
          flush=True)


def machine() -> dict[str, Any]:
    import gymnasium
    import zmq

    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown")
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cores": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "numpy": np.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
            "gymnasium": gymnasium.__version__, "load": os.getloadavg()}


def heavy_ideal(cores: int) -> float:
    from stepbus.workers.bench_envs import HEAVY_TAILED_MEAN_MS

    return cores / (HEAVY_TAILED_MEAN_MS / 1000)


def table(rows: list[Row], cores: int) -> str:
    lines = [f"{'scenario':<9} {'system':<18} {'config':<24} {'envs':>5} {'steps/s':>10} "
             f"{'vs AVE best':>11}  note"]
    for scenario in dict.fromkeys(r.scenario for r in rows):
        group = [r for r in rows if r.scenario == scenario]
        best = max((r.steps_per_s or 0 for r in group if r.system == "AsyncVectorEnv"),
                   default=0)
        stepbus_one = next((r.steps_per_s for r in group
                            if r.system == "stepbus" and r.config == "1w x 8"), None)
        for r in group:
            rate = f"{r.steps_per_s:10.0f}" if r.steps_per_s else f"{'-':>10}"
            ratio = (f"{r.steps_per_s / best:10.2f}x" if best and r.steps_per_s
                     else f"{'-':>11}")
            note = r.note
            if scenario == "heavy" and r.steps_per_s:
                note = f"{100 * r.steps_per_s / heavy_ideal(cores):.0f}% of ideal; {note}"
            if scenario == "scaling" and r.system == "stepbus" and r.steps_per_s and stepbus_one:
                note = f"{r.steps_per_s / stepbus_one:.2f}x 1 worker; {note}"
            lines.append(f"{r.scenario:<9} {r.system:<18} {r.config:<24} {r.envs:>5} {rate} "
                         f"{ratio}  {note}".rstrip())
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("all", *SCENARIOS), default="all")
    parser.add_argument("--seconds", type=float, default=None,
                        help="measured window per figure (default 5; --quick 3; --smoke 1)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of stepping before each window (default 2; --smoke 0.25)")
    parser.add_argument("--quick", action="store_true", help="smaller grids")
    parser.add_argument("--smoke", action="store_true",
                        help="about 10 s in all: CartPole, tiny counts, to prove it still works")
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc",
                        help="stepbus endpoints: ipc:// in a temp dir, or TCP loopback")
    parser.add_argument("--batch-steps", type=int, default=2048,
                        help="the consuming learner's batch (sets the broker's credit window)")
    parser.add_argument("--json", type=Path, default=None, help="also write every row here")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="py-spy (if installed) records the broker, one worker, the "
                             "assembler and the learner over each stepbus window: raw stacks "
                             "and a summary of the top functions go to DIR")
    parser.add_argument("--grid", type=parse_grid, default=None, metavar=f"{GRID_ITEM},...",
                        help="stepbus setups instead of the scenario's grid: workers x envs per "
                             "worker, optionally /N splits, :hidden widths, +shm for every batch "
                             "through shared memory, +socket for none (e.g. "
                             "1x8,1x8/2,2x128,1x32:1,1x64:1+shm)")
    parser.add_argument("--flags", type=parse_flags, action="append", default=[],
                        metavar="ROLE=FLAGS", help="extra flags for one stepbus role, to try a "
                        "setting (repeatable): --flags 'broker=--batch-wait-ms 0.2'")
    parser.add_argument("--no-peers", action="store_true",
                        help="stepbus only (with --profile, or to try one setup)")
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.peer:
        return peer_main(json.loads(args.peer))
    mode = settle_args(args)
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so every `finally` kills what it started

    info = machine()
    chosen = plans(mode)
    scenarios = [s for s in chosen if args.scenario in ("all", s)]
    if not scenarios:
        parser.error(f"--scenario {args.scenario} is not part of the {mode} run")
    rows = measure_scenarios(scenarios, chosen, args)
    load_after = os.getloadavg()
    print_report(info, rows, args, load_after)
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "command": sys.argv,
                                         "rows": [dataclasses.asdict(r) for r in rows]},
                                        indent=1))
    failed = [r for r in rows if r.system == "stepbus" and not r.steps_per_s]
    for r in failed:
        print(f"\n{r.scenario} {r.config} failed:\n{r.detail.get('logs', '')}", file=sys.stderr)
    return 1 if failed else 0


def settle_args(args: argparse.Namespace) -> str:
    """Gathers `--flags` by role and fills in the window and warm-up the mode defaults to;
    returns the mode: full, quick or smoke."""
    flags: dict[str, list[str]] = {}
    for role, more in args.flags:
        flags.setdefault(role, []).extend(more)
    args.flags = flags
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    args.seconds = args.seconds or {"smoke": 1.0, "quick": 3.0, "full": 5.0}[mode]
    args.warmup = args.warmup if args.warmup is not None else (0.25 if args.smoke else 2.0)
    return mode


def measure_scenarios(scenarios: list[str], chosen: dict[str, Plan],
                      args: argparse.Namespace) -> list[Row]:
    """Each scenario's peers (unless --no-peers), then each of its stepbus setups."""
    rows: list[Row] = []
    for scenario in scenarios:
        plan = chosen[scenario]
        if args.grid:
            plan = dataclasses.replace(plan, stepbus=args.grid)
        if not args.no_peers:
            rows.extend(measure_peers(scenario, plan, args))
        for setup in plan.stepbus:
            profiler = (functools.partial(profile, args, f"{scenario}-{setup.label()}")
                        if args.profile else None)
            row = measure_stepbus(ENVS[scenario], setup, args, profiler)
            row.scenario = scenario
            rows.append(row)
            progress(row)
    return rows


def print_report(info: dict[str, Any], rows: list[Row], args: argparse.Namespace,
                 load_after: tuple[float, float, float]) -> None:
    """The machine, the command and the stepbus settings the table was measured with, then
    the table."""
    cores = int(info["cores"] or 1)
    print(f"date: {info['date']}")
    print(f"machine: {cores} cores, {info['cpu']}, Python {info['python']}, numpy "
          f"{info['numpy']}, pyzmq {info['pyzmq']} / libzmq {info['libzmq']}, gymnasium "
          f"{info['gymnasium']}")
    print("load average (1, 5, 15 min): before {:.2f} {:.2f} {:.2f}, after {:.2f} {:.2f} {:.2f}"
          .format(*info["load"], *load_after))
    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print(f"stepbus: {args.transport} endpoints, learner {CONSUME}, batch {args.batch_steps}"
          + "".join(f", {role} {shlex.join(more)}" for role, more in args.flags.items()) + "; "
          f"window {args.seconds:g} s after {args.warmup:g} s warm-up; "
          f"heavy ideal {heavy_ideal(cores):.0f} steps/s")
    print(table(rows, cores))


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
