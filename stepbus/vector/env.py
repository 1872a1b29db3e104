"""`BusVectorEnv`: a `gymnasium.vector.VectorEnv` whose envs live in stepbus workers.

Env ids: the workers sorted by name, each worker's envs in its row order, so env id =
the offset of its worker (the rows of the workers before it) + the row. Every call goes to the
workers through a relay (in this process under `make`, `stepbus broker --external` under
`connect`) as RESET and STEP messages and comes back as their STEP_RESULTs; the policy stays in
the caller.

Seeding and autoreset are Gymnasium's: `reset(seed=s)` seeds env i with s + i, later
autoresets continue each env's own generator, and the three autoreset modes are done by the
worker itself, so the same seeds and actions give SyncVectorEnv's observations, rewards,
terminations and truncations, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from stepbus import spaces
from stepbus.bus import protocol as p
from stepbus.bus import rows
from stepbus.vector import calls
from stepbus.vector import infos as infos_of
from stepbus.vector.launch import Launched
from stepbus.vector.link import BusError, EnvLink, WorkerLost

ATTACH_TIMEOUT_S = 60.0  # workers may take this long to start and say hello
MODES = {AutoresetMode.NEXT_STEP: p.AUTORESET_NEXT_STEP,
         AutoresetMode.SAME_STEP: p.AUTORESET_SAME_STEP,
         AutoresetMode.DISABLED: p.AUTORESET_DISABLED}
ACTION_DTYPES = {"discrete": np.int64, "multi_discrete": np.int64, "multi_binary": np.int8,
                 "box": np.float32}


@dataclass
class Slot:
    """One worker as this env uses it: its env ids, what it was asked, what it answered."""

    member: p.Member
    offset: int
    asked: bool = False  # a RESET or STEP is out and its result not in
    resetting: bool = False  # ... a RESET: its result is a first one
    result: p.StepResult | None = None  # the answer not yet handed to the caller
    obs: p.Obs | None = None  # its latest observations, as they travel

    @property
    def ids(self) -> np.ndarray:
        return np.arange(self.offset, self.offset + self.member.rows)


class BusVectorEnv(VectorEnv):
    """Gymnasium's vector env API over stepbus workers; EnvPool's `send`/`recv` besides.

    Args:
        link: the way to the relay: in this process (`make`) or a relay process's.
        num_envs: env ids 0 to num_envs - 1; the workers' rows must add up to it.
        autoreset_mode: Gymnasium's AutoresetMode (NEXT_STEP by default, as Gymnasium).
        batch_size: rows `recv` waits for (default: num_envs).
        single_spaces: (observation, action) spaces to report; default: built from the
            workers' declared spaces (Box bounds then the dtype's range).
        on_close: run by `close()` after the link is closed (stops what `make` started).
        infos: the envs' infos travel with every step (False: `{}`, but SAME_STEP's final
            observations, and the workers send none).
    """

    def __init__(self, link: EnvLink, num_envs: int, *,
                 autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
                 batch_size: int | None = None,
                 single_spaces: tuple[gym.Space, gym.Space] | None = None,
                 on_close: Callable[[], None] | None = None,
                 attach_timeout_s: float = ATTACH_TIMEOUT_S, infos: bool = True) -> None:
        self.link, self.on_close = link, on_close
        self.with_infos, self.infos = infos, infos_of.InfoDecoder()
        self.last_infos = infos_of.EnvInfos()  # per env, of the last batch handed over
        self.launched: Launched | None = None  # what `make` started (None: `connect`)
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.num_envs = num_envs
        self.batch_size = num_envs if batch_size is None else batch_size
        if not 1 <= self.batch_size <= num_envs:
            raise ValueError(f"batch_size must be 1 to num_envs ({num_envs})")
        self.attach_timeout_s = attach_timeout_s
        self.slots: list[Slot] = []
        self.failure: BusError | None = None  # raised until reset() attaches again
        self.calls = calls.Calls()
        self.spec_msg = self.attach(attach_timeout_s)
        spec = self.spec_msg.spec
        obs_space, act_space = single_spaces or (spaces.observation_space(spec),
                                                 spaces.action_space(spec))
        self.single_observation_space, self.single_action_space = obs_space, act_space
        self.observation_space = batch_space(obs_space, num_envs)
        self.action_space = batch_space(act_space, num_envs)
        self.metadata = {"autoreset_mode": self.autoreset_mode}
        self.action_dtype = ACTION_DTYPES[spec.action_kind]

    # -- attaching
    def attach(self, timeout_s: float) -> p.VectorSpec:
        """Wait until the relay's workers cover env ids 0 to num_envs - 1; our slots.

        Raises:
            BusError: not within `timeout_s` (with what was seen), or more rows than envs.
        """
        deadline, hello_at, seen = time.monotonic() + timeout_s, 0.0, None
        while time.monotonic() < deadline:
            if time.monotonic() >= hello_at:
                self.link.send(p.VectorHello(client=self.link.name))
                hello_at = time.monotonic() + 1.0
            self.link.heard_at = time.monotonic()  # silence counts only once attached
            msg = self.link.recv(min(0.25, deadline - time.monotonic()))
            if isinstance(msg, p.VectorSpec):
                seen = msg
                total = sum(m.rows for m in msg.workers)
                if total > self.num_envs:
                    raise BusError(f"the workers have {total} envs, more than num_envs "
                                   f"{self.num_envs}")
                if total == self.num_envs:
                    self.take_members(msg.workers)
                    self.failure = None
                    return msg
        have = sum(m.rows for m in seen.workers) if seen else 0
        raise BusError(f"workers with {self.num_envs} envs did not all join within "
                       f"{timeout_s:.0f}s ({have} envs did)")

    def take_members(self, members: Sequence[p.Member]) -> None:
        if any(m.agents for m in members):
            raise BusError("a vector env needs Gymnasium envs, not multi-agent ones")
        offsets = np.cumsum([0] + [m.rows for m in members])
        self.slots = [Slot(m, int(o)) for m, o in zip(members, offsets, strict=False)]

    # -- Gymnasium's API
    def reset(self, *, seed: int | Sequence[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Reset every env (or those `options["reset_mask"]` marks), as SyncVectorEnv does.

        Raises:
            BusError: a worker or the broker was lost (the env stays usable after a reset).
            TypeError: options that are not JSON data.
        """
        if self.failure is not None:
            self.attach(self.attach_timeout_s)
        self.settle()
        seeds = _seeds(seed, self.num_envs)
        options = dict(options or {})
        mask = _reset_mask(options.pop("reset_mask", None), self.num_envs)
        _check_options(options)
        for slot in self.slots:
            picked = np.flatnonzero(mask[slot.ids])
            if not len(picked):
                continue
            wire_seeds = [seeds[slot.offset + int(r)] for r in picked]
            self.ask(slot, p.Reset(
                epoch=0, seq=0, options=options,
                seeds=[-1 if s is None else s for s in wire_seeds],
                rows=[] if len(picked) == slot.member.rows else [int(r) for r in picked],
                seeding=p.SEEDING_GYMNASIUM, autoreset=MODES[self.autoreset_mode],
                worker=slot.member.name, infos=self.with_infos))
        self.collect([s for s in self.slots if s.asked])
        env_infos = infos_of.EnvInfos()
        for slot in self.slots:
            if slot.result is not None:
                env_infos.rows += self.infos.env_infos([slot.result]).rows
                slot.obs, slot.result = slot.result.obs, None
            else:
                env_infos.rows += [None] * slot.member.rows
        self.last_infos = env_infos
        obs = self.user_obs(rows.concat([s.obs for s in self.slots if s.obs is not None]))
        return obs, infos_of.layout(env_infos, None)

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray,
                                          dict[str, Any]]:
        """One step of every env; SAME_STEP puts `final_obs`/`final_info` in the info.

        Raises:
            BusError: a worker or the broker was lost, within the liveness timeout.
        """
        self.send(actions)
        self.collect(self.slots)
        return self.take(self.slots, with_ids=False)

    # -- EnvPool's async API
    def send(self, actions: Any, env_ids: Any = None) -> None:
        """Step the envs `env_ids` (default: all) with `actions` (rows in env_ids' order);
        each worker's envs go together, so env_ids must hold all of a worker's or none.

        Raises:
            ValueError: env ids that split a worker, or whose worker is still stepping.
            BusError: a worker or the broker was lost.
        """
        self.raise_failure()
        actions = np.asarray(actions, self.action_dtype)
        ids = np.arange(self.num_envs) if env_ids is None else np.asarray(env_ids, np.int64)
        if len(actions) != len(ids):
            raise ValueError(f"{len(actions)} actions for {len(ids)} env ids")
        found = self.split(ids)
        for slot, rows_of in found:  # all checked before any is sent
            problem = spaces.actions_problem(self.spec_msg.spec, actions[rows_of],
                                             slot.member.rows)
            if problem:
                raise ValueError(f"actions for env ids {slot.offset} on: {problem}")
        for slot, rows_of in found:
            self.ask(slot, p.Step(epoch=0, seq=0, policy_version=-1,
                                  actions=np.ascontiguousarray(actions[rows_of]),
                                  worker=slot.member.name))

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The results of whichever workers are ready, at least `batch_size` rows when that
        many are in flight (whole workers), in order of arrival; `info["env_id"]` says whose.

        Raises:
            BusError: a worker or the broker was lost, within the liveness timeout.
        """
        self.raise_failure()
        waiting = [s for s in self.slots if s.asked or s.result is not None]
        if not waiting:
            raise ValueError("recv() with nothing sent: send() first")
        ready: list[Slot] = []
        while sum(s.member.rows for s in ready) < self.batch_size:
            ready += [s for s in self.arrived() if s not in ready]
            if ready and not any(s.asked for s in self.slots):
                break
            if sum(s.member.rows for s in ready) < self.batch_size:
                self.wait_one()
        return self.take(ready, with_ids=True)

    def split(self, ids: np.ndarray) -> list[tuple[Slot, np.ndarray]]:
        """Each worker's positions in `ids`, its rows in order."""
        found = []
        for slot in self.slots:
            inside = np.flatnonzero((ids >= slot.offset) & (ids < slot.offset + slot.member.rows))
            if not len(inside):
                continue
            if len(inside) != slot.member.rows or slot.asked or slot.result is not None:
                raise ValueError(f"env ids {slot.offset}-{slot.offset + slot.member.rows - 1} "
                                 "step together (one worker), and only once recv() gave "
                                 "them back")
            found.append((slot, inside[np.argsort(ids[inside])]))
        if sum(len(r) for _, r in found) != len(ids):
            raise ValueError(f"env ids must be 0 to {self.num_envs - 1}, each once")
        return found

    # -- waiting on workers
    def ask(self, slot: Slot, msg: p.Message) -> None:
        slot.asked, slot.resetting = True, isinstance(msg, p.Reset)
        self.link.send(msg)

    def collect(self, slots: Sequence[Slot]) -> None:
        """Wait until every slot in `slots` has its answer."""
        while any(s.asked for s in slots):
            self.wait_one()

    def arrived(self) -> list[Slot]:
        return [s for s in self.slots if s.result is not None]

    def wait_one(self) -> None:
        """Take the next message in; a lost worker or broker is raised (and remembered)."""
        try:
            msg = self.link.recv()
        except BusError as exc:
            self.failure = exc
            raise
        if isinstance(msg, p.StepResult):
            slot = self.slot_of(msg.worker)
            # A STEP's result still on its way when a worker was lost and the env attached
            # again is not the answer to the RESET that followed (nor the other way round).
            if slot is not None and slot.asked and msg.first == slot.resetting:
                slot.asked, slot.result = False, msg
        elif isinstance(msg, p.WorkerLost):
            slot = self.slot_of(msg.worker)
            if slot is not None and msg.incarnation in ("", slot.member.incarnation):
                self.failure = WorkerLost(msg.worker, msg.reason)
        elif isinstance(msg, p.EnvCallResult):
            self.calls.took(msg)
        self.raise_failure()

    def settle(self) -> None:
        """Before a reset: answers still out are waited for and dropped."""
        self.collect(self.slots)
        for slot in self.slots:
            slot.result = None

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def slot_of(self, worker: str) -> Slot | None:
        return next((s for s in self.slots if s.member.name == worker), None)

    # -- results as Gymnasium gives them
    def take(self, slots: Sequence[Slot], *, with_ids: bool
             ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The answers of `slots`, in that order, as one batch (and they are handed over)."""
        results = []
        for slot in slots:
            assert slot.result is not None
            results.append(slot.result)
            slot.obs, slot.result = slot.result.obs, None
        obs = self.user_obs(rows.concat([r.obs for r in results]))
        reward = np.concatenate([r.reward for r in results]).astype(np.float64)
        terminated = np.concatenate([r.terminated for r in results])
        truncated = np.concatenate([r.truncated for r in results])
        ended = terminated | truncated
        same_step = self.autoreset_mode is AutoresetMode.SAME_STEP
        if self.with_infos:
            self.last_infos = self.infos.env_infos(results)
        else:  # SAME_STEP's final observations travel all the same, with empty final infos
            self.last_infos = infos_of.EnvInfos([None] * len(ended),
                                                [{} if e and same_step else None for e in ended])
        final_obs = self.final_obs(results, ended) if same_step and ended.any() else None
        info = infos_of.layout(self.last_infos, final_obs)
        if with_ids:
            info["env_id"] = np.concatenate([s.ids for s in slots]).astype(np.int32)
        return obs, reward, terminated, truncated, info

    def final_obs(self, results: Sequence[p.StepResult], ended: np.ndarray) -> list[Any]:
        """Each env's final observation as Gymnasium gives it (None where nothing ended)."""
        finals = rows.concat([r.final_obs for r in results])
        out: list[Any] = [None] * len(ended)
        for j, i in enumerate(np.flatnonzero(ended)):
            out[i] = self.user_obs(rows.copy(rows.take(finals, j)))
        return out

    def user_obs(self, obs: p.Obs) -> Any:
        """Observations as Gymnasium batches them: a Box as one array, other spaces nested as
        their Dicts and Tuples; a copy (the received frames are read-only)."""
        copied = rows.copy(obs)
        if not isinstance(copied, dict):
            return copied
        return spaces.structured(self.spec_msg.spec, copied)

    # -- attributes of the envs
    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """`name(*args, **kwargs)` on every env (an attribute's value if not callable), as
        SyncVectorEnv.call; arguments and results must be data (JSON, numeric arrays).

        Raises:
            TypeError: an argument or result that is not data (nothing is pickled).
            BusError: a worker or the broker was lost.
        """
        return self.env_call("call", name, list(args), kwargs, [])

    def get_attr(self, name: str) -> tuple[Any, ...]:
        return self.env_call("get_attr", name, [], {}, [])

    def set_attr(self, name: str, values: Any) -> None:
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(f"{len(values)} values for {self.num_envs} environments")
        self.env_call("set_attr", name, [], {}, list(values))

    def env_call(self, op: str, name: str, args: list[Any], kwargs: dict[str, Any],
                 values: list[Any]) -> tuple[Any, ...]:
        self.raise_failure()
        if any(s.asked or s.result is not None for s in self.slots):
            raise ValueError(f"{op} while envs are stepping: recv() their results first")
        asks = [self.calls.ask(s.member.name, op, name, args, kwargs,
                               values[s.offset:s.offset + s.member.rows]) for s in self.slots]
        for msg in asks:  # all encoded first: an argument that is not data sends nothing
            self.link.send(msg)
        while not self.calls.complete():
            self.wait_one()
        return self.calls.results([s.member.name for s in self.slots])

    def close_extras(self, **kwargs: Any) -> None:
        try:
            self.link.close()
        finally:
            if self.on_close is not None:
                self.on_close()


def _seeds(seed: int | Sequence[int | None] | None, n: int) -> list[int | None]:
    """Gymnasium's rule: None for all, s + i for an int, or one per env."""
    if seed is None:
        return [None] * n
    if isinstance(seed, (int, np.integer)):
        seeds: list[int | None] = [int(seed) + i for i in range(n)]
    else:
        seeds = [None if s is None else int(s) for s in seed]
    if len(seeds) != n:
        raise ValueError(f"If seeds are passed as a list the length must match num_envs={n} "
                         f"but got length={len(seeds)}.")
    if any(s is not None and not 0 <= s < 2**63 for s in seeds):
        raise ValueError(f"seeds must be None or 0 to 2**63 - 1, got {seeds}")
    return seeds


def _check_options(options: dict[str, Any]) -> None:
    """Reset options travel as JSON data: checked as the worker's decoder will check them,
    before anything is sent (a refused RESET would never be answered).

    Raises:
        TypeError: options that are not JSON data, or nest too deep.
    """
    try:
        p.decode(p.encode(p.Reset(epoch=0, seq=0, options=options)))
    except (p.ProtocolError, TypeError, ValueError) as exc:
        raise TypeError(f"reset options must be JSON data (str keys, at most "
                        f"{p.MAX_JSON_DEPTH} containers deep): {exc}") from None


def _reset_mask(mask: Any, n: int) -> np.ndarray:
    """SyncVectorEnv's checks of `options["reset_mask"]`; all envs without one."""
    if mask is None:
        return np.ones(n, bool)
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
    if mask.shape != (n,):
        raise ValueError(f"`options['reset_mask']` must have shape `({n},)`, got {mask.shape}")
    if mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
    if not mask.any():
        raise ValueError("`options['reset_mask']` must contain a boolean array with at least "
                         f"one True value, got reset_mask={mask}")
    return mask
