"""`stepbus status`: the controller's status reply as one table, once or refreshed in place.

The controller sends every figure each process reports; this module picks the few that say at
a glance whether the pipeline is healthy, the same columns for every role, "-" where a process
has no such figure. `--json` keeps every figure, for scripts.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

ROLE_ORDER = ("controller", "broker", "assembler", "slot", "trainer", "evaluator", "worker",
              "supervisor")
# Queue-like figures, in the words the QUEUES column uses; see the README's status section.
QUEUE_FIGURES = (("held", "held"), ("untaken", "untaken"), ("unlearned", "unlearned"))
CLEAR_SCREEN, HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[2J", "\x1b[H", "\x1b[K", "\x1b[J"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _duration(seconds: Any) -> str:
    if not _number(seconds):
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{seconds:.0f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _queues(row: dict) -> str:
    parts = []
    if _number(row.get("outstanding_steps")):
        window = row.get("credit_window")
        parts.append(f"ahead {row['outstanding_steps']}"
                     + (f"/{window}" if _number(window) else ""))
    parts += [f"{label} {row[key]}" for key, label in QUEUE_FIGURES if _number(row.get(key))]
    if _number(row.get("memory_agents")) and _number(row.get("memory_bytes")):
        parts.append(f"memory {row['memory_agents']} ({row['memory_bytes'] / 1024:.0f} KiB)")
    return " ".join(parts) or "-"


def _dropped(row: dict) -> str:
    counts = [v for k, v in row.items() if k.endswith("_dropped") and _number(v)]
    return str(sum(counts)) if counts else "-"


def _figure(key: str, fmt: str = "{}") -> Callable[[dict], str]:
    return lambda row: fmt.format(row[key]) if _number(row.get(key)) else "-"


def _data_lag(row: dict) -> str:
    p50, p99 = row.get("policy_lag_p50"), row.get("policy_lag_p99")
    return f"{p50:g}/{p99:g}" if _number(p50) and _number(p99) else "-"


COLUMNS: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("ROLE", lambda row: str(row.get("role", "-"))),
    ("NAME", lambda row: str(row.get("name", "-"))),
    ("HOST", lambda row: str(row.get("host", "-"))),
    ("PID", _figure("pid")),
    ("UP", lambda row: _duration(row.get("uptime_s"))),
    ("BEAT", _figure("last_heartbeat_s", "{:.1f}s")),
    ("STEPS/S", _figure("steps_per_s", "{:.0f}")),
    ("QUEUES", _queues),
    ("DROPPED", _dropped),
    ("REJECTED", _figure("rejected")),
    ("VERSION", lambda row: (str(row["policy_version"]) if _number(row.get("policy_version"))
                             and row["policy_version"] >= 0 else "-")),
    ("LAG", _figure("policy_lag")),
    ("DATA LAG", _data_lag),
    # the learner's mean of its last training episodes; an evaluator's greedy mean (its own row
    # and the learner's, which also carries eval_version in --json)
    ("RETURN", _figure("mean_return", "{:.1f}")),
    ("EVAL", _figure("eval_return", "{:.1f}")),
)


def sort_rows(rows: list[dict]) -> list[dict]:
    def key(row: dict) -> tuple[int, str]:
        role = str(row.get("role"))
        return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER),
                f"{role} {row.get('name')}")
    return sorted(rows, key=key)


def supervision(rows: list[dict]) -> list[str]:
    """A line for each supervisor with news: its child died, is being restarted or was given up
    on. Healthy supervisors get no row of their own, so the table keeps one row per process."""
    lines = []
    for r in rows:
        if r.get("deaths") or r.get("state") not in ("running", None):
            error = f": {r['last_error']}" if r.get("last_error") else ""
            lines.append(f"supervisor {r.get('name')}: {r.get('child')} {r.get('state')}, "
                         f"{r.get('deaths', 0)} deaths ({r.get('quick_deaths', 0)} quick in a "
                         f"row), last {r.get('last_death') or '-'}{error}")
    return lines


def table(status: dict) -> str:
    """The status as text: a header line, one aligned row per live process, then a line for
    each supervisor whose child died."""
    everything = sort_rows(status["processes"])
    rows = [r for r in everything if r.get("role") != "supervisor"]
    supervisors = [r for r in everything if r.get("role") == "supervisor"]
    versions = [r["policy_version"] for r in rows if _number(r.get("policy_version"))]
    newest = max(versions, default=-1)
    head = (f"run {status['run_id']}, epoch {status['epoch']}, {len(rows)} processes"
            + (f" ({len(supervisors)} supervised)" if supervisors else "")
            + f", newest policy version {newest if newest >= 0 else '-'}")
    cells = [[name for name, _ in COLUMNS]] + [[cell(r) for _, cell in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in cells]
    return "\n".join([head, *lines, *supervision(supervisors)])


def as_json(status: dict) -> str:
    return json.dumps({"run_id": status["run_id"], "epoch": status["epoch"],
                       "processes": sort_rows(status["processes"])})


def watch(fetch: Callable[[], dict], interval_s: float, *, json_lines: bool,
          out: TextIO = sys.stdout) -> int:
    """Refresh until Ctrl-C (exit 0). The first fetch raises if the controller is unreachable;
    later misses are shown in place and retried, since a controller may be restarting.
    With --json, one JSON document per line instead of a redrawn screen."""
    with Interrupted() as ctrl_c:
        first = True
        try:
            while not ctrl_c.seen:
                frame(fetch, interval_s, json_lines, out, first=first)
                first = False
                time.sleep(interval_s)
        except KeyboardInterrupt:
            pass
    if not json_lines:
        out.write("\n")
    out.flush()
    return 0


def frame(fetch: Callable[[], dict], interval_s: float, json_lines: bool, out: TextIO, *,
          first: bool) -> None:
    """One refresh: a JSON line, or the screen redrawn over the last frame line by line (so it
    does not flicker)."""
    stamp = time.strftime("%H:%M:%S")
    try:
        status = fetch()
        text = as_json(status) if json_lines else table(status)
    except Unreachable as exc:
        if first:
            raise
        text = json.dumps({"error": str(exc)}) if json_lines else f"stepbus: {exc}"
    if json_lines:
        out.write(text + "\n")
    else:
        screen = [f"every {interval_s:g}s at {stamp}; Ctrl-C to stop", *text.splitlines()]
        out.write((CLEAR_SCREEN if first else "") + HOME
                  + "".join(line + CLEAR_LINE + "\n" for line in screen) + CLEAR_BELOW)
    out.flush()


class Interrupted:
    """Ctrl-C as KeyboardInterrupt, and as a flag the watch loop reads between frames: once,
    a watch went on redrawing after Ctrl-C (the exception never reached its loop; where it was
    lost was not found), and whatever swallows the exception, the flag ends the watch after
    the frame in flight."""

    def __init__(self) -> None:
        self.seen = False

    def __enter__(self) -> Interrupted:
        self._handler = signal.signal(signal.SIGINT, self._take)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._handler)

    def _take(self, signum: int, frame: Any) -> None:
        self.seen = True
        raise KeyboardInterrupt


class Unreachable(Exception):
    """The controller did not answer in time (the message names the address tried)."""
