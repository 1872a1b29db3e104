"""The processes `stepbus.vector.make` starts (as AsyncVectorEnv starts its own): a controller
and the workers, on ipc:// endpoints in a private directory, and their end. The relay they
talk to runs in the caller's process (`stepbus/vector/local.py`), on the steps endpoint here.

They are started and ended by the launcher (`stepbus.bus.launch`): each in a session of its own
(a Ctrl-C in the caller's terminal reaches the caller, whose `close()` stops them) and, on
Linux, sent SIGTERM should the caller die without closing.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from stepbus.bus import lane, launch


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
    `--max-env-restarts-per-minute 3`; True -> the bare flag, False -> its `--no-` form (every
    boolean worker flag has one); None -> nothing."""
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        elif value is not None:
            out += [flag, str(value)]
    return out


class Launched:
    """The processes of one `make`: started at once, stopped by `stop()` (idempotent)."""

    def __init__(self, env: str, sizes: list[int], options: dict[str, object],
                 forkserver: launch.RoleStarter | None = None, *, lanes: bool = True) -> None:
        """`forkserver`: where the processes are forked from (None: an interpreter each).
        `lanes`: each worker's requests and answers go through a lane (`bus/lane.py`), its
        caller's end in `self.lanes`, rather than the steps socket."""
        self.dir = Path(tempfile.mkdtemp(prefix="sbv-"))  # ipc paths must stay short
        self.endpoints = {name: f"ipc://{self.dir}/{name}"
                          for name in ("controller", "broadcast", "steps")}
        self.group = launch.Group(self.dir, forkserver=forkserver)
        self.lanes: dict[str, lane.Lane] = {}
        atexit.register(self.stop)
        try:
            self.start("controller")
            for i, k in enumerate(sizes):
                self.start("worker", "--env", env, "--envs-per-worker", str(k),
                           "--name", worker_name(i), "--worker-index", str(i),
                           # the relay maps no segment: observations go on the socket
                           "--no-shm-frames", *self.lane_for(worker_name(i), lanes),
                           *flags(options), name=worker_name(i))
        except BaseException:
            self.stop()
            raise

    def lane_for(self, name: str, wanted: bool) -> list[str]:
        """A worker's `--lane`, its caller's end opened before the worker starts."""
        if not wanted:
            return []
        prefix = self.dir / f"lane-{name}"
        paths = lane.LanePaths.of(prefix)
        paths.make()
        self.lanes[name] = lane.Lane.caller_end(paths)
        return ["--lane", str(prefix)]

    @property
    def procs(self) -> list[launch.Child]:
        return self.group.procs

    def environ(self) -> dict[str, str]:
        env = launch.environment(self.endpoints, self.dir / "runs")
        # The processes run in our private directory: a `module:callable` env the caller can
        # import from its working directory must be importable there too.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(),
                                                          env.get("PYTHONPATH", "")]))
        env.setdefault("STEPBUS_LOG_LEVEL", "WARNING")
        return env

    def start(self, role: str, *args: str, name: str = "") -> None:
        name = name or role
        self.group.start_role(role, *args, name=name, log=self.dir / f"{name}.log",
                              env=self.environ())

    def logs(self, chars: int = 1500) -> str:
        """The tail of each process's output, for an error message."""
        return "\n".join(f"--- {child.name} (rc={child.poll()}) ---\n{child.output()[-chars:]}"
                         for child in self.procs)

    def pids(self) -> list[int]:
        return [child.pid for child in self.procs]

    def stop(self) -> None:
        """Every process ended (`launch.Group.stop`) and the directory removed; nothing is
        left running."""
        for each in self.lanes.values():  # first: a worker blocked writing to us gets EPIPE
            each.close()
        self.group.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.stop)
