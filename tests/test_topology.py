"""The topology: every role's sockets as declared, ports a role lacks refused before a send,
and endpoints checked where they are parsed."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import zmq

from stepbus.bus import node, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.controller import Config as ControllerConfig
from stepbus.bus.controller import Controller
from stepbus.bus.topology import PortName, Role


def test_a_misspelt_port_is_refused_by_the_outbox() -> None:
    outbox = node.Outbox()
    controller = Controller(ControllerConfig(), outbox, logging.getLogger("test.topology"))
    controller.send(PortName.PUB, p.Shutdown(reason="test"))  # a port it has
    with pytest.raises(ValueError, match="the controller has no port 'pubs'"):
        controller.send(topology.OutletPort("pubs"), p.Shutdown(reason="test"))
    with pytest.raises(ValueError, match="no port 'steps'"):  # another role's port
        controller.send(PortName.STEPS, p.Shutdown(reason="test"))
    assert [s.port for s in outbox.take_sent()] == [PortName.PUB]


def test_every_role_opens_its_declared_sockets_with_their_options() -> None:
    ctx = zmq.Context()
    try:
        for role, specs in topology.ROLES.items():
            # endpoints of each role's own: a closed socket's inproc name is freed later
            endpoints = {name: f"inproc://{role.value}-{name}" for name in wiring.ENDPOINTS}
            sockets = topology.open_role(ctx, role, endpoints, name="w0")
            for spec in specs:
                sock = sockets[spec.port]
                assert sock.type == spec.kind, (role, spec.port)
                assert sock.getsockopt(zmq.SNDHWM) == spec.sndhwm, (role, spec.port)
                assert sock.getsockopt(zmq.RCVHWM) == spec.rcvhwm, (role, spec.port)
                assert sock.getsockopt(zmq.IMMEDIATE) == spec.immediate, (role, spec.port)
                assert sock.getsockopt(zmq.TCP_MAXRT) == (
                    topology.DEAD_PEER_MS if spec.dead_peer_timeout else 0), (role, spec.port)
                assert sock.getsockopt(zmq.CONNECT_TIMEOUT) == topology.CONNECT_TIMEOUT_MS
                if spec.bind:
                    assert sock.getsockopt(zmq.MAXMSGSIZE) == spec.max_message_bytes
                if spec.named:
                    assert sock.getsockopt(zmq.IDENTITY) == b"w0"
            for sock in sockets.values():
                sock.close(0)
    finally:
        ctx.destroy(0)


@pytest.mark.parametrize("text, why", [
    ("127.0.0.1:7340", "needs a scheme, e.g. tcp://127.0.0.1:7340"),
    ("notanendpoint", "expected tcp://HOST:PORT"),
    ("128", "expected tcp://HOST:PORT"),
    ("udp://127.0.0.1:1", "unknown scheme 'udp'"),
    ("tcp://127.0.0.1", "expected tcp://HOST:PORT"),
    ("tcp://127.0.0.1:65536", "the port must be 0 to 65535"),
    ("tcp://127.0.0.1:http", "the port must be"),
    ("tcp://a b:1", "not a host name"),
    ("tcp://[::1:1", "closing ]"),
    ("ipc://", "an ipc path must be 1 to 107 bytes"),
    ("ipc://" + "x" * 108, "an ipc path must be 1 to 107 bytes"),
    ("inproc://", "needs a name"),
    ("", "an endpoint is needed"),
])
def test_a_bad_endpoint_is_refused_saying_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
        topology.parse_endpoint(text)


@pytest.mark.parametrize("text", ["tcp://127.0.0.1:7340", "tcp://*:7340", "tcp://[::1]:7340",
                                  "tcp://localhost:0", "tcp://eth0;192.168.1.2:5555",
                                  "ipc:///tmp/sb/steps", "inproc://steps"])
def test_a_good_endpoint_passes(text: str) -> None:
    assert topology.parse_endpoint(text) == text


@pytest.mark.parametrize("args, env, says", [
    (["worker", "--controller", "127.0.0.1:7340"], {}, "argument --controller: "),
    (["worker", "--controller", "notanendpoint"], {}, "argument --controller: "),
    (["worker", "--steps", "128"], {}, "argument --steps: "),
    (["status", "--controller", "127.0.0.1:61340"], {}, "argument --controller: "),
    (["broker"], {"STEPBUS_STEPS": "tcp://127.0.0.1:99999"}, "(from STEPBUS_STEPS)"),
])
def test_a_bad_endpoint_is_one_line_and_exit_2(args: list[str], env: dict[str, str],
                                               says: str) -> None:
    res = subprocess.run([sys.executable, "-m", "stepbus", *args], capture_output=True,
                         text=True, timeout=30, env={**_environ(), **env})
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and says in res.stderr, res.stderr
    assert len([ln for ln in res.stderr.splitlines() if "error:" in ln]) == 1, res.stderr


def _environ() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("STEPBUS_")}


def test_every_role_sends_only_on_ports_it_declares() -> None:
    """The ports each process class sends on, as its `sockets` role says, plus its link."""
    assert topology.ports_of(Role.WORKER) == {"steps", "controller", "broadcast"}
    assert topology.ports_of(Role.CONTROLLER) == {"router", "pub"}
    topology.check_port(Role.ASSEMBLER, "trajectories:red")  # a policy's own outlet
    with pytest.raises(ValueError):
        topology.check_port(Role.LEARNER, "trajectories:red")
