"""The processes `stepbus.vector.make` starts (as AsyncVectorEnv starts its own): a controller,
a relaying broker (`stepbus broker --external`) and the workers, on ipc:// endpoints in a
private directory, and their end.

Each runs in a session of its own (a Ctrl-C in the caller's terminal reaches the caller, whose
`close()` stops them) and, on Linux, is sent SIGTERM should the caller die without closing.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def worker_sizes(num_envs: int, workers: int) -> list[int]:
    """Envs per worker, as even as can be, the larger first."""
    if not 1 <= workers <= num_envs:
        raise ValueError(f"workers must be 1 to num_envs ({num_envs}), not {workers}")
    return [num_envs // workers + (i < num_envs % workers) for i in range(workers)]


def worker_name(i: int) -> str:
    """Names sort as their index: worker i holds the i-th block of env ids."""
    return f"vec-{i:04d}"


def flags(options: dict[str, object]) -> list[str]:
    """Keyword arguments as worker flags: `max_env_restarts_per_minute=3` ->
    `--max-env-restarts-per-minute 3`; True -> the bare flag, False -> nothing."""
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


class Launched:
    """The processes of one `make`: started at once, stopped by `stop()` (idempotent)."""

    def __init__(self, env: str, sizes: list[int], options: dict[str, object]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sbv-"))  # ipc paths must stay short
        self.endpoints = {name: f"ipc://{self.dir}/{name}"
                          for name in ("controller", "broadcast", "steps", "vector")}
        self.procs: list[tuple[str, subprocess.Popen]] = []
        atexit.register(self.stop)
        try:
            self.start("controller")
            self.start("broker", "--external")
            for i, k in enumerate(sizes):
                self.start("worker", "--env", env, "--envs-per-worker", str(k),
                           "--name", worker_name(i), "--worker-index", str(i),
                           *flags(options), name=worker_name(i))
        except BaseException:
            self.stop()
            raise

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "HONCHO_PROCESS_NAME"}
        env.update({f"STEPBUS_{name.upper()}": address
                    for name, address in self.endpoints.items()})
        env["STEPBUS_RUNS_DIR"] = str(self.dir / "runs")
        # The processes run in our private directory: a `module:callable` env the caller can
        # import from its working directory must be importable there too.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(),
                                                          env.get("PYTHONPATH", "")]))
        env.setdefault("STEPBUS_LOG_LEVEL", "WARNING")
        return env

    def start(self, role: str, *args: str, name: str = "") -> None:
        log = open(self.dir / f"{name or role}.log", "wb")  # noqa: SIM115 (the child owns it)
        with log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "stepbus", role, *args], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.environ(),
                cwd=self.dir, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self.procs.append((name or role, popen))

    def logs(self, chars: int = 1500) -> str:
        """The tail of each process's output, for an error message."""
        parts = []
        for name, popen in self.procs:
            path = self.dir / f"{name}.log"
            text = path.read_text(errors="replace")[-chars:] if path.exists() else ""
            parts.append(f"--- {name} (rc={popen.poll()}) ---\n{text}")
        return "\n".join(parts)

    def pids(self) -> list[int]:
        return [popen.pid for _, popen in self.procs]

    def stop(self) -> None:
        """SIGTERM to every process (SIGCONT first: one may be frozen), SIGKILL after the
        grace, and the directory removed; nothing is left running."""
        for _, popen in self.procs:
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(popen.pid, signal.SIGCONT)
                    os.kill(popen.pid, signal.SIGTERM)
        for _, popen in self.procs:
            try:
                popen.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(STOP_GRACE_S)
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.stop)
