"""stepbus/heap.py: with the thresholds raised, a process that makes and frees frame-sized
arrays reuses their memory instead of page-faulting fresh memory in for each one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHURN = """
import resource, sys
import numpy as np
from stepbus.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
held = []
for i in range(100):  # warm up: the heap reaches its working set
    held.append(np.ones(900_000, np.uint8)); held = held[-64:]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(400):  # trajectories made, held until learned from, freed
    held.append(np.ones(900_000, np.uint8)); held = held[-64:]
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def churn(mode: str, **env: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True,
                         timeout=60, env={**os.environ, **env}, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_frames_are_reused_instead_of_faulted_in_again() -> None:
    kept, kept_faults = churn("keep")
    _, fresh_faults = churn("default")
    assert kept
    assert fresh_faults > 400 * 10, "glibc returns freed frames and faults new ones in"
    assert kept_faults < fresh_faults / 20


def test_a_users_own_malloc_thresholds_are_left_alone() -> None:
    kept, _ = churn("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert not kept
