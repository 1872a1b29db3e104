"""Two hosts for real: the broker's side in one Linux network namespace, a worker in another,
joined by a veth pair, CURVE on, the worker told nothing but the controller's address; and a
worker behind a router that loses packets and then cuts it off for a while."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from conftest import REPO, Cluster, wait_for

sys.path.insert(0, str(REPO / "benchmarks"))
import two_hosts as two_hosts_bench  # the namespaces, made in one place


def unavailable(why: str) -> NoReturn:
    """Skip, saying why; fail where these tests must run (STEPBUS_REQUIRE_NETNS=1, as in CI)."""
    if os.environ.get("STEPBUS_REQUIRE_NETNS") == "1":
        pytest.fail(f"STEPBUS_REQUIRE_NETNS=1, but this test {why}")
    pytest.skip(why)


@pytest.fixture
def two_hosts() -> Iterator[tuple[tuple[str, ...], tuple[str, ...], str]]:
    """(prefix running a command on host A, on host B, host A's address)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        unavailable("needs root and iproute2's `ip` to make network namespaces")
    try:
        with two_hosts_bench.two_namespaces() as hosts:
            yield hosts
    except (subprocess.CalledProcessError, OSError) as exc:
        unavailable(f"cannot make network namespaces here: {exc}")


def test_a_worker_on_another_host_needs_only_the_controller_address_and_keys(
        cluster: Cluster, two_hosts: tuple[tuple[str, ...], tuple[str, ...], str]):
    on_a, on_b, address = two_hosts
    # Host A binds its real address (not loopback): that is refused without keys.
    cluster.endpoints = two_hosts_bench.tcp_endpoints(address)
    # Started first, so its start-up overlaps the key commands: it is given no keys either way.
    refused = cluster.start("controller", env={}, prefix=on_a)
    keys, worker_keys = cluster.dir / "keys", cluster.dir / "worker-keys"
    assert cluster.cli("keys", "--dir", str(keys)).returncode == 0
    assert cluster.cli("keys", "--dir", str(worker_keys), "--client-of", str(keys)).returncode == 0
    on_host_a = {"STEPBUS_KEYS": str(keys)}
    assert refused.wait(30) != 0 and "refusing to bind" in refused.output()
    procs = {role: cluster.start(role, env=on_host_a, prefix=on_a)
             for role in ("controller", "broker", "assembler", "trainer")}
    # Host B runs the README's worker-host Procfile, knowing only the controller's address
    # and its own client keys.
    env = {k: v for k, v in cluster.env().items() if not k.startswith("STEPBUS_")}
    env |= {"STEPBUS_CONTROLLER": cluster.endpoints["controller"],
            "STEPBUS_KEYS": str(worker_keys),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])}
    shutil.copy(REPO / "Procfile.workers", cluster.dir)
    with open(cluster.dir / "b.out", "wb") as out:
        honcho = subprocess.Popen([*on_b, shutil.which("honcho", path=env["PATH"]) or "honcho",
                                   "start", "-f", "Procfile.workers", "-c", "worker=2"],
                                  cwd=cluster.dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    # The default trainer target: CartPole solved ends the whole run, every process exit 0.
    codes = {name: proc.wait(120) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    assert honcho.wait(30) == 0
    host_b = (cluster.dir / "b.out").read_text()
    assert host_b.count(f"steps endpoint {cluster.endpoints['steps']} (the controller says)") == 2
    assert f"broadcasts from {cluster.endpoints['broadcast']}" in host_b
    assert host_b.count("stopped (rc=0)") == 2, host_b[-3000:]
    assert "solved: mean return" in procs["trainer"].output(), procs["trainer"].output()[-2000:]


@pytest.fixture
def routed_hosts() -> Iterator[two_hosts_bench.RoutedHosts]:
    """Hosts A and B with a router between them (each a network namespace)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("iptables") is None:
        unavailable("needs root, iproute2's `ip` and `iptables` to route between namespaces")
    stack = contextlib.ExitStack()
    try:
        hosts = stack.enter_context(two_hosts_bench.routed_namespaces())
    except (subprocess.CalledProcessError, OSError) as exc:
        unavailable(f"cannot make network namespaces here: {exc}")
    with stack:
        yield hosts


PARTITION_S = 3.0


def test_a_worker_cut_off_behind_a_lossy_router_is_declared_lost_and_rejoins(
        cluster: Cluster, routed_hosts: two_hosts_bench.RoutedHosts):
    hosts = routed_hosts
    cluster.endpoints = two_hosts_bench.tcp_endpoints(hosts.address)
    keys, worker_keys = cluster.dir / "keys", cluster.dir / "worker-keys"
    assert cluster.cli("keys", "--dir", str(keys)).returncode == 0
    assert cluster.cli("keys", "--dir", str(worker_keys), "--client-of", str(keys)).returncode == 0
    on_a = {"STEPBUS_KEYS": str(keys)}
    for role in ("controller", "broker", "assembler"):
        cluster.start(role, env=on_a, prefix=hosts.on_a)
    cluster.start("trainer", "--algo", "stepbus.trainer.consume:ConsumeOnly", "--target-return",
                  "0", env=on_a, prefix=hosts.on_a)
    cluster.start("worker", "--name", "w0", "--envs-per-worker", "4",
                  env={"STEPBUS_KEYS": str(worker_keys)}, prefix=hosts.on_b)
    broker = next(p for p in cluster.procs if p.name == "broker0")

    def steps() -> int:
        figure = two_hosts_bench.assembler_steps(hosts.on_a, cluster.env(on_a))
        return 0 if figure is None else figure[1]

    wait_for(steps, 60, "steps across the router")
    hosts.iptables("-A", "FORWARD", "-m", "statistic", "--mode", "random", "--probability", "0.02",
           "-j", "DROP")
    before = steps()
    wait_for(lambda: steps() > before, 10, "steps through 2% loss")

    seen = len(broker.output())  # what the broker logs from the partition on
    hosts.iptables("-I", "FORWARD", "1", "-j", "DROP")  # the partition: nothing crosses
    cut = time.monotonic()
    wait_for(lambda: re.search(r"worker w0 (silent|unreachable) for", broker.output()[seen:]),
             5, "the worker declared lost")
    lost_after = time.monotonic() - cut
    time.sleep(max(0.0, cut + PARTITION_S - time.monotonic()))  # the fault is its length
    hosts.iptables("-D", "FORWARD", "1")
    healed = time.monotonic()
    wait_for(lambda: "worker w0 joined" in broker.output()[seen:], 10, "the worker's rejoin")
    rejoined_after = time.monotonic() - healed
    at_heal = steps()
    wait_for(lambda: steps() > at_heal, 10, "steps after the rejoin")
    print(f"\nworker declared lost {lost_after:.2f} s into the partition; rejoined "
          f"{rejoined_after:.2f} s after healing")
    assert lost_after < 1.5 + 1.0, "the liveness bound, and the log polled"
    assert rejoined_after < 5.0
