"""Signals that came while a process was still importing: `stepbus/entry.py` records them
before the heavy imports, and a process's stop flag (`bus/node.py`) reads them once its loop
starts. A module of its own, because the entry point imports the whole CLI and the loop must
not."""

from __future__ import annotations

EARLY_SIGNALS: list[int] = []  # read by the process's stop flag once its loop starts
