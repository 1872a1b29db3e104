"""What checkpointing costs: the default CartPole job (one worker x 8 envs, PPO) run for a while
at each `--checkpoint-interval-s`, one after the other, reporting the learner's env steps/s,
checkpoints per second and how long each update waited to be confirmed (its metrics record
written, its receipts sent: both wait for the checkpoint that holds it).

The wait is measured from outside: metrics.jsonl is read every 5 ms and each record's arrival
compared with the time the update was made (its `time` field).

    python benchmarks/checkpoint_interval.py --intervals 0,0.1,0.5,2 --seconds 10
    python benchmarks/checkpoint_interval.py --algo stepbus.trainer.consume:ConsumeOnly
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from stepbus.bus import launch

ENDPOINTS = ("controller", "broadcast", "steps", "policy", "experience", "trajectories",
             "receipts")
WARM_UP_S = 4.0  # after the first metrics record


def job_env(workdir: Path) -> dict[str, str]:
    return launch.environment({name: f"ipc://{workdir}/{name}" for name in ENDPOINTS},
                              workdir / "runs", {"STEPBUS_LOG_LEVEL": "WARNING"})


def checkpoints(workdir: Path) -> tuple[float, int]:
    """(when, checkpoints the learner has written), from `stepbus status`."""
    res = subprocess.run([sys.executable, "-m", "stepbus", "status", "--json"],
                         env=job_env(workdir), capture_output=True, text=True, timeout=30,
                         check=True)
    rows = [r for r in json.loads(res.stdout)["processes"] if r["role"] == "trainer"]
    return time.monotonic(), int(rows[0]["checkpoints"])


def start_job(workdir: Path, interval: float, algo: str) -> launch.Group:
    env = job_env(workdir)
    roles = [("controller",), ("broker",), ("worker",), ("assembler",),
             # a metrics record per update: each one's arrival is what is timed
             ("learner", "--target-return", "0", "--checkpoint-interval-s", str(interval),
              "--metrics-interval-s", "0",
              "--algo", algo)]
    group = launch.Group(workdir)
    for role, *flags in roles:
        group.start_role(role, *flags, log=workdir / f"{role}.log", env=env)
    return group


def watch_records(path: Path, seconds: float) -> list[tuple[float, dict]]:
    """(arrival time, record) for each record written during `seconds`."""
    seen: list[tuple[float, dict]] = []
    with open(path) as f:
        f.read()  # the warm-up's records
        end = time.monotonic() + seconds
        buffer = ""
        while time.monotonic() < end:
            buffer += f.read()
            now = time.time()
            *lines, buffer = buffer.split("\n")
            seen += [(now, json.loads(line)) for line in lines if line]
            time.sleep(0.005)
    return seen


def measure(interval: float, seconds: float, algo: str) -> dict[str, float]:
    workdir = Path(tempfile.mkdtemp(prefix="sb-ckpt-"))
    group = start_job(workdir, interval, algo)
    try:
        runs = workdir / "runs"
        deadline = time.monotonic() + 60
        while not list(runs.glob("*/metrics.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(WARM_UP_S)
        began = checkpoints(workdir)
        seen = watch_records(next(runs.glob("*/metrics.jsonl")), seconds)
        ended = checkpoints(workdir)
    finally:
        group.stop(grace_s=10.0)
        shutil.rmtree(workdir, ignore_errors=True)
    records = [r for _, r in seen]
    waits = np.array([arrived - r["time"] for arrived, r in seen]) * 1000
    span = records[-1]["wall_s"] - records[0]["wall_s"]
    return {"interval_s": interval, "updates": len(records),
            "env_steps_per_s": (records[-1]["env_steps"] - records[0]["env_steps"]) / span,
            "checkpoints_per_s": (ended[1] - began[1]) / (ended[0] - began[0]),
            "confirmed_ms_p50": float(np.percentile(waits, 50)),
            "confirmed_ms_p99": float(np.percentile(waits, 99))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", default="0,0.1,0.5,2",
                        help="comma-separated --checkpoint-interval-s values, run in turn")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured per interval")
    parser.add_argument("--algo", default="stepbus.trainer.ppo:PPO", help="the learner's --algo")
    args = parser.parse_args()
    print("| --checkpoint-interval-s | env steps/s | checkpoints/s | update to confirmation, "
          "ms p50 / p99 |")
    print("|---|---|---|---|")
    for interval in (float(x) for x in args.intervals.split(",")):
        m = measure(interval, args.seconds, args.algo)
        print(f"| {interval:g} | {m['env_steps_per_s']:,.0f} | {m['checkpoints_per_s']:.1f} | "
              f"{m['confirmed_ms_p50']:.0f} / {m['confirmed_ms_p99']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
