"""Freed memory stays with the process for the next frame, instead of going back to the kernel.

Atari trajectories are ~1 MB arrays made and freed tens of times a second (received frames,
trajectory buffers, weights). glibc serves such sizes with mmap, or trims them off its heap
once freed, so every new one page-faults its memory in afresh: 5,000-8,500 faults a second in
the learner and 1,500 in the broker at 2 workers x 32 Atari envs, a fifth of the learner's
CPU. With the thresholds raised, blocks up to 32 MiB come from the heap and freed ones are kept
for reuse: under 200 faults a second. The cost is that a process keeps its peak heap, which
for these processes is their steady working set.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_FROM = 32 << 20  # glibc's largest allowed threshold on 64-bit
TRIM_FROM = 256 << 20


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (False: nothing changed: not glibc, or the user
    set MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_, which glibc has taken already)."""
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & os.environ.keys():
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, libc's among them: no ldconfig
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_FROM)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_FROM))
