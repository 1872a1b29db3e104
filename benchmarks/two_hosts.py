"""Steps per second across a network link vs over loopback, in one invocation (as root).

    sudo python benchmarks/two_hosts.py [--seconds 8] [--workers 2] [--envs-per-worker 32]

Two Linux network namespaces joined by a veth pair stand for two hosts: host A runs the
controller, broker, assembler and a consume-only learner, host B the workers, which know only
the controller's address and their client keys. Measured next to the same pipeline with
everything on loopback in one namespace, with and without CURVE, so the link's cost and the
encryption's cost show apart. The figure is the assembler's step count over the window, read
from the controller's status (run inside host A).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stepbus.bus import launch, wiring

CONSUME = "stepbus.trainer.consume:ConsumeOnly"
ROLES_A = ("controller", "broker", "assembler", "trainer")
STEPBUS = (sys.executable, "-m", "stepbus")


def tcp_endpoints(address: str) -> dict[str, str]:
    """Every endpoint of the run bound on `address` (ports from 7340, in wiring.ENDPOINTS'
    order), by name."""
    return {name: f"tcp://{address}:{7340 + i}" for i, name in enumerate(wiring.ENDPOINTS)}


def endpoint_vars(address: str) -> dict[str, str]:
    """The same, as the environment variables every process reads them from."""
    return {wiring.ENDPOINTS[name].env_var: endpoint
            for name, endpoint in tcp_endpoints(address).items()}


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def veth(ends: tuple[tuple[str, str, str], tuple[str, str, str]], *, offload: bool = True
         ) -> None:
    """A veth pair, each end (name, namespace, address/prefix) moved, addressed and up, with
    the namespace's loopback. Without `offload`, TCP hands it one segment at a time (no
    segmentation offload), so a rule that drops a packet drops one packet of the wire's size,
    not a 64 KiB burst."""
    (end_a, _, _), (end_b, _, _) = ends
    ip("link", "add", end_a, "type", "veth", "peer", "name", end_b)
    for end, ns, address in ends:
        ip("link", "set", end, "netns", ns)
        if not offload:
            ip("-n", ns, "link", "set", end, "gso_max_segs", "1")
        ip("-n", ns, "addr", "add", address, "dev", end)
        ip("-n", ns, "link", "set", end, "up")
        ip("-n", ns, "link", "set", "lo", "up")


def subnet_of(tag: str) -> str:
    """The first three octets of a 10.x.y.0/24 of its own for a namespace set `tag`."""
    return f"10.{int(tag[:2], 16) % 200 + 20}.{int(tag[2:4], 16)}"


@contextlib.contextmanager
def namespaces(*names: str) -> Iterator[None]:
    """Network namespaces `names`, deleted (with everything in them) on the way out."""
    try:
        for ns in names:
            ip("netns", "add", ns)
        yield
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@contextlib.contextmanager
def two_namespaces() -> Iterator[tuple[tuple[str, ...], tuple[str, ...], str]]:
    """(prefix running a command on host A, on host B, host A's address); needs root and
    iproute2. Raises OSError or CalledProcessError where namespaces cannot be made."""
    tag = uuid.uuid4().hex[:6]
    a, b = f"sb-a-{tag}", f"sb-b-{tag}"
    subnet = subnet_of(tag)
    with namespaces(a, b):
        veth(((f"sba{tag}", a, f"{subnet}.1/24"), (f"sbb{tag}", b, f"{subnet}.2/24")))
        yield ("ip", "netns", "exec", a), ("ip", "netns", "exec", b), f"{subnet}.1"


@dataclass(frozen=True)
class RoutedHosts:
    """Hosts A and B with a router between them, each a namespace: what crosses from one to
    the other is forwarded by the router, where a firewall rule can drop or queue it as a
    network would (benchmarks/bad_network.py)."""

    on_a: tuple[str, ...]  # prefix running a command on host A
    on_b: tuple[str, ...]
    on_router: tuple[str, ...]
    address: str  # host A's
    address_b: str

    def iptables(self, *rule: str) -> None:
        """A firewall rule in the router: what crosses it is dropped or queued as it says."""
        subprocess.run([*self.on_router, "iptables", "-w", *rule], check=True,
                       capture_output=True, timeout=10)


@contextlib.contextmanager
def routed_namespaces() -> Iterator[RoutedHosts]:
    """A - router - B, two veth pairs and two /25s, the router forwarding; needs root and
    iproute2. Raises OSError or CalledProcessError where namespaces cannot be made."""
    tag = uuid.uuid4().hex[:6]
    a, b, r = f"sb-a-{tag}", f"sb-b-{tag}", f"sb-r-{tag}"
    net = subnet_of(tag)
    with namespaces(a, b, r):
        veth(((f"sba{tag}", a, f"{net}.1/25"), (f"sbra{tag}", r, f"{net}.126/25")), offload=False)
        veth(((f"sbb{tag}", b, f"{net}.129/25"), (f"sbrb{tag}", r, f"{net}.254/25")), offload=False)
        ip("-n", a, "route", "add", f"{net}.128/25", "via", f"{net}.126")
        ip("-n", b, "route", "add", f"{net}.0/25", "via", f"{net}.254")
        subprocess.run(["ip", "netns", "exec", r, "sh", "-c",
                        "echo 1 > /proc/sys/net/ipv4/ip_forward"], check=True, timeout=10)
        yield RoutedHosts(("ip", "netns", "exec", a), ("ip", "netns", "exec", b),
                          ("ip", "netns", "exec", r), f"{net}.1", f"{net}.129")


def measure(label: str, args: argparse.Namespace, address: str, on_a: tuple[str, ...],
            on_b: tuple[str, ...], keys: bool) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="sb-2h-"))
    group = launch.Group(workdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPBUS_", "HONCHO_"))}
    env |= {"STEPBUS_LOG_LEVEL": "WARNING", "STEPBUS_RUNS_DIR": str(workdir / "runs")}
    try:
        host_env, worker_env = host_and_worker_envs(workdir, env, endpoint_vars(address), keys)
        for role in ROLES_A:
            flags = ("--algo", CONSUME, "--target-return", "0", "--batch-steps", "2048",
                     "--checkpoint-interval-s", "1") if role == "trainer" else ()
            start_role(group, workdir, on_a, role, *flags, env=host_env)
        for i in range(args.workers):
            start_role(group, workdir, on_b, "worker", "--name", f"b{i}", "--worker-index",
                       str(i), "--envs-per-worker", str(args.envs_per_worker), env=worker_env)
        wait_until_stepping(label, group.procs, workdir, on_a, host_env)
        time.sleep(args.warmup)
        start_t = assembler_steps(on_a, host_env)
        time.sleep(args.seconds)
        end_t = assembler_steps(on_a, host_env)
        if start_t is None or end_t is None:
            raise RuntimeError(f"{label}: the controller stopped answering")
        rate = (end_t[1] - start_t[1]) / (end_t[0] - start_t[0])
        return {"setup": label, "steps_per_s": round(rate)}
    finally:
        group.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def host_and_worker_envs(workdir: Path, env: dict[str, str], endpoints: dict[str, str],
                         keys: bool) -> tuple[dict[str, str], dict[str, str]]:
    """The environments of host A's processes (every endpoint) and of the workers (only the
    controller's address); with `keys`, CURVE keys for both made in `workdir`."""
    worker_env = env | {"STEPBUS_CONTROLLER": endpoints["STEPBUS_CONTROLLER"]}
    host_env = env | endpoints
    if keys:
        subprocess.run([*STEPBUS, "keys", "--dir", str(workdir / "k")], check=True,
                       capture_output=True, env=env)
        subprocess.run([*STEPBUS, "keys", "--dir", str(workdir / "kw"), "--client-of",
                        str(workdir / "k")], check=True, capture_output=True, env=env)
        host_env["STEPBUS_KEYS"], worker_env["STEPBUS_KEYS"] = (str(workdir / "k"),
                                                                str(workdir / "kw"))
    else:
        host_env["STEPBUS_INSECURE"] = "1"
    return host_env, worker_env


def start_role(group: launch.Group, workdir: Path, prefix: tuple[str, ...],
               role: str, *flags: str, env: dict[str, str]) -> None:
    """`role` on the host `prefix` runs commands on, its output in a log of its own."""
    name = f"{role}-{len(group.procs)}"
    group.start_role(role, *flags, name=name, log=workdir / f"{name}.log", env=env,
                     prefix=prefix)


def assembler_steps(on_a: tuple[str, ...], host_env: dict[str, str]) -> tuple[float, int] | None:
    """(when the figure was sent, monotonic; the assembler's cumulative steps), asked of the
    controller from host A; None while there is no such figure."""
    res = subprocess.run([*on_a, *STEPBUS, "status", "--json", "--timeout", "2"],
                         capture_output=True, text=True, env=host_env, timeout=10)
    if res.returncode:
        return None
    rows = json.loads(res.stdout)["processes"]
    row = next((r for r in rows if r["role"] == "assembler"), None)
    if row is None or not isinstance(row.get("steps"), int):
        return None
    return time.monotonic() - float(row.get("last_heartbeat_s", 0.0)), row["steps"]


def wait_until_stepping(label: str, procs: list[launch.Child], workdir: Path,
                        on_a: tuple[str, ...], host_env: dict[str, str]) -> None:
    """Until the assembler has counted a step; raises with the logs when a process exits or
    a minute passes first."""
    deadline = time.monotonic() + 60
    while (first := assembler_steps(on_a, host_env)) is None or first[1] == 0:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            logs = "\n".join(p.read_text()[-800:] for p in workdir.glob("*.log"))
            raise RuntimeError(f"{label}: the pipeline did not start stepping\n{logs}")
        time.sleep(0.3)  # a benchmark waiting for start-up, not a test's synchronisation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before the window")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=32)
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("needs root and iproute2's `ip` (network namespaces)", file=sys.stderr)
        return 2
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}; machine: "
          f"{os.cpu_count()} cores, Python {platform.python_version()}; command: "
          f"python benchmarks/two_hosts.py {' '.join(argv or sys.argv[1:])}")
    print(f"CartPole-v1, {args.workers} workers x {args.envs_per_worker} envs, consume-only "
          f"learner, {args.seconds:g} s window")
    rows = []
    with two_namespaces() as (on_a, on_b, address):
        for label, b, keys in (("loopback, one namespace, no keys", on_a, False),
                               ("loopback, one namespace, CURVE", on_a, True),
                               ("TCP across veth, two namespaces, CURVE", on_b, True)):
            where = "127.0.0.1" if b == on_a else address
            rows.append(measure(label, args, where, on_a, b, keys))
            print(f"{rows[-1]['setup']:<42} {rows[-1]['steps_per_s']:>8} steps/s", flush=True)
    base = rows[0]["steps_per_s"] or 1
    for row in rows[1:]:
        print(f"{row['setup']}: {row['steps_per_s'] / base:.2f}x loopback without keys")
    return 0


if __name__ == "__main__":
    sys.exit(main())
