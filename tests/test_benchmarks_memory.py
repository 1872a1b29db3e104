"""The memory benchmark still runs end to end: a few seconds of the full pipeline, one table row
per process, nothing left behind (benchmarks are not tests: the verdicts are not checked)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

from test_benchmarks import TAG_VAR, assert_none_left, tagged_processes

REPO = Path(__file__).resolve().parents[1]
ROLES = ("controller", "broker", "worker", "assembler", "slot", "trainer")


def test_memory_benchmark_prints_a_row_per_process_and_leaves_nothing_behind() -> None:
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG_VAR: tag}
    try:
        proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory.py"),
                               "--minutes", "0.05", "--warmup", "0.5", "--interval", "1",
                               "--workers", "1", "--envs", "8"],
                              capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = [line.split() for line in proc.stdout.splitlines()
                if re.match(r"^\w+\s+\S+\s+\d+\s+(?:[\d.]+\s+){4}[-+]", line)]
        assert sorted({row[0] for row in rows}) == sorted(ROLES), proc.stdout
        assert all(float(row[3]) > 1 and row[-1] in ("PASS", "FAIL") for row in rows), proc.stdout
        assert re.search(r"steps/s over the run: [1-9]\d*", proc.stdout), proc.stdout
        assert_none_left(tag)
    finally:
        for pid in tagged_processes(tag):
            os.kill(pid, 9)
