"""Far workers across a bad network: a clean link, then loss with delay, then a partition of
their host and its healing, in one invocation (as root).

    python benchmarks/bad_network.py [--workers 4] [--envs-per-worker 256] [--splits 1]
        [--seconds 10] [--loss-pct 2] [--delay-ms 50] [--jitter-ms 10] [--partition-s 30]
        [--without-user-timeout]

Three network namespaces (two_hosts.routed_namespaces): host A runs the controller, broker,
assembler and a learner that learns nothing but keeps benchmarks/chaos_ledger.py's ledger of the
steps it took in; host B runs the workers (the ledger's CartPole, whose observations carry a
stream id and step index), which know only the controller's address and client keys (CURVE
on); the router between them forwards what crosses, and iptables there impairs it:

1. clean: nothing.
2. lossy: --loss-pct of the packets dropped at random in each direction (statistic match), and
   every packet held --delay-ms +- --jitter-ms in each direction by benchmarks/delay_queue.py
   (NFQUEUE; the stand-in for netem, which this kernel lacks: see its docstring).
3. partition: every packet dropped for --partition-s, loss and delay staying; then healing.

Reported: the workers' env steps/s clean and lossy (the assembler's count, read with
`stepbus status`), their ratio and the measured round trip; from the partition's start until
the broker declares each worker lost (its log); from healing until each worker's hello reaches
the broker again and until steps are counted again; then, after `stepbus shutdown`, the
ledger in the learner's last checkpoint: steps learned at all and exactly once, twice (must be
0) and never (the holes, with their times against the partition), and the broker's,
assembler's and learner's counters. One JSON line at the end. --without-user-timeout runs
every process without the TCP_USER_TIMEOUT and connect timeout bus/topology.py sets (a
sitecustomize puts both to 0), to compare the rejoin. Everything it makes (namespaces, veths,
rules, processes) is removed in a `finally`, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import chaos
import chaos_ledger
import two_hosts

from stepbus.bus import launch
from stepbus.workers import worker

REPO = Path(__file__).resolve().parents[1]
LEDGER_ENV = "benchmarks.chaos_ledger:make"
LEDGER_ALGO = "benchmarks.chaos_ledger:LedgerConsume"
QUEUE = 0
NO_LAG_BOUND = 1 << 40  # policy versions: the learner drops nothing as stale
WATCH_EVERY_S = 0.2
LOST = re.compile(r"worker (\S+) (?:silent|unreachable) for")
JOINED = re.compile(r"worker (\S+) (?:joined|restarted)")
NO_USER_TIMEOUT = ("from stepbus.bus import topology\n"
                   "topology.DEAD_PEER_MS = 0\ntopology.CONNECT_TIMEOUT_MS = 0\n")


@dataclass
class StatusWatch:
    """`stepbus status --json --watch` on host A, read by a thread: (when each figure was
    sent, monotonic; the assembler's steps) and the latest rows."""

    child: launch.Child[Any]
    steps: list[tuple[float, int]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def read(self) -> None:
        stream = self.child.popen.stdout
        assert stream is not None
        for line in stream:
            arrived = time.monotonic()
            try:
                rows = json.loads(line).get("processes")
            except ValueError:
                continue
            if not rows:
                continue
            self.rows = rows
            row = next((r for r in rows if r["role"] == "assembler"), None)
            if row is not None and isinstance(row.get("steps"), int):
                self.steps.append((arrived - float(row.get("last_heartbeat_s", 0.0)),
                                   row["steps"]))

    def rate(self, start: float, end: float) -> float:
        """Steps per second between the first figure sent after `start` and the last before
        `end`."""
        inside = [s for s in self.steps if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            raise RuntimeError("no assembler figures in the window: is the pipeline up?")
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def figure(self, role: str, key: str) -> Any:
        """`key` of the first process of `role` that has it (the trainer slot and its learner
        both say "trainer")."""
        return next((r[key] for r in self.rows if r["role"] == role and key in r), None)


@dataclass
class LogWatch:
    """New lines of a process's log, each with when it was first seen (polled)."""

    path: Path
    offset: int = 0
    lines: list[tuple[float, str]] = field(default_factory=list)

    def poll(self) -> None:
        if not self.path.exists():
            return
        self.offset, new = chaos.new_lines(self.path, self.offset)
        now = time.monotonic()
        self.lines += [(now, line.decode(errors="replace")) for line in new]

    def first(self, pattern: re.Pattern[str], after: float) -> dict[str, float]:
        """The first time after `after` each name matched `pattern` (its group 1)."""
        out: dict[str, float] = {}
        for t, line in self.lines:
            m = pattern.search(line)
            if m and t >= after and m[1] not in out:
                out[m[1]] = t
        return out


@dataclass
class Bench:
    """One invocation: the hosts, the processes, what is watched."""

    args: argparse.Namespace
    hosts: two_hosts.RoutedHosts
    work: Path
    group: launch.Group
    host_env: dict[str, str] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)
    watch: StatusWatch | None = None
    broker_log: LogWatch | None = None
    marks: dict[str, float] = field(default_factory=dict)  # monotonic
    wall: dict[str, float] = field(default_factory=dict)  # time.time() of the same marks

    def mark(self, name: str) -> float:
        self.marks[name], self.wall[name] = time.monotonic(), time.time()
        return self.marks[name]

    @property
    def names(self) -> list[str]:
        return [f"b{i}" for i in range(self.args.workers)]

    @property
    def bus_names(self) -> list[str]:
        """The workers as the broker knows them: each split is one (`--splits`)."""
        if self.args.splits == 1:
            return self.names
        return [worker.split_name(n, k) for n in self.names for k in range(self.args.splits)]


def environments(bench: Bench) -> None:
    """Host A's and the workers' environments: CURVE keys, the ledger's env and algorithm, and
    without the user timeout, the sitecustomize that removes it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPBUS_", "HONCHO_"))}
    paths = [str(REPO)]
    if bench.args.without_user_timeout:
        (bench.work / "site").mkdir()
        (bench.work / "site" / "sitecustomize.py").write_text(NO_USER_TIMEOUT)
        paths.insert(0, str(bench.work / "site"))
    env |= {"STEPBUS_LOG_LEVEL": "WARNING", "STEPBUS_RUNS_DIR": str(bench.work / "runs"),
            "PYTHONPATH": os.pathsep.join(paths), "STEPBUS_ENV": LEDGER_ENV,
            chaos_ledger.DIR_ENV: str(bench.work / "ledger")}
    (bench.work / "ledger").mkdir()
    bench.host_env, bench.worker_env = two_hosts.host_and_worker_envs(
        bench.work, env, two_hosts.endpoint_vars(bench.hosts.address), keys=True)


def start_pipeline(bench: Bench) -> None:
    """Host A's four processes (the broker logging at INFO, for its joins), the workers on
    B, the status watch on A; returns once steps are counted."""
    on_a, group = bench.hosts.on_a, bench.group
    for role in two_hosts.ROLES_A:
        # Nothing is dropped as stale: a hole in the ledger is then the network's doing.
        flags = ("--algo", LEDGER_ALGO, "--target-return", "0", "--batch-steps", "2048",
                 "--checkpoint-interval-s", "1", "--max-policy-lag", str(NO_LAG_BOUND)
                 ) if role == "trainer" else ()
        env = bench.host_env | ({"STEPBUS_LOG_LEVEL": "INFO"} if role == "broker" else {})
        two_hosts.start_role(group, bench.work, on_a, role, *flags, env=env)
    bench.broker_log = LogWatch(bench.work / "broker-1.log")
    for i, name in enumerate(bench.names):
        two_hosts.start_role(group, bench.work, bench.hosts.on_b, "worker", "--name", name,
                             "--worker-index", str(i), "--envs-per-worker",
                             str(bench.args.envs_per_worker), "--splits",
                             str(bench.args.splits), env=bench.worker_env)
    two_hosts.wait_until_stepping("bad network", group.procs, bench.work, on_a,
                                  bench.host_env)
    child = group.start([*on_a, *launch.role_command("status"), "--json", "--watch",
                         str(WATCH_EVERY_S), "--timeout", "2"], name="status",
                        env=bench.host_env, stdout=subprocess.PIPE, text=True)
    bench.watch = StatusWatch(child)
    threading.Thread(target=bench.watch.read, daemon=True).start()


def round_trip_ms(bench: Bench, count: int = 7) -> float:
    """The median time of a TCP connect from host B to the controller's port: one round
    trip (a lost SYN shows as a second or more, hence the median)."""
    port = int(two_hosts.tcp_endpoints(bench.hosts.address)["controller"].rsplit(":", 1)[1])
    code = (f"import socket, time\nfor _ in range({count}):\n    t = time.monotonic()\n"
            "    try:\n"
            f"        socket.create_connection(({bench.hosts.address!r}, {port}), 5).close()\n"
            "    except OSError:\n        t = -1e9\n"
            "    print(time.monotonic() - t)\n")
    out = subprocess.run([*bench.hosts.on_b, sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return round(1000 * statistics.median(float(x) for x in out.split()), 1)


def measure_window(bench: Bench, name: str, seconds: float | None = None) -> float:
    """Steps per second over `seconds` (--seconds) after --warmup."""
    time.sleep(bench.args.warmup)
    start = bench.mark(f"{name}_start")
    time.sleep(bench.args.seconds if seconds is None else seconds)
    assert bench.watch is not None
    return bench.watch.rate(start, bench.mark(f"{name}_end"))


def impair(bench: Bench) -> None:
    """Loss and delay in the router, both directions: the delay queue first (a packet it
    never gets a verdict for would be lost), then the rules."""
    args = bench.args
    bench.group.start([*bench.hosts.on_router, sys.executable,
                       str(REPO / "benchmarks" / "delay_queue.py"), "--queue", str(QUEUE),
                       "--delay-ms", str(args.delay_ms), "--jitter-ms", str(args.jitter_ms)],
                      name="delay_queue", log=bench.work / "delay_queue.log")
    deadline = time.monotonic() + 10
    while "delay_queue: queue" not in (bench.work / "delay_queue.log").read_text():
        if time.monotonic() > deadline or bench.group.procs[-1].poll() is not None:
            raise RuntimeError("the delay queue did not start: "
                               + (bench.work / "delay_queue.log").read_text())
        time.sleep(0.05)
    if args.loss_pct > 0:
        bench.hosts.iptables("-A", "FORWARD", "-m", "statistic", "--mode", "random",
                 "--probability", f"{args.loss_pct / 100:.6f}", "-j", "DROP")
    if args.delay_ms > 0:
        bench.hosts.iptables("-A", "FORWARD", "-j", "NFQUEUE", "--queue-num", str(QUEUE))


def connections(on: tuple[str, ...]) -> dict[str, int]:
    """A host's established TCP connections by remote port."""
    out = subprocess.run([*on, "ss", "-Htn", "state", "established"], capture_output=True,
                         text=True, timeout=10).stdout
    return dict(collections.Counter(line.split()[-1].rpartition(":")[2]
                                    for line in out.splitlines() if line.strip()))


def partition(bench: Bench) -> dict[str, Any]:
    """Every packet dropped for --partition-s, then healing; when each worker was declared
    lost, joined again and was stepping again, in seconds from the partition's start and
    from healing."""
    assert bench.broker_log is not None and bench.watch is not None
    log, watch = bench.broker_log, bench.watch
    log.poll()  # what came before is stamped before the cut
    cut = bench.mark("partition")
    bench.hosts.iptables("-I", "FORWARD", "1", "-j", "DROP")
    established: dict[str, int] | None = None
    while time.monotonic() < cut + bench.args.partition_s:
        log.poll()
        if established is None and time.monotonic() > cut + bench.args.partition_s - 1:
            established = connections(bench.hosts.on_b)  # the links still up, or not
        time.sleep(0.05)
    bench.hosts.iptables("-D", "FORWARD", "1")
    heal = bench.mark("heal")
    steps_at_heal = max((s for _, s in watch.steps), default=0)
    deadline = heal + bench.args.rejoin_timeout_s
    stepping: float | None = None
    while time.monotonic() < deadline:
        log.poll()
        stepping = next((t for t, s in watch.steps if t > heal and s > steps_at_heal), None)
        if stepping is not None and len(log.first(JOINED, heal)) == len(bench.bus_names):
            break
        time.sleep(0.05)
    lost, joined = log.first(LOST, cut), log.first(JOINED, heal)
    return {"declared_lost_s": {n: round(lost[n] - cut, 2) if n in lost else None
                                for n in bench.bus_names},
            "rejoined_s": {n: round(joined[n] - heal, 2) if n in joined else None
                           for n in bench.bus_names},
            "stepping_again_s": None if stepping is None else round(stepping - heal, 2),
            "established_at_partition_end": established}


def counters(watch: StatusWatch) -> dict[str, Any]:
    """What the broker, the assembler and the learner counted of losses and repeats."""
    wanted = {"broker": ("workers_lost", "stale_dropped", "stale_hellos"),
              "assembler": ("gaps", "steps_lost", "closed_truncated", "resent"),
              "trainer": ("duplicates", "stale_dropped")}
    return {f"{role}_{key}": watch.figure(role, key) for role, keys in wanted.items()
            for key in keys}


def stop_delay_queue(bench: Bench) -> dict[str, Any]:
    """The delay queue's figures (packets, most held at once, mean lateness) and its CPU
    seconds, taken as it stops."""
    child = next(c for c in bench.group.procs if c.name == "delay_queue")
    fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    child.signal(signal.SIGTERM)
    child.wait(10)
    lines = [line for line in child.output().splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else {}) | {"cpu_s": round(cpu_s, 1)}


def shut_down(bench: Bench) -> None:
    """`stepbus shutdown` on host A, and A's processes' exits awaited (the learner's last
    checkpoint holds the ledger)."""
    subprocess.run([*bench.hosts.on_a, *launch.role_command("shutdown")], env=bench.host_env,
                   capture_output=True, timeout=60)
    deadline = time.monotonic() + 30
    for child in bench.group.procs[:len(two_hosts.ROLES_A)]:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(max(0.1, deadline - time.monotonic()))


def ledger(bench: Bench) -> dict[str, Any]:
    """The learner's ledger against what the envs stepped: once, twice, never (each hole
    with its time in seconds from the partition's start), the tail."""
    final = chaos.final_ledger(bench.work)
    acc = chaos_ledger.account(final.rows, final.produced)
    cut_ms = 1000 * bench.wall["partition"]
    holes = [{"steps": h.steps, "after_s": round((h.after_ms - cut_ms) / 1000, 2),
              "before_s": round((h.before_ms - cut_ms) / 1000, 2)} for h in acc.holes]
    return {"streams": acc.streams, "produced": acc.produced, "learned_steps": acc.once,
            "learned_once": acc.once - acc.twice, "learned_twice": acc.twice,
            "never_learned": acc.never, "holes": holes[:20],
            "hole_count": len(holes), "tail": acc.tail}


def run(bench: Bench) -> dict[str, Any]:
    args = bench.args
    environments(bench)
    start_pipeline(bench)
    result: dict[str, Any] = {"clean_steps_per_s": round(measure_window(bench, "clean"))}
    print(f"clean link: {result['clean_steps_per_s']} steps/s", flush=True)
    impair(bench)
    result["round_trip_ms"] = round_trip_ms(bench)
    result["lossy_steps_per_s"] = round(measure_window(bench, "lossy"))
    result["ratio"] = round(result["lossy_steps_per_s"] / max(1, result["clean_steps_per_s"]),
                            3)
    print(f"{args.loss_pct:g}% loss, {args.delay_ms:g} +- {args.jitter_ms:g} ms each way "
          f"(round trip {result['round_trip_ms']} ms): {result['lossy_steps_per_s']} steps/s, "
          f"{result['ratio']:.2f}x clean", flush=True)
    result |= partition(bench)
    print(f"partition {args.partition_s:g} s: declared lost after "
          f"{result['declared_lost_s']} s; host B's established connections by port 1 s "
          f"before healing {result['established_at_partition_end']}; after healing, hellos "
          f"in {result['rejoined_s']} s, stepping again {result['stepping_again_s']} s",
          flush=True)
    result["healed_steps_per_s"] = round(measure_window(bench, "healed", args.seconds / 2))
    assert bench.watch is not None
    result |= counters(bench.watch)
    shut_down(bench)
    result["delay_queue"] = stop_delay_queue(bench)
    result |= ledger(bench)
    print(f"ledger: {result['learned_once']} steps learned once, {result['learned_twice']} "
          f"twice, {result['never_learned']} never ({result['hole_count']} holes: "
          f"{result['holes'][:4]}), tail {result['tail']}", flush=True)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--envs-per-worker", type=int, default=256)
    parser.add_argument("--splits", type=int, default=1,
                        help="the far workers' --splits: batches each keeps in flight")
    parser.add_argument("--seconds", type=float, default=10.0, help="each measured window")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before a window")
    parser.add_argument("--loss-pct", type=float, default=2.0, help="each direction")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="each direction")
    parser.add_argument("--jitter-ms", type=float, default=10.0, help="uniform, +-")
    parser.add_argument("--partition-s", type=float, default=30.0)
    parser.add_argument("--rejoin-timeout-s", type=float, default=90.0)
    parser.add_argument("--without-user-timeout", action="store_true",
                        help="processes without bus/topology.py's TCP_USER_TIMEOUT and "
                             "connect timeout, to compare")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iptables"):
        print("needs root, iproute2's `ip` and `iptables`", file=sys.stderr)
        return 2
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}; machine: "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, Python "
          f"{platform.python_version()}; command: python benchmarks/bad_network.py "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="sb-badnet-"))
    group = launch.Group(work)
    try:
        with two_hosts.routed_namespaces() as hosts:
            bench = Bench(args, hosts, work, group)
            try:
                result = run(bench)
            finally:
                group.stop()  # before the namespaces go
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result |= {"workers": args.workers, "envs_per_worker": args.envs_per_worker,
               "splits": args.splits,
               "loss_pct": args.loss_pct, "delay_ms": args.delay_ms,
               "jitter_ms": args.jitter_ms, "partition_s": args.partition_s,
               "user_timeout": not args.without_user_timeout,
               "load_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
