"""Stable-Baselines3's `VecEnv` over a stepbus vector env (`pip install -e ".[sb3]"`).

SB3 resets an ended env within the step and reads the episode's last observation from
`infos[i]["terminal_observation"]`, so the vector env must use Gymnasium's SAME_STEP autoreset;
`infos[i]["TimeLimit.truncated"]` says a time limit (not a terminal state) ended it, as SB3's
own vector envs say, and `infos[i]["episode"]` gives the episode's {r, l, t} as SB3's `Monitor`
does (so SB3 logs episode returns without a VecMonitor). Each info is the env's own, as it
travels (`stepbus.vector.make(..., infos=True)`); `stepbus.vector.make_sb3` makes one in a
call. This module imports stable_baselines3, so it imports only where that is installed;
nothing else in stepbus needs it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode
from stable_baselines3.common.vec_env.base_vec_env import VecEnv as _VecEnv
from stable_baselines3.common.vec_env.base_vec_env import VecEnvIndices

from stepbus.vector.env import BusVectorEnv


class VecEnv(_VecEnv):
    """SB3's vector env API (reset, step_async/step_wait, attributes) on `envs`.

    Raises:
        ValueError: `envs` does not autoreset in the same step (make it with
            `autoreset_mode="SameStep"`).
    """

    def __init__(self, envs: BusVectorEnv) -> None:
        if envs.metadata.get("autoreset_mode") is not AutoresetMode.SAME_STEP:
            raise ValueError("SB3 resets within the step: make the vector env with "
                             "autoreset_mode='SameStep'")
        self.envs = envs
        self.actions: np.ndarray | None = None
        self.started = time.time()  # Monitor's t: seconds since this env was made
        self.returns = np.zeros(envs.num_envs, np.float64)  # of the running episodes
        self.lengths = np.zeros(envs.num_envs, np.int64)
        super().__init__(envs.num_envs, envs.single_observation_space,
                         envs.single_action_space)

    def reset(self) -> Any:
        seeds = self._seeds if any(s is not None for s in self._seeds) else None
        options = next((o for o in self._options if o), None)
        obs, _ = self.envs.reset(seed=seeds, options=options)
        self.reset_infos: list[dict[str, Any]] = [dict(i or {})
                                                  for i in self.envs.last_infos.rows]
        self.returns[:], self.lengths[:] = 0.0, 0
        self._reset_seeds()
        self._reset_options()
        return obs

    def step_async(self, actions: np.ndarray) -> None:
        self.actions = actions

    def step_wait(self) -> Any:
        assert self.actions is not None, "step_async first"
        obs, reward, terminated, truncated, info = self.envs.step(self.actions)
        dones = terminated | truncated
        got = self.envs.last_infos
        infos: list[dict[str, Any]] = [dict(got.rows[i] or {}) for i in range(self.num_envs)]
        self.returns += reward
        self.lengths += 1
        for i in range(self.num_envs):
            infos[i]["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
        for i in map(int, np.flatnonzero(dones)):
            infos[i] = {**(got.finals[i] or {}), "TimeLimit.truncated": bool(
                truncated[i] and not terminated[i]), "terminal_observation": info["final_obs"][i],
                "episode": self.episode(i)}
        return obs, reward.astype(np.float32), dones, infos

    def episode(self, i: int) -> dict[str, Any]:
        """Env i's episode as SB3's Monitor reports it; the next one starts from nothing."""
        done = {"r": round(float(self.returns[i]), 6), "l": int(self.lengths[i]),
                "t": round(time.time() - self.started, 6)}
        self.returns[i], self.lengths[i] = 0.0, 0
        return done

    def close(self) -> None:
        self.envs.close()

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        values = self.envs.get_attr(attr_name)
        return [values[i] for i in self._indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        chosen = set(self._indices(indices))
        current = list(self.envs.get_attr(attr_name))
        self.envs.set_attr(attr_name, [value if i in chosen else v
                                       for i, v in enumerate(current)])

    def env_method(self, method_name: str, *method_args: Any, indices: VecEnvIndices = None,
                   **method_kwargs: Any) -> list[Any]:
        values = self.envs.call(method_name, *method_args, **method_kwargs)
        return [values[i] for i in self._indices(indices)]

    def env_is_wrapped(self, wrapper_class: type, indices: VecEnvIndices = None) -> list[bool]:
        """Wrappers live in the workers; SB3 asks this only for its Monitor, which a
        `VecMonitor` around this env replaces."""
        return [False for _ in self._indices(indices)]

    def _indices(self, indices: VecEnvIndices) -> Sequence[int]:
        if indices is None:
            return range(self.num_envs)
        if isinstance(indices, int):
            return [indices]
        return list(indices) if isinstance(indices, Iterable) else [int(indices)]
