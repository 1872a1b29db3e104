"""The `stepbus` executable. It catches SIGINT/SIGTERM before the heavy imports, so a process
that honcho stops while it is still starting exits 0 instead of dying by the signal, and has
glibc keep freed memory for the next frame (`stepbus/heap.py`). SIGUSR2 makes any stepbus
process or command print every thread's stack to its stderr and go on (`kill -USR2 PID`): what
a hung one is doing, without a debugger."""

from __future__ import annotations

import signal
import sys

from stepbus.early_signals import EARLY_SIGNALS, stacks_on_sigusr2

PROCESS_COMMANDS = ("controller", "broker", "worker", "assembler", "trainer", "learner",
                    "supervise")


def main() -> int:
    stacks_on_sigusr2()
    if len(sys.argv) > 1 and sys.argv[1] in PROCESS_COMMANDS:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: EARLY_SIGNALS.append(signum))
        from stepbus.heap import keep_freed_memory

        keep_freed_memory()  # before the imports allocate: see stepbus/heap.py
    from stepbus.cli import main as cli_main

    return cli_main()
