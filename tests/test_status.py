"""`stepbus status`: one table of every live process from the controller, `--json` for scripts,
`--watch` in place until Ctrl-C, and exit 2 naming the address when nobody answers."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import zmq
from conftest import EVERY_UPDATE, Cluster, act_as_trainer, send_message, wait_for
from controller_probe import status_rows

from stepbus import status
from stepbus.bus import protocol as p

COLUMNS = ["ROLE", "NAME", "HOST", "PID", "UP", "BEAT", "STEPS/S", "QUEUES", "DROPPED",
           "REJECTED", "VERSION", "LAG", "DATA LAG", "RETURN", "EVAL"]


def parse_table(text: str) -> tuple[str, list[dict[str, str]]]:
    """The header line and one dict per row, cells cut at the column headings' offsets."""
    head, columns, *lines = text.rstrip("\n").splitlines()
    starts = [columns.index(name) for name in COLUMNS]
    assert starts == sorted(starts), columns
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    rows = [{name: line[a:b].strip() for name, (a, b) in zip(COLUMNS, bounds, strict=True)}
            for line in lines]
    return head, rows


def command_rows(cluster: Cluster) -> list[dict]:
    """The rows `stepbus status --json` prints ([] if the controller does not answer)."""
    res = cluster.cli("status", "--json", "--timeout", "2")
    return json.loads(res.stdout)["processes"] if res.returncode == 0 else []


def test_status_shows_every_live_process_with_rates_queues_versions_and_lag(cluster: Cluster):
    cluster.start_all(trainer_args=("--target-return", "0", *EVERY_UPDATE), workers=2)
    wait_for(lambda: len(cluster.metrics()) >= 3, 60, "training under way")

    def settled(rows: list[dict]) -> list[dict]:
        """Rows once every process has a step rate and the learner a data lag."""
        by_role = {r["role"]: r for r in rows}
        ready = (len(rows) == 7 and all(r.get("steps_per_s") for r in rows
                                        if r["role"] in ("broker", "worker", "trainer"))
                 and "policy_lag_p99" in by_role.get("trainer", {}))
        return rows if ready else []

    # Polled in-process (a Python start-up per look otherwise), then read as `stepbus status
    # --json` prints it.
    wait_for(lambda: settled(status_rows(cluster)), 30, "rates and lags in every row")
    rows = wait_for(lambda: settled(command_rows(cluster)), 30,
                    "rates and lags in every row of stepbus status --json")
    for row in rows:
        assert {"role", "name", "host", "pid", "uptime_s", "last_heartbeat_s"} <= row.keys()
        assert 0 <= row["last_heartbeat_s"] < 1.5 and row["uptime_s"] > 0
    acting = [r for r in rows if r["role"] in ("broker", "worker", "trainer")]
    assert all(isinstance(r["policy_lag"], int) and r["policy_lag"] >= 0 for r in acting)
    (learner,) = [r for r in rows if r["role"] == "trainer"]
    assert 0 <= learner["policy_lag_p50"] <= learner["policy_lag_p99"] <= 8  # --max-policy-lag

    res = cluster.cli("status")
    assert res.returncode == 0, res.stderr
    head, table = parse_table(res.stdout)
    assert re.match(r"run \S+, epoch 0, 7 processes, newest policy version \d+$", head), head
    assert [r["ROLE"] for r in table] == ["controller", "broker", "assembler", "slot", "trainer",
                                          "worker", "worker"]
    by_role = {r["ROLE"]: r for r in table}
    assert by_role["broker"]["STEPS/S"].isdigit() and by_role["worker"]["STEPS/S"].isdigit()
    assert re.fullmatch(r"ahead \d+/\d+", by_role["broker"]["QUEUES"])
    assert re.fullmatch(r"held \d+ untaken \d+ unlearned \d+", by_role["assembler"]["QUEUES"])
    assert by_role["trainer"]["VERSION"].isdigit() and by_role["trainer"]["LAG"].isdigit()
    assert re.fullmatch(r"\d+/\d+", by_role["trainer"]["DATA LAG"])
    assert by_role["slot"]["VERSION"] == "-" and by_role["slot"]["STEPS/S"] == "-"
    assert by_role["controller"]["QUEUES"] == "-"
    assert all(r["PID"].isdigit() and r["BEAT"].endswith("s") for r in table)


def test_a_broker_acting_with_old_weights_shows_how_many_versions_it_lags(cluster: Cluster):
    for role in ("controller", "broker", "assembler"):
        cluster.start(role)
    cluster.start("worker", "--envs-per-worker", "2", "--name", "w")
    trainer, pull = act_as_trainer(cluster, obs_dim=4)  # the broker acts with version 1
    # ...while a learner tells the controller, every heartbeat, it has made version 5 (its
    # weights not sent yet): from its own thread, so a slow CLI start cannot let it expire.
    stop = threading.Event()

    def fake_learner() -> None:
        learner = cluster.socket(zmq.DEALER, cluster.endpoints["controller"])
        while not stop.wait(0.25):
            send_message(learner, p.Heartbeat(role="trainer", name="fake", host="h", pid=1,
                                              leaving=False, figures={"policy_version": 5}))
        learner.close()

    beats = threading.Thread(target=fake_learner)
    beats.start()
    expected = {"broker": 4, "worker": 4, "trainer": 0}
    seen: list[dict] = []

    def lags() -> bool:
        rows = status_rows(cluster)
        seen.append({r["role"]: r.get("policy_lag") for r in rows
                     if r.get("policy_version", -1) > 0})
        return seen[-1] == expected

    try:
        # (until the broker's and worker's next heartbeats, newer than the learner's first
        # one, their lag is measured against what was known then)
        wait_for(lags, 30, f"lags {expected}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen {seen[-1:]}") from None
    finally:
        stop.set()
        beats.join()
    for sock in (trainer, pull):
        sock.close()


def test_status_watch_redraws_in_place_and_ctrl_c_exits_0(cluster: Cluster):
    cluster.start("controller")
    wait_for(lambda: status_rows(cluster), 30, "the controller to answer")
    screen, lines = cluster.start("status", "--watch", "0.2"), cluster.start(
        "status", "--watch", "0.2", "--json")
    # three refreshes each, so the watchers kept going after their first frame
    wait_for(lambda: screen.output().count(status.HOME) >= 3, 30, "three redrawn frames")
    wait_for(lambda: lines.output().count("\n") >= 3, 30, "three JSON lines")
    for proc in (screen, lines):
        proc.signal(signal.SIGINT)
        assert proc.wait(10) == 0, proc.output()[-2000:]
        assert "Traceback" not in proc.output()
    out = screen.output()
    assert out.startswith(status.CLEAR_SCREEN + status.HOME), "clears once, then redraws"
    frames = out.split(status.HOME)[1:]
    assert all("every 0.2s at" in f and "ROLE" in f and "controller" in f for f in frames)
    docs = [json.loads(line) for line in lines.output().splitlines() if line]
    assert len(docs) >= 3 and all(d["processes"][0]["role"] == "controller" for d in docs)


def test_a_watch_whose_ctrl_c_is_swallowed_mid_frame_still_exits_0_after_that_frame():
    """Code inside a frame (ZeroMQ's C calls, say) that loses the KeyboardInterrupt must not
    keep the watch redrawing: it ends once the frame is drawn."""
    calls = []

    def fetch() -> dict:
        calls.append(1)
        assert len(calls) <= 3, "the watch went on after Ctrl-C"
        if len(calls) == 2:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the signal lands here, and is swallowed below
            except KeyboardInterrupt:
                pass
        return {"run_id": "r", "epoch": 0, "processes": []}

    before = signal.getsignal(signal.SIGINT)
    out = io.StringIO()
    assert status.watch(fetch, 0.01, json_lines=True, out=out) == 0
    assert len(calls) == 2 and len(out.getvalue().splitlines()) == 2
    assert signal.getsignal(signal.SIGINT) is before, "the caller's handler is back"


def test_status_exits_2_naming_the_address_when_no_controller_answers(cluster: Cluster):
    address = "tcp://127.0.0.1:9"
    for extra in ((), ("--json",), ("--watch", "0.2")):
        t0 = time.monotonic()
        res = cluster.cli("status", "--controller", address, "--timeout", "0.5", *extra)
        assert res.returncode == 2, (extra, res.stdout, res.stderr)
        assert f"controller unreachable at {address}" in res.stderr
        assert res.stdout == "" and "Traceback" not in res.stderr
        assert time.monotonic() - t0 < 10, "within the timeout (plus the CLI's start-up)"


def test_sigusr2_prints_where_every_thread_of_a_waiting_command_is_and_it_goes_on(
        cluster: Cluster):
    """What a hung process waits on, without a debugger: its stacks on stderr, then it carries
    on (here to its timeout's exit 2)."""
    proc = cluster.start("status", "--controller", "tcp://127.0.0.1:9", "--timeout", "3")
    wait_for(lambda: catches(proc.pid, signal.SIGUSR2), 20, "the command to take SIGUSR2")
    os.kill(proc.pid, signal.SIGUSR2)
    assert proc.wait(20) == 2
    out = proc.output()
    assert "most recent call first" in out and "stepbus/entry.py" in out, out[-2000:]
    assert out.index("most recent call first") < out.index("controller unreachable"), \
        "the stacks, then it went on to its own exit"


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether the process has a handler for `sig` (SigCgt in /proc/PID/status)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    found = re.search(r"^SigCgt:\s*([0-9a-f]+)", text, re.M)
    return found is not None and bool(int(found.group(1), 16) >> (sig - 1) & 1)


def test_the_table_shows_a_dash_where_a_process_has_no_such_figure():
    text = status.table({"run_id": "r", "epoch": 3, "processes": [
        {"role": "worker", "name": "w", "host": "h", "pid": 7, "uptime_s": 3725.0,
         "last_heartbeat_s": 0.25, "policy_version": -1},
        {"role": "broker", "name": "b", "host": "h", "pid": 8, "uptime_s": 61.0,
         "last_heartbeat_s": 0.0, "steps_per_s": 812.4, "outstanding_steps": 10,
         "credit_window": 20, "stale_dropped": 2, "experience_dropped": 1, "rejected": 4,
         "policy_version": 9, "policy_lag": 0}]})
    head, (broker, worker) = parse_table(text)
    assert head == "run r, epoch 3, 2 processes, newest policy version 9"
    assert broker == {"ROLE": "broker", "NAME": "b", "HOST": "h", "PID": "8", "UP": "1m01s",
                      "BEAT": "0.0s", "STEPS/S": "812", "QUEUES": "ahead 10/20",
                      "DROPPED": "3", "REJECTED": "4", "VERSION": "9", "LAG": "0",
                      "DATA LAG": "-", "RETURN": "-", "EVAL": "-"}
    assert worker["UP"] == "1h02m"
    assert [worker[c] for c in COLUMNS[6:]] == ["-"] * 9


def test_the_table_shows_the_training_return_and_the_eval_return():
    text = status.table({"run_id": "r", "epoch": 0, "processes": [
        {"role": "trainer", "name": "t", "policy_version": 12, "mean_return": 187.456,
         "eval_return": 500.0, "eval_version": 11},
        {"role": "evaluator", "name": "e", "policy_version": 11, "eval_return": 500.0},
        {"role": "trainer", "name": "fresh", "policy_version": 1, "mean_return": None}]})
    _, (fresh, trainer, evaluator) = parse_table(text)
    assert (trainer["RETURN"], trainer["EVAL"]) == ("187.5", "500.0")
    assert (evaluator["RETURN"], evaluator["EVAL"], evaluator["VERSION"]) == ("-", "500.0", "11")
    assert (fresh["RETURN"], fresh["EVAL"]) == ("-", "-")


def test_a_broker_holding_recurrent_states_shows_how_many_and_their_size():
    text = status.table({"run_id": "r", "epoch": 0, "processes": [
        {"role": "broker", "name": "b", "outstanding_steps": 4, "credit_window": 8,
         "memory_agents": 16, "memory_bytes": 16 * 2 * 128 * 4}]})
    _, (broker,) = parse_table(text)
    assert broker["QUEUES"] == "ahead 4/8 memory 16 (16 KiB)"
