"""Where the run's sockets are: endpoints, their environment variables, and their security
(which sockets each role has, and their options, are declared in `topology`).

Long-lived processes bind (controller, broker, assembler); processes that come and go connect
(workers, trainer, the CLI). Every endpoint has one flag and one `STEPBUS_*` variable (honcho
reads `.env`), defaulting to loopback so nothing listens on a network unless told to.

Security: with a keys directory (`stepbus keys`, `--keys` / STEPBUS_KEYS) every socket uses
CURVE: bound sockets are CURVE servers whose ZAP handler admits only client public keys in
`KEYS/authorized/`, connecting sockets are CURVE clients that know the server's public key.
Without keys, binding a TCP address other than loopback is refused unless `--insecure`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import socket as pysocket
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import zmq

from stepbus.bus.exits import SettingError

if TYPE_CHECKING:  # imported where keys are used: its asyncio and ssl cost every process 30 ms
    from zmq.auth.thread import ThreadAuthenticator


def _auth() -> ModuleType:
    """pyzmq's CURVE certificate helpers, loaded by the processes that use keys."""
    import zmq.auth

    return zmq.auth


@dataclass(frozen=True)
class EndpointSpec:
    name: str
    env_var: str
    default: str
    help: str

    def resolve(self) -> str:
        return os.environ.get(self.env_var) or self.default


ENDPOINTS: dict[str, EndpointSpec] = {
    spec.name: spec
    for spec in (
        EndpointSpec("controller", "STEPBUS_CONTROLLER", "tcp://127.0.0.1:7340",
                     "controller ROUTER: heartbeats and commands"),
        EndpointSpec("broadcast", "STEPBUS_BROADCAST", "tcp://127.0.0.1:7341",
                     "controller PUB: barrier and shutdown broadcasts"),
        EndpointSpec("steps", "STEPBUS_STEPS", "tcp://127.0.0.1:7342",
                     "broker ROUTER facing worker DEALERs"),
        EndpointSpec("policy", "STEPBUS_POLICY", "tcp://127.0.0.1:7343",
                     "broker ROUTER receiving trainer weights"),
        EndpointSpec("experience", "STEPBUS_EXPERIENCE", "tcp://127.0.0.1:7344",
                     "assembler PULL receiving experience from the broker"),
        EndpointSpec("trajectories", "STEPBUS_TRAJECTORIES", "tcp://127.0.0.1:7345",
                     "assembler PUSH sending trajectories to the trainer"),
        EndpointSpec("receipts", "STEPBUS_RECEIPTS", "tcp://127.0.0.1:7346",
                     "assembler PULL receiving the trainer's receipts for trajectories"),
        EndpointSpec("vector", "STEPBUS_VECTOR", "tcp://127.0.0.1:7347",
                     "broker ROUTER (--external) facing a vector env client's DEALER"),
        EndpointSpec("evaluation", "STEPBUS_EVALUATION", "tcp://127.0.0.1:7348",
                     "evaluator ROUTER receiving trainer weights, answering with returns"),
    )
}

ENV_VAR = "env_var"  # a Config field's metadata key: the variable its default comes from
# A Config field's metadata key: the field is an endpoint, checked where it is parsed
# (`topology.parse_endpoint`); its value says whether it may be empty (found by discovery).
ENDPOINT = "endpoint"
REQUIRED, DISCOVERABLE = "required", "discoverable"


CHECK = "check"  # a Config field's metadata key: a function raising ValueError for a bad value


def from_env(env_var: str, default: str, help: str, **metadata: Any) -> Any:
    """A Config field whose default is `env_var` when set (honcho reads `.env`, so one line
    there sets it for every process), else `default`. `--help` names the variable; a `check`
    (CHECK) refuses a bad value where it is parsed."""
    return field(default_factory=lambda: os.environ.get(env_var) or default,
                 metadata={"help": help, ENV_VAR: env_var, **metadata})


def endpoint(name: str, help: str) -> Any:
    """A Config field for endpoint `name`: its default comes from STEPBUS_* at construction."""
    spec = ENDPOINTS[name]
    return from_env(spec.env_var, spec.default, help, **{ENDPOINT: REQUIRED})


KEYS_ENV = "STEPBUS_KEYS"
INSECURE_ENV = "STEPBUS_INSECURE"
SERVER, CLIENT, AUTHORIZED = "server", "client", "authorized"  # names in a keys directory
# With a ZAP domain set libzmq refuses ZMTP 1.0 and 2.0 peers, whose framing any TCP client
# can produce without a handshake, so raw bytes never become messages. ZMTP 3.0 peers still
# pass (no ZAP handler runs): they are ZeroMQ peers, and the decoder refuses what they send.
ZAP_DOMAIN = b"stepbus"


@dataclass
class Security:
    """Every process's (and the CLI's) security flags."""

    keys: str = field(default_factory=lambda: os.environ.get(KEYS_ENV, ""), metadata={
        "help": "CURVE keys directory made by `stepbus keys` (env STEPBUS_KEYS); with it every "
                "socket is encrypted and bound sockets admit only clients whose public key is "
                "in KEYS/authorized/"})
    insecure: bool = field(
        default_factory=lambda: os.environ.get(INSECURE_ENV, "") not in ("", "0", "false"),
        metadata={"help": "allow binding a non-loopback TCP address without --keys (env "
                          "STEPBUS_INSECURE=1): anyone who can reach it can join the run"})


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes | None  # only where processes bind (a client-only directory lacks it)
    client_public: bytes
    client_secret: bytes
    authorized: Path


def load_keys(directory: str) -> CurveKeys:
    """The keys `stepbus keys` made; SettingError naming what is missing."""
    root = Path(directory)

    def load(name: str, secret: bool) -> tuple[bytes, bytes | None]:
        path = root / (f"{name}.key_secret" if secret else f"{name}.key")
        if not path.is_file():
            raise SettingError(f"--keys {directory}: no {path.name} there (make keys with "
                               f"`stepbus keys --dir {directory}`)")
        try:
            return _auth().load_certificate(path)
        except (ValueError, OSError) as exc:
            raise SettingError(f"--keys {directory}: cannot read {path.name}: {exc}") from None

    server_public, _ = load(SERVER, secret=False)
    server_secret = None
    if (root / f"{SERVER}.key_secret").is_file():
        _, server_secret = load(SERVER, secret=True)
    client_public, client_secret = load(CLIENT, secret=True)
    assert client_secret is not None
    return CurveKeys(server_public, server_secret, client_public, client_secret,
                     root / AUTHORIZED)


def make_keys(directory: str, client_of: str = "") -> list[str]:
    """`stepbus keys`: a server keypair, a client keypair and the allow-list holding it; or,
    with `client_of`, a client-only directory for another host: a new client keypair, the
    server's public key, and the new key authorized in `client_of`. Never overwrites."""
    root = Path(directory)
    if (root / f"{CLIENT}.key_secret").exists():
        raise SettingError(f"{directory} already holds keys; not overwriting them")
    made = []
    root.mkdir(parents=True, exist_ok=True)
    if client_of:
        source = Path(client_of)
        if not (source / f"{SERVER}.key_secret").is_file():
            raise SettingError(f"--client-of {client_of}: no {SERVER}.key_secret there (run "
                               f"`stepbus keys --dir {client_of}` first)")
        shutil.copy(source / f"{SERVER}.key", root / f"{SERVER}.key")
        public, _ = _auth().create_certificates(root, CLIENT)
        label = root.resolve().name or "client"
        (source / AUTHORIZED).mkdir(exist_ok=True)
        shutil.copy(public, source / AUTHORIZED / f"{label}.key")
        made += [str(root / f"{SERVER}.key"), public, f"{root / CLIENT}.key_secret",
                 str(source / AUTHORIZED / f"{label}.key")]
    else:
        made += _auth().create_certificates(root, SERVER)
        public, secret = _auth().create_certificates(root, CLIENT)
        (root / AUTHORIZED).mkdir(exist_ok=True)
        shutil.copy(public, root / AUTHORIZED / f"{CLIENT}.key")
        made += [public, secret, str(root / AUTHORIZED / f"{CLIENT}.key")]
    for path in root.glob("*.key_secret"):
        path.chmod(0o600)
    return made


class AllowList:
    """The ZAP handler's question "may this client key in?", answered from KEYS/authorized/,
    read again whenever the directory changes, so a host authorized while the run goes on
    can join without restarting anything. Denials are logged once per key."""

    def __init__(self, directory: Path, log: logging.Logger) -> None:
        self.directory, self.log = directory, log
        self.mtime: float | None = None
        self.keys: set[bytes] = set()
        self.denied: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            mtime = self.directory.stat().st_mtime
        except OSError:
            mtime = None
        if mtime != self.mtime:
            self.mtime = mtime
            self.keys = set(_auth().load_certificates(self.directory)) if mtime else set()
        if key in self.keys:
            return True
        if key not in self.denied and len(self.denied) < 1000:
            self.denied.add(key)
            self.log.warning("refused a CURVE client whose public key %s is not in %s",
                             key.decode(errors="replace"), self.directory)
        return False


class Context(zmq.Context):
    """A process's ZeroMQ context, carrying its security for `socket()`."""

    curve: CurveKeys | None = None
    insecure: bool = False
    authenticator: ThreadAuthenticator | None = None


def context(security: Security | None = None) -> Context:
    ctx = Context()
    if security is not None:
        ctx.insecure = security.insecure
        if security.keys:
            ctx.curve = load_keys(security.keys)
    return ctx


def destroy(ctx: zmq.Context, linger_ms: int = 0) -> None:
    """Stop the ZAP handler first: its thread's socket lives in this context."""
    authenticator = getattr(ctx, "authenticator", None)
    if authenticator is not None:
        authenticator.stop()
    ctx.destroy(linger=linger_ms)


def on_this_host(endpoint: str) -> bool:
    """Whether `endpoint` stays on this host (ipc, inproc, loopback TCP): binding it reaches no
    other host, and whatever is connected through it shares this one's /dev/shm."""
    if not endpoint.startswith("tcp://"):
        return True
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name


def secure(ctx: zmq.Context, sock: zmq.Socket, bind: str | None) -> None:
    """CURVE for `sock` as the run's keys say (server where it binds), or the refusal to bind
    beyond loopback without them."""
    curve: CurveKeys | None = getattr(ctx, "curve", None)
    if curve is None:
        if bind is not None and not on_this_host(bind) and not getattr(ctx, "insecure", False):
            raise SettingError(f"refusing to bind {bind} without encryption: anyone who can reach "
                               f"it could join the run. Make keys with `stepbus keys --dir keys` "
                               f"and give every process --keys keys (or STEPBUS_KEYS=keys), or "
                               f"pass --insecure")
        return
    if bind is not None:
        if curve.server_secret is None:
            raise SettingError(f"cannot bind {bind}: the keys directory has no "
                               f"{SERVER}.key_secret (it is a client-only one, for hosts that "
                               f"only connect)")
        if ctx.authenticator is None:
            from zmq.auth.thread import ThreadAuthenticator

            log = logging.getLogger("stepbus.auth")
            authenticator = ThreadAuthenticator(ctx, log=log)
            authenticator.start()
            authenticator.configure_curve_callback(ZAP_DOMAIN.decode(),
                                                   AllowList(curve.authorized, log))
            ctx.authenticator = authenticator
        sock.curve_server = True
        sock.curve_secretkey = curve.server_secret
        sock.curve_publickey = curve.server_public
    else:
        sock.curve_serverkey = curve.server_public
        sock.curve_secretkey = curve.client_secret
        sock.curve_publickey = curve.client_public


def reachable(address: str, *, via: str) -> str:
    """A bound `address` as a peer that reached the controller at `via` can connect to it: a
    wildcard host (`*`, 0.0.0.0, ::) becomes the controller's host."""
    parts = urllib.parse.urlsplit(address)
    if parts.scheme != "tcp" or parts.hostname not in ("*", "0.0.0.0", "::", None):
        return address
    host = urllib.parse.urlsplit(via).hostname if via.startswith("tcp://") else None
    host = host or "127.0.0.1"
    return f"tcp://{'[' + host + ']' if ':' in host else host}:{parts.port}"


def discovered(name: str, help: str) -> Any:
    """A Config field for endpoint `name` that a process on any host can leave empty: then
    the controller says where it is bound (see node.ControllerLink.discover)."""
    return from_env(ENDPOINTS[name].env_var, "", help, **{ENDPOINT: DISCOVERABLE})


def free_tcp_ports(n: int) -> list[int]:
    """n ports free on loopback right now (for tests and benchmarks)."""
    socks = [pysocket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports
