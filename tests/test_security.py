"""CURVE on every socket: with keys, only authorized clients that know the server's key get a
message through, in either direction; without keys, nothing binds beyond loopback unless told."""

from __future__ import annotations

import contextlib
import socket as pysocket
from pathlib import Path

import pytest
import zmq
from conftest import Cluster, wait_for
from controller_probe import shutdown, status_rows

from stepbus.bus import topology, wiring

JUNK = [b"not a stepbus message"]  # counted as rejected by whichever process it reaches
INBOUND = {"controller": zmq.DEALER, "steps": zmq.DEALER, "policy": zmq.DEALER,
           "experience": zmq.PUSH, "receipts": zmq.PUSH}  # bound sockets that receive


def keyed_socket(kind: int, endpoint: str, *, server: bytes | None = None,
                 client: tuple[bytes, bytes] | None = None) -> zmq.Socket:
    sock = topology.stand_in(kind)
    if server is not None and client is not None:
        sock.curve_serverkey = server
        sock.curve_publickey, sock.curve_secretkey = client
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def rejected(cluster: Cluster, keys: Path) -> dict[str, int]:
    return {r["role"]: r.get("rejected", 0) for r in status_rows(cluster, keys=str(keys))}


@pytest.fixture
def keyed(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Path:
    keys = cluster.dir / "keys"
    assert cluster.cli("keys", "--dir", str(keys)).returncode == 0
    monkeypatch.setenv("STEPBUS_KEYS", str(keys))  # every process the cluster starts, the CLI
    return keys


def test_keys_are_made_once_and_a_client_only_directory_is_authorized(cluster: Cluster):
    main, other = cluster.dir / "main", cluster.dir / "other"
    made = cluster.cli("keys", "--dir", str(main))
    assert made.returncode == 0, made.stderr
    assert {p.name for p in main.iterdir()} == {"server.key", "server.key_secret", "client.key",
                                                "client.key_secret", "authorized"}
    assert (main / "server.key_secret").stat().st_mode & 0o077 == 0, "secrets are private"
    again = cluster.cli("keys", "--dir", str(main))
    assert again.returncode != 0 and "not overwriting" in again.stderr
    assert cluster.cli("keys", "--dir", str(other), "--client-of", str(main)).returncode == 0
    assert {p.name for p in other.iterdir()} == {"server.key", "client.key", "client.key_secret"}
    assert (main / "authorized" / "other.key").read_bytes() == (other / "client.key").read_bytes()


def test_binding_beyond_loopback_needs_keys_or_insecure(cluster: Cluster):
    port = wiring.free_tcp_ports(1)[0]
    refused = cluster.start("controller", "--controller", f"tcp://0.0.0.0:{port}")
    assert refused.wait(30) != 0
    assert f"refusing to bind tcp://0.0.0.0:{port} without encryption" in refused.output()
    assert "stepbus keys" in refused.output() and "--insecure" in refused.output()
    allowed = cluster.start("controller", "--controller", f"tcp://0.0.0.0:{port}", "--insecure")
    res = wait_for(lambda: (r := cluster.cli("status", "--controller", f"tcp://127.0.0.1:{port}",
                                             "--timeout", "2")).returncode == 0 and r,
                   20, "the insecure controller to answer")
    assert "controller" in res.stdout
    allowed.signal(15)
    assert allowed.wait(10) == 0


def test_with_keys_only_authorized_clients_that_know_the_server_get_through(
        cluster: Cluster, keyed: Path):
    procs = cluster.start_all(trainer_args=("--target-return", "0"))
    wait_for(lambda: (r := {row["role"]: row for row in status_rows(cluster, keys=str(keyed))}
                      ).get("trainer")
             and r["trainer"].get("env_steps", 0) > 0 and r, 60,
             "the keyed pipeline to step and learn")
    server_public, _ = zmq.auth.load_certificate(keyed / "server.key")
    client_public, client_secret = zmq.auth.load_certificate(keyed / "client.key_secret")
    assert client_secret is not None, "the client's key file holds its secret key"
    allowed = (client_public, client_secret)
    strangers: dict[str, dict] = {
        "no keys": {},
        "an unlisted key": {"server": server_public, "client": zmq.curve_keypair()},
        "the wrong server key": {"server": zmq.curve_keypair()[0], "client": allowed},
    }

    # Inbound: junk from a stranger would be counted as rejected wherever it landed.
    socks = []
    for kind_of_stranger, creds in strangers.items():
        for name, kind in INBOUND.items():
            sock = keyed_socket(kind, cluster.endpoints[name], **creds)
            for _ in range(3):
                with contextlib.suppress(zmq.Again):  # queued until the handshake fails
                    sock.send_multipart(JUNK, zmq.NOBLOCK)
            socks.append((kind_of_stranger, name, sock))
    # Outbound: a stranger's SUB and PULL get no broadcast and no trajectory.
    listeners = [(who, keyed_socket(kind, cluster.endpoints[name], **creds))
                 for who, creds in strangers.items()
                 for name, kind in (("broadcast", zmq.SUB), ("trajectories", zmq.PULL))]
    assert cluster.cli("reset", "--option", "x=1").returncode in (0, 1)  # a barrier broadcast
    poller = zmq.Poller()
    for _, sock in listeners:
        poller.register(sock, zmq.POLLIN)
    heard = dict(poller.poll(2000))
    assert not [who for who, sock in listeners if sock in heard], "a stranger received"
    assert all(n == 0 for n in rejected(cluster, keyed).values()), rejected(cluster, keyed)

    # The same junk from the authorized client is delivered (and refused as junk): the check
    # above could fail.
    for name, kind in INBOUND.items():
        sock = keyed_socket(kind, cluster.endpoints[name], server=server_public, client=allowed)
        sock.send_multipart(JUNK)
        socks.append(("allowed", name, sock))
    wait_for(lambda: all(rejected(cluster, keyed).get(role, 0) > 0
                         for role in ("controller", "broker", "assembler")), 20,
             "the authorized client's junk to reach every bound socket")
    assert shutdown(cluster, keys=str(keyed))
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    for *_, sock in socks:
        sock.close()
    for _, sock in listeners:
        sock.close()


def test_a_host_authorized_while_the_run_goes_on_is_let_in(cluster: Cluster, keyed: Path):
    controller = cluster.start("controller")
    wait_for(lambda: status_rows(cluster, keys=str(keyed)), 20, "the keyed controller")
    other = cluster.dir / "other"
    assert cluster.cli("keys", "--dir", str(other), "--client-of", str(keyed)).returncode == 0
    authorized = keyed / "authorized" / "other.key"
    authorized.rename(cluster.dir / "other.key")  # not (yet) authorized
    refused = cluster.cli("status", "--keys", str(other), "--timeout", "2")
    assert refused.returncode == 2 and "unreachable" in refused.stderr
    assert "refused a CURVE client" in controller.output()
    (cluster.dir / "other.key").rename(authorized)
    res = cluster.cli("status", "--keys", str(other), "--timeout", "3")
    assert res.returncode == 0, res.stderr
    assert pysocket.gethostname() in res.stdout
