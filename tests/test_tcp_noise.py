"""Bytes that are not ZeroMQ on every bound TCP port: refused by libzmq before they can become
messages, with no process dying and no memory kept, and no connection that never completes a
ZeroMQ handshake taken for a learner. Plus the socket options that make it so (ZAP domain,
MAXMSGSIZE, loopback defaults), each shown to matter against a plain socket."""

from __future__ import annotations

import ast
import contextlib
import math
import os
import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import zmq
from conftest import EVERY_UPDATE, Cluster, Proc, wait_for
from controller_probe import status_rows

from stepbus.bus import protocol as p
from stepbus.bus import topology, wiring

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------
# ZMTP by hand (rfc.zeromq.org/spec/23): enough to greet, say READY and declare a frame.

MECHANISMS = [b"NULL", b"PLAIN", b"CURVE", b"GSSAPI", b"\xff" * 20]
PEER_TYPE = {b"ROUTER": b"DEALER", b"PUB": b"SUB", b"PULL": b"PUSH", b"PUSH": b"PULL"}
LONG_FRAME = 0x02


def greeting(major: int = 3, minor: int = 0, mechanism: bytes = b"NULL") -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + bytes([major, minor]) + mechanism[:20].ljust(20, b"\0") \
        + b"\0" + bytes(31)


def ready(socket_type: bytes) -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return b"\x04" + bytes([len(body)]) + body


def zmtp1_message(body: bytes) -> bytes:
    """What libzmq takes for a message from a ZMTP 1.0 peer: an empty identity, then a frame."""
    return b"\x01\x00" + bytes([len(body) + 1, 0]) + body


def tcp_port(endpoint: str) -> int:
    port = urlsplit(endpoint).port
    assert port is not None, f"{endpoint} names no port"
    return port


def connect(port: int, timeout: float = 2.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def handshake(port: int) -> socket.socket:
    """A raw TCP socket that has completed a ZMTP 3.0 NULL handshake: a ZeroMQ peer by hand.
    Waits for the server's READY first, so the next bytes are read as frames, not commands."""
    sock = connect(port)
    sock.sendall(greeting())
    data = b""
    while len(data) < 66 or len(data) < 66 + data[65]:  # greeting, then READY's short frame
        chunk = sock.recv(4096)
        assert chunk, "the server closed a well-formed ZMTP 3.0 handshake"
        data += chunk
    prop = data[66:66 + data[65]].partition(b"Socket-Type")[2]
    server_type = prop[4:4 + int.from_bytes(prop[:4], "big")]
    sock.sendall(ready(PEER_TYPE[server_type]))
    return sock


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """True once the other side closes (EOF or reset) within `within` seconds."""
    sock.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def send_quietly(sock: socket.socket, data: bytes) -> None:
    """Send what the server takes before it hangs up; its hanging up is the expected outcome."""
    with contextlib.suppress(OSError):
        sock.sendall(data)


@contextlib.contextmanager
def bound(kind: int, *, ours: bool) -> Iterator[tuple[zmq.Socket, int]]:
    """A socket bound on a free loopback port: through topology.socket, or a plain one."""
    ctx: zmq.Context = zmq.Context.instance()
    if ours:
        sock = topology.socket(ctx, kind, bind="tcp://127.0.0.1:0")
    else:
        sock = topology.stand_in(kind, "tcp://127.0.0.1:0", bind=True, ctx=ctx)
    try:
        yield sock, int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    finally:
        sock.close(0)


# ---------------------------------------------------------------------------------------------
# 1. The options, and what each one is for.


@pytest.mark.parametrize("ours", [False, True], ids=["plain socket", "topology.socket"])
def test_zmtp1_bytes_become_a_message_only_without_the_zap_domain(ours: bool) -> None:
    """The control shows raw bytes *can* become a message: libzmq still speaks ZMTP 1.0, which
    has no greeting, so any TCP client can frame a message. A ZAP domain turns that off."""
    with bound(zmq.PULL, ours=ours) as (sock, port):
        raw = connect(port)
        send_quietly(raw, zmtp1_message(b"hello"))
        got = sock.recv_multipart() if sock.poll(1000) else None
        assert got == (None if ours else [b"hello"])
        assert closed_by_peer(raw, 1.0) is ours
        raw.close()


@pytest.mark.parametrize("ours", [False, True], ids=["plain socket", "topology.socket"])
def test_a_frame_declared_over_maxmsgsize_closes_the_connection_at_once(ours: bool) -> None:
    """Without MAXMSGSIZE libzmq allocates what the header declares and waits for the bytes."""
    with bound(zmq.PULL, ours=ours) as (_, port):
        raw = handshake(port)
        send_quietly(raw, bytes([LONG_FRAME]) + (topology.MAX_MESSAGE_BYTES + 1).to_bytes(8, "big")
                     + b"x" * 1000)
        assert closed_by_peer(raw, 1.0 if ours else 0.3) is ours
        raw.close()


def test_a_zeromq_peer_by_hand_does_get_a_message_through() -> None:
    """The raw handshake above is right: after it a frame is a message (so the refusals in
    these tests are libzmq's doing, not a broken client)."""
    with bound(zmq.PULL, ours=True) as (sock, port):
        raw = handshake(port)
        raw.sendall(b"\x00\x05hello")
        assert sock.poll(2000) and sock.recv_multipart() == [b"hello"]
        raw.close()


BIND_KINDS = [zmq.ROUTER, zmq.PUB, zmq.PULL, zmq.PUSH]


@pytest.mark.parametrize("kind", BIND_KINDS, ids=lambda k: zmq.SocketType(k).name)
def test_every_bound_socket_sets_a_maximum_message_size_and_a_zap_domain(kind: int) -> None:
    with bound(kind, ours=True) as (sock, _):
        assert sock.getsockopt(zmq.MAXMSGSIZE) == topology.MAX_MESSAGE_BYTES
        assert sock.getsockopt(zmq.ZAP_DOMAIN) == wiring.ZAP_DOMAIN


def test_every_default_endpoint_is_on_loopback() -> None:
    for spec in wiring.ENDPOINTS.values():
        url = urlsplit(spec.default)
        assert url.scheme == "tcp" and url.hostname == "127.0.0.1", spec


def test_sockets_are_made_and_bound_only_in_the_topology_module() -> None:
    """So every socket has the options its role declares: no module makes or binds a ZeroMQ
    socket by itself (the tests' stand-in peers come from `topology.stand_in` too). A Python
    socket (`socket.socket()`, for raw bytes or a free port) is no ZeroMQ socket."""
    offenders = []
    for folder in ("bus", "workers", "processor", "trainer", "stepbus", "benchmarks", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            if path == REPO / "bus" / "topology.py":
                continue
            for call in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                    continue
                receiver = ast.unparse(call.func.value)
                # Python's sockets (bound to an (address, port) tuple), the topology's own
                # functions, and the tests' Cluster.socket, which is topology.stand_in
                python = receiver in ("socket", "pysocket") or any(
                    isinstance(arg, ast.Tuple) for arg in call.args)
                ours = receiver in ("topology", "cluster", "self.cluster")
                if ((call.func.attr in ("bind", "bind_to_random_port") and not python)
                        or (call.func.attr == "socket" and not (python or ours))):
                    offenders.append(f"{path.relative_to(REPO)}:{call.lineno}")
    assert not offenders, f"sockets made or bound outside bus/topology.py: {offenders}"


# ---------------------------------------------------------------------------------------------
# 2. Real processes on TCP, and noise on every port they listen on.


def use_tcp(cluster: Cluster) -> None:
    """Rewire a cluster (before it starts anything) from ipc:// to free loopback TCP ports."""
    ports = wiring.free_tcp_ports(len(cluster.endpoints))
    cluster.endpoints = {name: f"tcp://127.0.0.1:{port}"
                         for name, port in zip(cluster.endpoints, ports, strict=True)}


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                address, port = cols[1].split(":")
                if table == "tcp":
                    address = ".".join(str(b) for b in reversed(bytes.fromhex(address)))
                found.add((address, int(port, 16)))
    return found


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def noise(rnd: random.Random) -> tuple[bytes, bool]:
    """One connection's worth of bytes that are not a ZeroMQ peer's, and whether libzmq must
    hang up at once (the rest wait for more bytes of a greeting or of a declared frame)."""
    what = rnd.randrange(6)
    if what == 0:  # anything: not 0xff first, so ZMTP 1.0, which the ZAP domain refuses
        data = rnd.randbytes(rnd.randint(1, 32768))
        return data, data[0] != 0xFF
    if what == 1:  # ZMTP 1.0 framing: messages, were it not for the ZAP domain
        return b"".join(zmtp1_message(rnd.randbytes(rnd.randint(0, 250)))
                        for _ in range(rnd.randint(1, 100))), True
    if what == 2:  # a ZMTP 1.0 long frame declaring a huge length
        return b"\xff" + rnd.randint(1 << 28, (1 << 64) - 1).to_bytes(8, "big") + b"\0" \
            + rnd.randbytes(rnd.randint(0, 16384)), True
    if what == 3:  # a greeting of any version and mechanism, then anything
        return greeting(rnd.choice([0, 1, 2, 3, 3, 4, 255]), rnd.randrange(256),
                        rnd.choice(MECHANISMS))[:rnd.randint(10, 64)] \
            + rnd.randbytes(rnd.randint(0, 16384)), False
    if what == 4:  # greeting, READY, then a frame declared too large
        return greeting() + ready(rnd.choice(list(PEER_TYPE.values()))) + bytes([LONG_FRAME]) \
            + rnd.randint(topology.MAX_MESSAGE_BYTES + 1, (1 << 64) - 1).to_bytes(8, "big") \
            + rnd.randbytes(rnd.randint(0, 16384)), True
    # greeting, READY, then a big frame declared within the limit and never finished
    return greeting() + ready(rnd.choice(list(PEER_TYPE.values()))) + bytes([LONG_FRAME]) \
        + rnd.randint(1 << 20, topology.MAX_MESSAGE_BYTES).to_bytes(8, "big") \
        + rnd.randbytes(rnd.randint(0, 32768)), False


@dataclass
class Blast:
    sent: Counter[int] = field(default_factory=Counter)  # bytes per port
    sampled: int = 0  # connections watched until the server hung up
    hung_up: int = 0


def blast(ports: list[int], connections: int, rnd: random.Random) -> Blast:
    """`connections` connections spread over the ports, each sending noise and closing, while
    20 others hold half a greeting open; every 10th connection that libzmq must refuse at once
    is watched until it does, which shows the bytes were read, not lost in a socket buffer."""
    out = Blast()
    held = [connect(ports[i % len(ports)]) for i in range(20)]
    for sock in held:
        send_quietly(sock, greeting()[:rnd.randint(1, 40)])
    for i in range(connections):
        port = ports[i % len(ports)]
        data, refused_at_once = noise(rnd)
        with connect(port) as sock:
            send_quietly(sock, data)
            out.sent[port] += len(data)
            if refused_at_once and i % 10 == 0:
                out.sampled += 1
                out.hung_up += closed_by_peer(sock, 2.0)
    for sock in held:
        sock.close()
    return out


def rows_by_role(cluster: Cluster) -> dict[str, dict]:
    rows = status_rows(cluster, timeout=5)
    assert rows, "the controller did not answer a status request within 5 s"
    return {row["role"]: row for row in rows}


def rejected_figures(rows: dict[str, dict]) -> dict[str, dict]:
    return {role: {k: v for k, v in row.items() if k.startswith("rejected")}
            for role, row in rows.items()}


BINDERS = ("controller", "broker", "assembler", "evaluator")
ONLY_WHEN_RELAYING = {"vector"}  # bound by a broker --external alone: a test of its own
NOISE_CONNECTIONS = 4000
# RSS may grow by this much over a burst. Keeping the bytes would grow each process by the
# 5-15 MB it received (asserted above 2x this: the evaluator, with one port, gets the least),
# keeping each connection's 8 KiB input buffer by 3 MiB or more (400 connections or more
# each); measured growth is under 150 KiB: heartbeats, logging and malloc's rounding over a
# few seconds.
RSS_GROWTH_KIB = 2048


def test_noise_on_every_bound_tcp_port_leaves_processes_serving_and_memory_flat(
        cluster: Cluster) -> None:
    use_tcp(cluster)
    procs: dict[str, Proc] = {role: cluster.start(role) for role in BINDERS}
    wait_for(lambda: set(BINDERS[1:]) <= set(rows_by_role(cluster)), 30,
             "every binder registered with the controller (each binds before it registers)")
    ports = bound_ports(cluster, procs)
    all_ports = every_port(ports)
    before = rejected_figures(rows_by_role(cluster))
    assert before == {role: {"rejected": 0} for role in ("controller", *BINDERS[1:])}

    rnd = random.Random(0)
    for port in all_ports:  # MAXMSGSIZE on the live processes' sockets
        raw = handshake(port)
        send_quietly(raw, bytes([LONG_FRAME]) + (1 << 62).to_bytes(8, "big"))
        assert closed_by_peer(raw, 2.0), f"port {port} kept a frame declared as 4 EiB"
        raw.close()
    noise_is_refused_and_memory_stays_flat(cluster, procs, ports, rnd, before)
    one_undecodable_message_is_counted_by_each_process(cluster, procs)
    a_persistent_offender_is_counted_and_logged_once_a_second(cluster, procs)
    learning_goes_on_through_raw_connections(cluster, procs["assembler"], all_ports)


def test_noise_on_the_vector_relays_ports_leaves_it_serving_a_vector_env(
        cluster: Cluster) -> None:
    """`stepbus broker --external` (what `stepbus.vector` starts) binds the vector endpoint
    besides the workers' one: noise on both is refused the same way, and then a vector env
    client connects through it and steps."""
    from stepbus import vector

    use_tcp(cluster)
    procs = {"broker": cluster.start("broker", "--external")}
    controller = cluster.start("controller")
    wait_for(lambda: "broker" in rows_by_role(cluster), 30, "the relay registered")
    found = listening(procs["broker"].pid)
    wanted = {tcp_port(cluster.endpoints[name]) for name in ("steps", "vector")}
    assert {port for _, port in found} == wanted, found
    ports = {"broker": sorted(wanted)}
    before = rejected_figures(rows_by_role(cluster))
    assert before["broker"] == {"rejected": 0}
    for port in wanted:
        raw = handshake(port)
        send_quietly(raw, bytes([LONG_FRAME]) + (1 << 62).to_bytes(8, "big"))
        assert closed_by_peer(raw, 2.0), f"port {port} kept a frame declared as 4 EiB"
        raw.close()
    noise_is_refused_and_memory_stays_flat(cluster, procs, ports, random.Random(1), before)
    raw = handshake(tcp_port(cluster.endpoints["vector"]))  # the control: one is counted
    raw.sendall(b"\x00\x01\xc1")
    raw.close()
    wait_for(lambda: rows_by_role(cluster)["broker"].get("rejected") == 1, 10,
             "the relay counting one undecodable message")
    cluster.start("worker", "--name", "w0", "--envs-per-worker", "2")
    envs = vector.connect(cluster.endpoints["controller"], 2)
    try:
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 4)
        envs.step(np.ones(2, np.int64))
    finally:
        envs.close()
    assert procs["broker"].popen.poll() is None and controller.popen.poll() is None


def every_port(ports: dict[str, list[int]]) -> list[int]:
    return sorted(port for role_ports in ports.values() for port in role_ports)


def bound_ports(cluster: Cluster, procs: dict[str, Proc]) -> dict[str, list[int]]:
    """The TCP ports each process listens on: configured endpoints alone, on loopback alone,
    and together every configured endpoint."""
    configured = {(urlsplit(url).hostname, tcp_port(url))
                  for name, url in cluster.endpoints.items()
                  if name not in ONLY_WHEN_RELAYING}
    ports: dict[str, list[int]] = {}
    for role, proc in procs.items():
        found = listening(proc.pid)
        assert found and found <= configured, f"{role} listens on {found - configured}"
        assert {address for address, _ in found} == {"127.0.0.1"}
        ports[role] = sorted(port for _, port in found)
    all_ports = every_port(ports)
    assert all_ports == sorted(port for _, port in configured), \
        "every configured endpoint is bound by one of the binders"
    return ports


def noise_is_refused_and_memory_stays_flat(cluster: Cluster, procs: dict[str, Proc],
                                           ports: dict[str, list[int]], rnd: random.Random,
                                           before: dict[str, dict]) -> None:
    """A burst of NOISE_CONNECTIONS over every port (`ports`, by role), after a warm-up one:
    libzmq hangs up on what it must, no process dies, the rejected counts stay `before` and
    no process's RSS grows by RSS_GROWTH_KIB."""
    all_ports = every_port(ports)
    blast(all_ports, 300, rnd)  # warm-up: first use of libzmq's and malloc's buffers
    time.sleep(0.5)
    rss_before = {role: rss_kib(proc.pid) for role, proc in procs.items()}
    started = time.monotonic()
    burst = blast(all_ports, NOISE_CONNECTIONS, rnd)
    burst_s = time.monotonic() - started
    time.sleep(0.5)
    rss_after = {role: rss_kib(proc.pid) for role, proc in procs.items()}
    received = {role: sum(burst.sent[port] for port in ports[role]) for role in procs}
    print(f"noise: {NOISE_CONNECTIONS} connections, {received} bytes in {burst_s:.1f} s, "
          f"{burst.hung_up}/{burst.sampled} sampled hung up on; RSS KiB before {rss_before}, "
          f"after {rss_after}")

    assert burst.hung_up == burst.sampled > 100, "libzmq read and refused the noise"
    assert {role: proc.popen.poll() for role, proc in procs.items()} == dict.fromkeys(procs)
    time.sleep(2 * 0.5 + 0.2)  # two heartbeats: the figures below are from after the noise
    rows = rows_by_role(cluster)
    assert rejected_figures(rows) == before, "noise became messages the decoder refused"
    assert rows["broker"]["workers"] == 0 and rows.get("assembler", {}).get("steps", 0) == 0
    for role in procs:
        assert received[role] > 2 * RSS_GROWTH_KIB * 1024, "buffering the noise would show"
        growth = rss_after[role] - rss_before[role]
        assert growth < RSS_GROWTH_KIB, f"{role} grew by {growth} KiB on {received[role]} bytes"


def one_undecodable_message_is_counted_by_each_process(cluster: Cluster,
                                                       procs: dict[str, Proc]) -> None:
    """The control: a ZeroMQ peer by hand sending one undecodable message to each process is
    counted at once, so unchanged counts after the noise mean no message got through."""
    for endpoint in ("controller", "steps", "experience", "evaluation"):
        raw = handshake(tcp_port(cluster.endpoints[endpoint]))
        raw.sendall(b"\x00\x01\xc1")
        raw.close()
    rows = wait_for(lambda: (r := rows_by_role(cluster)) and all(
        r[role].get("rejected") == 1 for role in ("controller", *BINDERS[1:])) and r, 10,
        "one refusal counted by each process")
    for role in ("controller", "broker"):
        assert rows[role]["rejected_bad_msgpack"] == 1, rows[role]
    logs = "\n".join(proc.output() for proc in procs.values())
    assert logs.count("dropped message from") == len(procs) and "Traceback" not in logs
    assert "dropped message from 127.0.0.1 on tcp://127.0.0.1:" in procs["assembler"].output()


def a_persistent_offender_is_counted_and_logged_once_a_second(cluster: Cluster,
                                                              procs: dict[str, Proc]) -> None:
    """A persistent offender: counted by reason and by its name, logged once per second."""
    noisy = topology.stand_in(zmq.DEALER)
    noisy.setsockopt(zmq.IDENTITY, b"noisy")
    noisy.connect(cluster.endpoints["steps"])
    started = time.monotonic()
    for i in range(300):
        unknown_kind = bytes([0x94, p.PROTOCOL_VERSION, 0x63, 0x80, 0x90])  # [V, 99, {}, []]
        noisy.send_multipart([b"\xc1"] if i % 2 else [unknown_kind])
    noisy.close(linger=2000)
    broker = wait_for(lambda: (row := rows_by_role(cluster)["broker"])["rejected"] == 301 and row,
                      10, "the broker counting all 300")
    elapsed = time.monotonic() - started
    assert broker["rejected_bad_msgpack"] == 151 and broker["rejected_unknown_kind"] == 150
    assert broker["rejected_from"].startswith("noisy:300, ")
    lines = procs["broker"].output().count("dropped message from noisy")
    assert 1 <= lines <= 1 + math.ceil(elapsed), f"{lines} lines in {elapsed:.1f} s"


# ---------------------------------------------------------------------------------------------
# 3. A learning pipeline under a flood of raw TCP connections: none of them is a learner.

RAW_CONNECTIONS_PER_PORT = 2000


def raw_connection(port: int, seed: int) -> bool:
    """Open, write nothing, random bytes or a broken-off greeting, close (half of them with a
    reset); whether the connection was made. None of it can complete a ZeroMQ handshake."""
    rnd = random.Random(seed)
    sock = socket.socket()  # not create_connection: no name lookup for each of thousands
    sock.settimeout(5.0)
    try:
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        return False
    with sock:
        if rnd.random() < 0.5:  # close with RST: also leaves no TIME_WAIT behind
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        what = rnd.randrange(3)
        if what == 1:
            send_quietly(sock, rnd.randbytes(rnd.randint(1, 2000)))
        elif what == 2:
            send_quietly(sock, greeting(mechanism=rnd.choice(MECHANISMS))[:rnd.randint(1, 63)]
                         + rnd.randbytes(rnd.randint(0, 200)))
    return True


def learning_goes_on_through_raw_connections(cluster: Cluster, assembler: Proc,
                                             ports: list[int]) -> None:
    """RAW_CONNECTIONS_PER_PORT raw connections, from 8 threads at once, to every port of a
    pipeline that is learning: the assembler sends nothing again and logs no learner (it
    used to resend its whole backlog for each TCP accept), and the policy version rises."""
    cluster.start("worker", "--name", "w0")
    cluster.start("learner", "--target-return", "0", *EVERY_UPDATE)  # records are updates
    wait_for(lambda: len(cluster.metrics()) >= 3, 60, "the learner's third policy update")
    # Figures from a heartbeat the assembler sent after that update, and so after the
    # learner's handshake: a learner started in milliseconds updates within one heartbeat.
    seen = rows_by_role(cluster)["assembler"]
    before = wait_for(lambda: (a := rows_by_role(cluster)["assembler"])["uptime_s"]
                      >= seen["uptime_s"] + seen["last_heartbeat_s"] + 0.2 and a, 10,
                      "the assembler's figures from after the third update", interval=0.5)
    asked = time.monotonic()
    lines_before = assembler.output().count("a learner connected")
    work = [(port, i) for i in range(RAW_CONNECTIONS_PER_PORT) for port in ports]
    with ThreadPoolExecutor(8) as pool:
        made = sum(pool.map(lambda job: raw_connection(*job), work))
    blast_s = time.monotonic() - asked
    version = cluster.metrics()[-1]["policy_version"]
    wait_for(lambda: cluster.metrics()[-1]["policy_version"] >= version + 3, 30,
             "three more policy updates after the noise")
    # Figures from a heartbeat the assembler sent after the last connection: `before` was
    # sent at most last_heartbeat_s before we asked.
    later_by_s = blast_s + before["last_heartbeat_s"] + 0.2
    after = wait_for(lambda: (a := rows_by_role(cluster)["assembler"])["uptime_s"]
                     >= before["uptime_s"] + later_by_s and a, 10,
                     "the assembler's figures from after the noise", interval=0.5)
    print(f"raw connections: {made} of {len(work)} made in {blast_s:.1f} s; assembler before "
          f"{before}, after {after}")
    assert made >= 0.99 * len(work), "the connections were made"
    # Before: the learner's own handshake and those of the ZeroMQ peers by hand above.
    assert after["learner_handshakes"] == before["learner_handshakes"] > 0
    assert after["resent"] == before["resent"] == 0 and after["backlog_resends"] == 0
    assert after["rejected"] == before["rejected"], "no raw bytes became a message"
    log = assembler.output()
    assert log.count("a learner connected") == lines_before == 0, log[-3000:]
    assert "two learners" not in log
    assert all(proc.popen.poll() is None for proc in cluster.procs), cluster.dump()
