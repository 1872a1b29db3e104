"""The controller asked from the test process itself, with the request `stepbus status` and
`stepbus shutdown` send: tests that poll the status would otherwise start a Python process per
question (0.5-1 s each on two busy cores, most of it importing stepbus), time the cluster under
test then waits for. What the commands themselves print and exit with is test_status's and
test_exit_codes' to check."""

from __future__ import annotations

import json

from conftest import Cluster

from stepbus import cli
from stepbus import status as status_view
from stepbus.bus import protocol as p


def status_rows(cluster: Cluster, timeout: float = 2.0, keys: str = "") -> list[dict]:
    """The rows `stepbus status --json` prints, sorted as it does, or [] if the controller
    does not answer within `timeout`; `keys`: as --keys."""
    return status_at(cluster.endpoints["controller"], timeout, keys)


def status_at(controller: str, timeout: float = 2.0, keys: str = "") -> list[dict]:
    """As status_rows, of the controller at `controller` (a run the test did not start)."""
    try:
        reply = cli._ask(controller, p.StatusRequest(), timeout, keys)
    except status_view.Unreachable:
        return []
    assert isinstance(reply, p.StatusReply), reply
    shown = status_view.as_json({"run_id": reply.run_id, "epoch": reply.epoch,
                                 "processes": reply.processes})
    return json.loads(shown)["processes"]


def shutdown(cluster: Cluster, timeout: float = 30.0, keys: str = "") -> bool:
    """`stepbus shutdown`'s request: whether the controller said yes (the command's exit 0);
    `keys`: as --keys."""
    reply = cli._ask(cluster.endpoints["controller"],
                     p.ShutdownRequest(reason="stepbus shutdown"), timeout, keys)
    assert isinstance(reply, p.Reply), reply
    return reply.ok
