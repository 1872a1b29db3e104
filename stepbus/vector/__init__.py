"""stepbus as a Gymnasium vector env: keep your training loop, put the envs on the bus.

`make(env, num_envs, workers=1)` starts its own controller and workers (as AsyncVectorEnv
starts its processes) and relays to them from the caller's process; `connect(controller,
num_envs)` attaches to a running `stepbus broker --external` whose workers were started
anywhere. Both return a
`gymnasium.vector.VectorEnv` (`BusVectorEnv`) with Gymnasium's seeding and autoreset modes,
and EnvPool's `send`/`recv` besides. `make_sb3` makes Stable-Baselines3's VecEnv
(`stepbus.vector.sb3.VecEnv`) in one call. See docs/vector.md.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
from gymnasium.vector import AutoresetMode

from stepbus.bus import forkserver, wiring
from stepbus.bus import protocol as p
from stepbus.bus.launch import RoleStarter
from stepbus.vector.env import ATTACH_TIMEOUT_S, BusVectorEnv
from stepbus.vector.launch import Launched, worker_sizes
from stepbus.vector.link import BrokerLost, BusError, EnvLink, Link, WorkerLost, discover
from stepbus.vector.local import LocalRelay
from stepbus.workers.envs import make_env

__all__ = ["AutoresetMode", "BrokerLost", "BusError", "BusVectorEnv", "RemoteFailure",
           "WorkerLost", "connect", "make", "make_sb3"]

RemoteFailure = p.RemoteFailure  # an env raised in `call`: its type and message kept


def make(env: str, num_envs: int, workers: int = 1, *,
         autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
         batch_size: int | None = None, attach_timeout_s: float = ATTACH_TIMEOUT_S,
         infos: bool = True, context: str | None = None, lanes: bool = True,
         **worker_options: Any) -> BusVectorEnv:
    """A vector env of `num_envs` copies of `env` (a Gymnasium id or `module:callable`, as
    `stepbus worker --env` takes) in `workers` worker processes, with its own controller; the
    relay to them runs in this process, on this thread, while the env waits for them
    (`stepbus.vector.local`); `close()` stops them all.

    Args:
        infos: the envs' infos travel (False: none, and the workers pay nothing for them).
        context: how the processes start (named after AsyncVectorEnv's start methods): None
            or "spawn", a fresh interpreter each (0.3-0.5 s of CPU on imports apiece);
            "forkserver", forked from a server this process starts on first use and keeps
            until it exits, which has imported stepbus already (a make after the first starts
            in milliseconds; see docs/vector.md for what that means for the environment).
        lanes: each worker's steps go through a pair of named pipes (`stepbus.bus.lane`),
            its heartbeats on its socket; False: everything on the socket (slower with small
            batches: see docs/performance.md).
        worker_options: more `stepbus worker` flags, e.g. `max_env_restarts_per_minute=3`,
            or `episode_statistics=True` for each env's `infos["episode"]`.

    Raises:
        BusError: the processes did not come up within `attach_timeout_s` (their output is
            in the message); none is left running.
        ValueError: a `context` other than those above.
    """
    sizes = worker_sizes(num_envs, workers)
    starter = _starter(context)
    probe = make_env(env)  # the exact spaces to report (bounds do not travel)
    try:
        single = (probe.observation_space, probe.action_space)
    finally:
        probe.close()
    launched = Launched(env, sizes, worker_options, starter, lanes=lanes)
    link = None
    try:
        link = LocalRelay(launched.endpoints["steps"], launched.lanes)
        envs = BusVectorEnv(link, num_envs, autoreset_mode=autoreset_mode,
                            batch_size=batch_size, single_spaces=single,
                            on_close=launched.stop, attach_timeout_s=attach_timeout_s,
                            infos=infos)
        envs.launched = launched
        return envs
    except BusError as exc:
        logs = launched.logs()
        _close_all(link, launched)
        raise BusError(f"{exc}\n{logs}") from exc
    except BaseException:
        _close_all(link, launched)
        raise


def connect(controller: str, num_envs: int, *,
            autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
            batch_size: int | None = None, attach_timeout_s: float = ATTACH_TIMEOUT_S,
            single_spaces: tuple[gym.Space, gym.Space] | None = None,
            security: wiring.Security | None = None, infos: bool = True) -> BusVectorEnv:
    """A vector env over a running bus: the controller at `controller` names the relaying
    broker (`stepbus broker --external`), whose workers' envs must add up to `num_envs`.
    `close()` leaves those processes running.

    Raises:
        BusError: no such broker, or not enough workers, within `attach_timeout_s`.
    """
    link = Link(discover(controller, attach_timeout_s, security), security)
    try:
        return BusVectorEnv(link, num_envs, autoreset_mode=autoreset_mode,
                            batch_size=batch_size, single_spaces=single_spaces,
                            attach_timeout_s=attach_timeout_s, infos=infos)
    except BaseException:
        link.close()
        raise


def make_sb3(env: str, num_envs: int, workers: int = 1, **options: Any) -> Any:
    """Stable-Baselines3's VecEnv (`stepbus.vector.sb3.VecEnv`) over `make(env, num_envs,
    workers, autoreset_mode="SameStep", **options)`, as SB3's `make_vec_env` makes one;
    needs stable-baselines3 (`pip install -e ".[sb3]"`).

    Raises:
        ValueError: another autoreset mode in `options` (SB3 resets within the step).
    """
    from stepbus.vector import sb3  # imports stable_baselines3: only here, when asked

    mode = AutoresetMode(options.pop("autoreset_mode", AutoresetMode.SAME_STEP))
    if mode is not AutoresetMode.SAME_STEP:
        raise ValueError(f"SB3 resets within the step: autoreset_mode must be SameStep, "
                         f"not {mode.value}")
    return sb3.VecEnv(make(env, num_envs, workers, autoreset_mode=mode, **options))


def _starter(context: str | None) -> RoleStarter | None:
    if context in (None, "spawn"):
        return None
    if context == "forkserver":
        return forkserver.shared()
    raise ValueError(f'context must be None, "spawn" or "forkserver", not {context!r}')


def _close_all(link: EnvLink | None, launched: Launched) -> None:
    if link is not None:
        link.close()
    launched.stop()
