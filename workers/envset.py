"""The K environments one worker hosts, stepped together as one batch of rows.

A Gymnasium env is one row; a PettingZoo `ParallelEnv` is one row per possible agent. Episodes
autoreset within the step that ends them, and the observation an episode ended on travels in
`final_obs`. An env that raises is reported as data and recreated; one that keeps raising ends
the worker (`EnvFailure`) rather than being retried forever.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import traceback
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import gymnasium as gym
import numpy as np

from stepbus import spaces
from stepbus.bus import protocol as p
from stepbus.bus import rows as obs_rows
from stepbus.bus.rows import Obs
from stepbus.workers.envs import (
    agents_of,
    env_kwargs,
    episode_seed,
    make_env,
    seed_spaces,
    space_spec,
)
from stepbus.workers.infos import InfoEncoder, StepInfos

T = TypeVar("T")

RESTART_WINDOW_S = 60.0  # --max-env-restarts-per-minute counts recreations within this window


class EnvSettings(Protocol):
    """What an env set reads of its worker's settings (workers/worker.py's `Config`), named
    here so that this module need not import the worker, which imports it."""

    @property
    def env(self) -> str: ...
    @property
    def env_kwargs(self) -> str: ...
    @property
    def envs_per_worker(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def worker_index(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def max_env_restarts_per_minute(self) -> int: ...
    @property
    def episode_statistics(self) -> bool: ...


class EnvFailure(RuntimeError):
    """Environments keep raising (or cannot be recreated): the worker cannot go on."""


@dataclass
class RowOutcomes:
    """What one multi-agent batch produced, row by row, filled in env by env."""

    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    alive: np.ndarray  # rows that act next
    finals: list[Obs]  # the observations ended rows ended on, in row order

    @classmethod
    def empty(cls, rows: int) -> RowOutcomes:
        return cls(np.zeros(rows, np.float32), np.zeros(rows, bool), np.zeros(rows, bool),
                   np.zeros(rows, bool), [])


class EnvSet:
    """K environments stepped together; an env that raises is reported and recreated, up to
    `max_env_restarts_per_minute` times within 60 s.

    `report` receives each error as data; `tick` is called between envs in resets and
    multi-agent steps so a slow batch keeps the worker's heartbeat going. `in_env` is True
    while env code (or a single-agent step's loop around it) runs and no ZeroMQ call is under
    way; with a `gate` (a lock the worker's thread holds otherwise), setting it opens the gate,
    so the worker's heartbeat thread may use the sockets exactly then (see
    `worker.BusyBeats`).
    """

    def __init__(self, cfg: EnvSettings, report: Callable[[p.RemoteError], None],
                 log: logging.Logger, tick: Callable[[], None] = lambda: None) -> None:
        self.cfg, self.report, self.log, self.tick = cfg, report, log, tick
        # A split of a double-buffered worker hosts envs first_env.. of it: seeds and error
        # reports name an env by its index in the whole worker, so a split changes neither.
        self.first_env = 0
        self.gate: threading.Lock | None = None
        self._in_env = False
        self.raise_errors = False  # an env's exception ends the run instead (`_recreate`)
        self.restarts: collections.deque[float] = collections.deque()  # recent recreations
        self.kwargs = env_kwargs(cfg.env_kwargs)  # ValueError: the worker refuses to start
        self.envs = [self.env_call(self._make) for _ in range(cfg.envs_per_worker)]
        self.spec = space_spec(self.envs[0], probe=lambda: self.env_call(self._make))
        self.agents = agents_of(self.envs[0])  # names ([] for Gymnasium envs)
        # The env's own agent keys (PettingZoo allows any hashable) -> row within an env.
        self.agent_keys = list(self.envs[0].possible_agents) if self.agents else []
        self.agent_row = {agent: j for j, agent in enumerate(self.agent_keys)}
        self.width = max(1, len(self.agents))  # rows per env
        self.rows = len(self.envs) * self.width
        self.alive = np.ones(self.rows, bool)  # which rows act next (multi-agent envs)
        self.write = spaces.RowWriter(self.spec)  # an env's observation into a batch's row
        self.episode = np.full(len(self.envs), -1, np.int64)  # each env's current episode
        self.episode_seed = np.zeros(len(self.envs), np.int64)  # ... and its reset seed
        self.last_obs = spaces.zeros(self.spec, self.rows)
        self.unobserved: list[int] = []  # rows of the step under way that ended unobserved
        self.errors = 0
        self.agents_vanished = 0  # agents that left an episode without a done flag
        self.without_options: set[int] = set()  # envs that rejected the current reset options
        low, high = self.spec.action_low, self.spec.action_high
        self.action_bounds = (np.asarray(low), np.asarray(high)) if low else None
        # How episodes after a reset start (a RESET's `seeding` and `autoreset`), and which envs
        # owe the reset of NEXT_STEP autoreset (done on their next step).
        self.seeding, self.autoreset = p.SEEDING_EPISODE, p.AUTORESET_SAME_STEP
        self.owed = np.zeros(len(self.envs), bool)
        # A vector client that asked for infos (RESET's `infos`) gets the last batch's here.
        self.with_infos = False
        self.step_infos: StepInfos | None = None
        self.info_encoder = InfoEncoder(log)

    def _make(self) -> Any:
        """One env; inside Gymnasium's RecordEpisodeStatistics with --episode-statistics, so
        its infos carry `episode` ({r, l, t}) at each episode's end."""
        env = make_env(self.cfg.env, self.kwargs)
        if self.cfg.episode_statistics and not agents_of(env):
            env = gym.wrappers.RecordEpisodeStatistics(env)
        return env

    def info_fields(self) -> dict[str, Any]:
        """The last batch's infos as STEP_RESULT fields ({} unless a client asked)."""
        if self.step_infos is None:
            return {}
        return self.info_encoder.fields(self.step_infos)

    def reset(self, options: dict, rows: list[int] | None = None,
              seeds: list[int | None] | None = None) -> Obs:
        """Reset every env, or only `rows` (the others keep their observations); `seeds`: one
        per reset env (None: continue its generator), else per-episode derived seeds."""
        if self.agents:
            return self._reset_parallel(options)
        indices = rows if rows else range(len(self.envs))
        obs = obs_rows.copy(self.last_obs) if rows else obs_rows.empty_like(self.last_obs)
        self.without_options.clear()
        keep = self.step_infos = StepInfos([None] * len(self.envs)) if self.with_infos else None
        for j, i in enumerate(indices):
            env = self.envs[i]
            self.owed[i] = False
            seed = self._new_episode(i) if seeds is None else self._given_seed(i, seeds[j])
            try:
                first = self.env_call(env.reset, seed=seed, options=options or None)
            except Exception as exc:  # e.g. options this env rejects: report, go on without
                # Rejected options are the operator's doing, bounded by barriers: not counted.
                first = self._recreate(i, exc, {}, counted=not options)
                self.without_options.add(i)  # its later autoresets too, until the next barrier
            self.write(obs, i, *first)
            if keep is not None:
                keep.rows[i] = first[1]
            self.tick()
        self.last_obs = obs
        return obs

    def step(self, actions: np.ndarray, options: dict, out: Obs | None = None) -> p.StepResult:
        """`out`: where the observations go (a shared-memory slot), not a new array."""
        self.unobserved.clear()  # marks of a step an exception cut short are not this one's
        if self.agents:
            return self._step_parallel(actions, options, out)
        k = len(self.envs)
        obs = obs_rows.empty_like(self.last_obs) if out is None else out
        # Gymnasium's vector envs hand rewards on as float64: so do we, for them, bit for bit.
        reward = np.zeros(k, np.float64 if self.seeding == p.SEEDING_GYMNASIUM else np.float32)
        terminated = np.zeros(k, bool)
        truncated = np.zeros(k, bool)
        finals: list[Obs] = []
        actions = self._clipped(actions)
        # A Box observation is assigned in the loop itself: a call per env costs CartPole 3%.
        write = None if isinstance(obs, np.ndarray) and self.write.plain else self.write
        box = typing.cast(np.ndarray, obs)  # only used when `write` is None: a Box batch
        # The hot loop: no ZeroMQ call in it but _recreate's report, so `in_env` holds for the
        # whole batch and the heartbeat thread keeps the heartbeats going meanwhile; a wrapper
        # call and a tick per env cost 10% of a CartPole worker's time.
        same_step, owed = self.autoreset == p.AUTORESET_SAME_STEP, self.owed.any()
        keep = self.step_infos = StepInfos([None] * k) if self.with_infos else None
        self.in_env = True
        try:
            for i, env in enumerate(self.envs):
                if owed and self.owed[i]:  # NEXT_STEP: this step is the reset it owes
                    self._reset_owed(i, obs, options)
                    continue
                try:
                    if write is None:
                        box[i], reward[i], terminated[i], truncated[i], info = env.step(actions[i])
                    else:
                        o, reward[i], terminated[i], truncated[i], info = env.step(actions[i])
                        write(obs, i, o, info)
                except Exception as exc:  # the env's fault, not ours: cut the episode, go on
                    truncated[i] = True
                    finals.append(self._unobserved_final(i))
                    first = self._recreate(i, exc, self._options_for(i, options))
                    self.write(obs, i, *first)
                    if same_step:  # final infos are SAME_STEP's, one per final observation
                        self._ended_info(i, {}, first[1])
                    elif keep is not None:
                        keep.rows[i] = first[1]
                    continue
                if keep is not None:
                    keep.rows[i] = info
                if terminated[i] or truncated[i]:
                    finals.append(obs_rows.copy(obs_rows.take(obs, i)))
                    if not same_step:  # NEXT_STEP: reset on its next step; DISABLED: never
                        self.owed[i] = self.autoreset == p.AUTORESET_NEXT_STEP
                        continue
                    self._reset_now(i, obs, options)
        finally:
            self.in_env = False
        self.last_obs = obs
        return p.StepResult(incarnation="", epoch=0, seq=0, first=False, obs=obs, reward=reward,
                            terminated=terminated, truncated=truncated,
                            final_obs=self._finals(finals), **self.episodes(),
                            **self.info_fields(), no_final_obs=self._no_final_obs())

    def _autoreset(self, i: int, obs: Obs, options: dict) -> dict:
        """Env i's next episode, begun as it ends by itself (recreated if reset raises), its
        first observation written into row i of `obs`; the reset's info."""
        try:
            first = self.envs[i].reset(seed=self._autoreset_seed(i),
                                       options=self._options_for(i, options))
        except Exception as exc:
            first = self._recreate(i, exc, {})
        self.write(obs, i, *first)
        return first[1]

    def _reset_now(self, i: int, obs: Obs, options: dict) -> None:
        """SAME_STEP autoreset: env i ended on this step and starts its next episode now."""
        info = self._autoreset(i, obs, options)
        if self.step_infos is not None:
            self._ended_info(i, self.step_infos.rows[i] or {}, info)

    def _ended_info(self, i: int, final: dict, reset: dict) -> None:
        """Env i's episode ended within this step: `final` its last info (in `final_obs`'s
        order), `reset` the info of the episode it starts."""
        if self.step_infos is not None:
            self.step_infos.finals.append(final)
            self.step_infos.rows[i] = reset

    def _unobserved_final(self, i: int) -> Obs:
        """Row i's final observation when none came after its last action (its env raised,
        or its agent left without one): the one it acted on, and the row is marked so."""
        self.unobserved.append(i)
        return obs_rows.copy(obs_rows.take(self.last_obs, i))

    def _no_final_obs(self) -> np.ndarray | None:
        """STEP_RESULT's `no_final_obs` for the step under way (None: every ended row had a
        final observation; `step` clears the marks as it begins)."""
        if not self.unobserved:
            return None
        marks = np.zeros(self.rows, bool)
        marks[self.unobserved] = True
        return marks

    def _finals(self, finals: list[Obs]) -> Obs:
        return obs_rows.stack(finals) if finals else obs_rows.take(self.last_obs, slice(0, 0))

    def _clipped(self, actions: np.ndarray) -> np.ndarray:
        """Box actions clipped to the space's bounds; others as they are."""
        if self.action_bounds is None:
            return actions
        shape = (len(actions), *self.spec.action_shape)
        return np.clip(actions.reshape(len(actions), -1), *self.action_bounds).reshape(shape)

    def _reset_owed(self, i: int, obs: Obs, options: dict) -> None:
        """NEXT_STEP autoreset: env i ended on its last step and is reset now, not stepped
        (reward 0, neither flag), as Gymnasium's NEXT_STEP mode does."""
        self.owed[i] = False
        info = self._autoreset(i, obs, options)
        if self.step_infos is not None:
            self.step_infos.rows[i] = info

    def _autoreset_seed(self, i: int) -> int | None:
        """The seed an env's next episode starts with when it ends by itself: derived from its
        episode number, or (Gymnasium's seeding) none, continuing its generator."""
        if self.seeding == p.SEEDING_GYMNASIUM:
            return self._given_seed(i, None)
        return self._new_episode(i)

    def _given_seed(self, i: int, seed: int | None) -> int | None:
        """Env i starts its next episode with a seed a vector client chose (None: none); its
        spaces are left alone, as Gymnasium's vector envs leave them."""
        self.episode[i] += 1
        self.episode_seed[i] = -1 if seed is None else seed
        return seed

    def _new_episode(self, i: int) -> int:
        """Env i starts its next episode: the seed to reset it (and its spaces) with."""
        self.episode[i] += 1
        seed = episode_seed(self.cfg.seed, self.cfg.worker_index, self.first_env + i,
                            int(self.episode[i]))
        self.episode_seed[i] = seed
        seed_spaces(self.envs[i], seed)
        return seed

    def episodes(self) -> dict[str, Any]:
        """Each row's episode index and reset seed, for a STEP_RESULT."""
        return {"episode": np.repeat(self.episode, self.width),
                "episode_seed": np.repeat(self.episode_seed, self.width)}

    # PettingZoo parallel envs: row base + j is agent j of env u (base = u * width). Only alive
    # rows act; an env whose agents are all done resets within the same step, as above.

    def _reset_parallel(self, options: dict) -> Obs:
        obs, alive = obs_rows.zeros_like(self.last_obs), np.zeros(self.rows, bool)
        self.without_options.clear()
        for u, env in enumerate(self.envs):
            try:
                first = self.env_call(env.reset, seed=self._new_episode(u),
                                      options=options or None)
            except Exception as exc:
                first = self._recreate(u, exc, {}, counted=not options)
                self.without_options.add(u)
            self._place(u, first, obs, alive)
            self.tick()
        self.last_obs, self.alive = obs, alive
        return obs

    def _step_parallel(self, actions: np.ndarray, options: dict,
                       out: Obs | None = None) -> p.StepResult:
        obs: Obs
        if out is None:
            obs = obs_rows.zeros_like(self.last_obs)
        else:
            obs_rows.zero(out)
            obs = out
        rows = RowOutcomes.empty(self.rows)
        actions = self._clipped(actions)
        for u, env in enumerate(self.envs):
            self._step_one_parallel(u, env, actions, options, obs, rows)
        self.last_obs, self.alive = obs, rows.alive
        return p.StepResult(incarnation="", epoch=0, seq=0, first=False, obs=obs,
                            reward=rows.reward, terminated=rows.terminated,
                            truncated=rows.truncated, final_obs=self._finals(rows.finals),
                            alive=rows.alive, **self.episodes(),
                            no_final_obs=self._no_final_obs())

    def _step_one_parallel(self, u: int, env: Any, actions: np.ndarray, options: dict,
                           obs: Obs, rows: RowOutcomes) -> None:
        """Step parallel env u's acting agents into their rows of `obs` and `rows`."""
        base = u * self.width
        acting = [a for a in self.agent_keys if self.alive[base + self.agent_row[a]]]
        try:
            nxt, rew, term, trunc, infos = self.env_call(
                env.step, {a: actions[base + self.agent_row[a]] for a in acting})
        except Exception as exc:  # the env's fault: cut every acting agent's episode
            for a in acting:
                i = base + self.agent_row[a]
                rows.truncated[i] = True
                rows.finals.append(self._unobserved_final(i))
            self._place(u, self._recreate(u, exc, self._options_for(u, options)), obs,
                        rows.alive)
            return
        finally:
            self.tick()
        # Acting next: in env.agents, observed, and not done this step (an env may keep
        # done agents listed). An agent that acted and is none of these nor done vanished:
        # its episode is cut here (truncated, from the observation the env gave, if any).
        going_on = {a for a in env.agents
                    if a in nxt and not (term.get(a, False) or trunc.get(a, False))}
        for a in acting:
            i = base + self.agent_row[a]
            rows.reward[i] = rew.get(a, 0.0)
            rows.terminated[i] = bool(term.get(a, False))
            rows.truncated[i] = bool(trunc.get(a, False))
            if not (rows.terminated[i] or rows.truncated[i]) and a not in going_on:
                rows.truncated[i] = True  # vanished
                self.agents_vanished += 1
            if rows.terminated[i] or rows.truncated[i]:
                rows.finals.append(
                    self.write.row(nxt[a], infos.get(a), self.last_obs) if a in nxt
                    else self._unobserved_final(i))
        first = (nxt, infos)
        if not going_on:  # all done: the next episode starts within this step
            try:
                first = self.env_call(env.reset, seed=self._new_episode(u),
                                      options=self._options_for(u, options))
            except Exception as exc:
                first = self._recreate(u, exc, {})
            going_on = set(self.envs[u].agents)
        self._place(u, first, obs, rows.alive, going_on)

    def _options_for(self, u: int, options: dict) -> dict | None:
        """An env that rejected the barrier's options goes on without them."""
        return None if u in self.without_options else options or None

    def _place(self, u: int, first: tuple[dict, dict], obs: Obs, alive: np.ndarray,
               agents: set | None = None) -> None:
        """Env u's acting agents' observations (and infos' masks) into their rows, from a
        (observations, infos) pair by agent; those rows are alive."""
        base = u * self.width
        observations, infos = first
        for agent in self.envs[u].agents:
            j = self.agent_row.get(agent)
            if j is not None and agent in observations and (agents is None or agent in agents):
                self.write(obs, base + j, observations[agent], infos.get(agent))
                alive[base + j] = True

    def alive_rows(self) -> np.ndarray | None:
        """The alive mask to send (None for single-agent envs: every row is alive)."""
        return self.alive.copy() if self.agents else None

    def env_call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run env code with `in_env` set: only then may the heartbeat thread send heartbeats,
        because only then is this thread surely not inside a ZeroMQ call of its own."""
        was, self.in_env = self.in_env, True
        try:
            return fn(*args, **kwargs)
        finally:
            self.in_env = was

    def _recreate(self, i: int, exc: Exception, options: dict | None, *,
                  counted: bool = True) -> Any:
        """Report the error, replace env i, and return what its reset gave: (observation, info),
        maps by agent for a parallel env; past the restart
        bound, raise EnvFailure instead (one line for the operator, not endless tracebacks).
        With `raise_errors` (the serial runner, for debugging) the env's exception is raised
        as it is, with its own traceback."""
        if self.raise_errors:
            raise exc
        self.errors += 1
        tb = traceback.format_exc()
        now = time.monotonic()
        if counted:
            self.restarts.append(now)
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
            self.restarts.popleft()
        over = counted and len(self.restarts) > self.cfg.max_env_restarts_per_minute
        seed, episode = int(self.episode_seed[i]), int(self.episode[i])
        self.log.error("env %d (%s, episode %d, seed %d) raised %s: %s%s", i, self.cfg.env,
                       episode, seed, type(exc).__name__, exc, "" if over else "; recreating it")
        was, self.in_env = self.in_env, False  # the report goes out on ZeroMQ sockets
        try:
            self.report(p.RemoteError(
                origin=self.cfg.name, error_type=type(exc).__name__,
                message=str(exc)[:p.MAX_ERROR_TEXT], traceback=tb[-p.MAX_ERROR_TEXT:],  # tail
                context={"env": self.cfg.env, "env_index": self.first_env + i,
                         "episode": episode,
                         "seed": seed}))
        finally:
            self.in_env = was
        if over:
            raise EnvFailure(
                f"{self.cfg.env} keeps raising: {len(self.restarts)} env restarts within "
                f"{RESTART_WINDOW_S:.0f} s (last: env {i}, {type(exc).__name__}: {exc}), over "
                f"--max-env-restarts-per-minute {self.cfg.max_env_restarts_per_minute}; fix the "
                f"environment (the controller's log has each traceback) or raise the limit")
        with contextlib.suppress(Exception):
            self.env_call(self.envs[i].close)
        seed = self._new_episode(i)
        try:
            self.envs[i] = self.env_call(self._make)
            seed_spaces(self.envs[i], seed)
            return self.env_call(self.envs[i].reset, seed=seed, options=options or None)
        except Exception as again:
            raise EnvFailure(f"env {i} ({self.cfg.env}) raised again while being recreated: "
                             f"{type(again).__name__}: {again}") from again

    def actions_problem(self, actions: np.ndarray) -> str:
        """Why an action batch cannot be stepped (empty if it can)."""
        return spaces.actions_problem(self.spec, actions, self.rows)

    @property
    def in_env(self) -> bool:
        return self._in_env

    @in_env.setter
    def in_env(self, value: bool) -> None:
        if value == self._in_env:
            return
        if value:
            self._in_env = True
            if self.gate is not None:
                self.gate.release()
        else:
            if self.gate is not None:
                self.gate.acquire()  # waits for a heartbeat being sent, tens of microseconds
            self._in_env = False

    def close(self) -> None:
        for env in self.envs:
            env.close()
