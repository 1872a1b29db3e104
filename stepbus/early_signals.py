"""Signals that came while a process was still importing: `stepbus/entry.py` records them
before the heavy imports, and a process's stop flag (`bus/node.py`) reads them once its loop
starts. A module of its own, because the entry point imports the whole CLI and the loop must
not. Also SIGUSR2's stack dump, which every stepbus process takes before anything else."""

from __future__ import annotations

import faulthandler
import signal

EARLY_SIGNALS: list[int] = []  # read by the process's stop flag once its loop starts


def stacks_on_sigusr2() -> None:
    """Every thread's stack to stderr on SIGUSR2, and the process goes on (`kill -USR2 PID`:
    what a hung process waits on, without a debugger)."""
    faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)
