"""Exit codes, one table for every command and role (docs/operations.md#exit-codes).

A supervisor restarts a child that failed (1, or a signal) and gives up at once on a setting
error (2): the same flags would be refused again on every restart. Flags an earlier child ran
with for a while are an exception: they worked, so a 2 with them is taken for a passing failure.
"""

from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    OK = 0  # done: the goal reached, a shutdown, Ctrl-C
    FAILED = 1  # something went wrong while running (an env that keeps crashing, a lost peer)
    SETTING = 2  # a setting cannot work: a bad flag, endpoint, model name or key directory, a
    # missing optional dependency, a refused bind, or a controller that does not answer


class SettingError(Exception):
    """A setting that cannot work, said in one line naming the flag or variable; the command
    prints it and exits 2 (`Exit.SETTING`), never with a traceback."""
