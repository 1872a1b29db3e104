"""An environment worker: K environments, one DEALER to the broker, one reply per action batch.

The worker never decides anything: it announces its spaces (WORKER_HELLO, repeated while it
waits, so a restarted broker learns of it), resets when told, and steps when told. Episodes
autoreset in the same step; the observation an episode ended on travels in `final_obs`.

Liveness: heartbeats (to the broker and the controller) go out between env calls, and during
one long env call from a SIGALRM handler, armed only while a batch is stepped and acting only
while env code runs. So a slow env looks busy, not dead; only a single C call that never returns
to Python (holding the GIL) still looks dead. The worker owns SIGALRM: an env must not use it.
An env that keeps raising is recreated up to --max-env-restarts-per-minute times, then the
worker exits 1 with one line saying so.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import socket as pysocket
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import zmq
from stepbus.bus import node, shm, wiring
from stepbus.bus import protocol as p
from stepbus.workers.envs import (
    agents_of,
    episode_seed,
    make_env,
    seed_spaces,
    space_spec,
)

T = TypeVar("T")

# While env code runs, SIGALRM fires this often and sends the busy heartbeats. Half the
# heartbeat interval, so a beat skipped by the rate limits still leaves the next one in time.
BUSY_BEAT_S = node.HEARTBEAT_INTERVAL_S / 2
RESTART_WINDOW_S = 60.0  # --max-env-restarts-per-minute counts recreations within this window


def _default_name() -> str:
    return os.environ.get("HONCHO_PROCESS_NAME") or f"worker-{pysocket.gethostname()}-{os.getpid()}"


def _default_index() -> int:
    """honcho names workers worker.1, worker.2, ...: index 0, 1, ..."""
    name = os.environ.get("HONCHO_PROCESS_NAME", "")
    suffix = name.rpartition(".")[2]
    return int(suffix) - 1 if suffix.isdigit() else 0


@dataclass
class Config:
    env: str = field(default="CartPole-v1", metadata={
        "help": "Gymnasium id, or module:callable returning a Gymnasium env or a PettingZoo "
                "ParallelEnv (e.g. mpe2.simple_spread_v3:parallel_env)"})
    envs_per_worker: int = field(default=8, metadata={"help": "environments hosted (K)"})
    seed: int = field(default=0, metadata={
        "help": "base seed; episode e of env i of worker w is reset with a seed derived from "
                "(seed, w, i, e)"})
    worker_index: int = field(default_factory=_default_index, metadata={
        "help": "w in the seed derivation (default: from honcho's worker.N, else 0)"})
    name: str = field(default_factory=_default_name, metadata={
        "help": "unique worker name (default: honcho's process name, else host and pid)"})
    steps: str = wiring.discovered("steps", "broker endpoint to connect (default: where the "
                                   "controller says the broker bound it)")
    controller: str = wiring.endpoint("controller", "controller endpoint to connect")
    broadcast: str = wiring.discovered("broadcast", "controller broadcast endpoint to connect "
                                       "(default: where the controller says it bound it)")
    max_env_restarts_per_minute: int = field(default=10, metadata={
        "help": "env recreations (after an env raised) allowed within 60 s; one more makes the "
                "worker exit 1, since an env that keeps raising needs fixing, not retrying"})
    shm_frames: bool = field(default=False, metadata={
        "help": "observations through a shared-memory segment in /dev/shm when the broker "
                "(and the assembler) run on this host and can map it; ZeroMQ then carries only "
                "a slot number. Otherwise, and whenever the assembler lags 16 batches behind "
                "for 20 ms, they go on the socket as without this flag"})
    security: wiring.Security = field(default_factory=wiring.Security)


class EnvFailure(RuntimeError):
    """Environments keep raising (or cannot be recreated): the worker cannot go on."""


class EnvSet:
    """K environments stepped together; an env that raises is reported and recreated, up to
    `max_env_restarts_per_minute` times within 60 s.

    `report` receives each error as data; `tick` is called between envs in resets and
    multi-agent steps so a slow batch keeps the worker's heartbeat going. `in_env` is True
    while env code (or a single-agent step's loop around it) runs and no ZeroMQ call is under
    way, so a timer signal knows when it may send heartbeats itself (see `run`).
    """

    def __init__(self, cfg: Config, report: Callable[[p.RemoteError], None], log,
                 tick: Callable[[], None] = lambda: None) -> None:
        self.cfg, self.report, self.log, self.tick = cfg, report, log, tick
        self.in_env = False
        self.restarts: collections.deque[float] = collections.deque()  # recent recreations
        self.envs = [self._env_call(make_env, cfg.env) for _ in range(cfg.envs_per_worker)]
        self.spec = space_spec(self.envs[0])
        self.agents = agents_of(self.envs[0])  # names ([] for Gymnasium envs)
        # The env's own agent keys (PettingZoo allows any hashable) -> row within an env.
        self.agent_keys = list(self.envs[0].possible_agents) if self.agents else []
        self.agent_row = {agent: j for j, agent in enumerate(self.agent_keys)}
        self.width = max(1, len(self.agents))  # rows per env
        self.rows = len(self.envs) * self.width
        self.alive = np.ones(self.rows, bool)  # which rows act next (multi-agent envs)
        self.obs_dtype = np.dtype(self.spec.obs_dtype)
        self.episode = np.full(len(self.envs), -1, np.int64)  # each env's current episode
        self.episode_seed = np.zeros(len(self.envs), np.int64)  # ... and its reset seed
        self.last_obs = np.zeros((self.rows, *self.spec.obs_shape), self.obs_dtype)
        self.errors = 0
        self.agents_vanished = 0  # agents that left an episode without a done flag
        self.without_options: set[int] = set()  # envs that rejected the current reset options
        low, high = self.spec.action_low, self.spec.action_high
        self.action_bounds = (np.asarray(low), np.asarray(high)) if low else None

    def reset(self, options: dict) -> np.ndarray:
        if self.agents:
            return self._reset_parallel(options)
        obs = np.empty_like(self.last_obs)
        self.without_options.clear()
        for i, env in enumerate(self.envs):
            try:
                obs[i] = self._env_call(env.reset, seed=self._new_episode(i),
                                        options=options or None)[0]
            except Exception as exc:  # e.g. options this env rejects: report, go on without
                # Rejected options are the operator's doing, bounded by barriers: not counted.
                obs[i] = self._recreate(i, exc, {}, counted=not options)
                self.without_options.add(i)  # its later autoresets too, until the next barrier
            self.tick()
        self.last_obs = obs
        return obs

    def step(self, actions: np.ndarray, options: dict,
             out: np.ndarray | None = None) -> p.StepResult:
        """`out`: where the observations go (a shared-memory slot), not a new array."""
        if self.agents:
            return self._step_parallel(actions, options, out)
        k = len(self.envs)
        obs = np.empty_like(self.last_obs) if out is None else out
        reward = np.zeros(k, np.float32)
        terminated = np.zeros(k, bool)
        truncated = np.zeros(k, bool)
        finals: list[np.ndarray] = []
        if self.action_bounds is not None:
            shape = (k, *self.spec.action_shape)
            actions = np.clip(actions.reshape(k, -1), *self.action_bounds).reshape(shape)
        # The hot loop: no ZeroMQ call in it but _recreate's report, so `in_env` holds for the
        # whole batch and the busy-beat alarm (armed around every batch) keeps the heartbeats
        # going; a wrapper call and a tick per env cost 10% of a CartPole worker's time.
        self.in_env = True
        try:
            for i, env in enumerate(self.envs):
                try:
                    obs[i], reward[i], terminated[i], truncated[i], _ = env.step(actions[i])
                except Exception as exc:  # the env's fault, not ours: cut the episode, go on
                    obs[i], truncated[i] = self.last_obs[i], True
                    finals.append(obs[i].copy())
                    obs[i] = self._recreate(i, exc, self._options_for(i, options) or {})
                    continue
                if terminated[i] or truncated[i]:
                    finals.append(obs[i].copy())
                    try:
                        obs[i] = env.reset(seed=self._new_episode(i),
                                           options=self._options_for(i, options))[0]
                    except Exception as exc:
                        obs[i] = self._recreate(i, exc, {})
        finally:
            self.in_env = False
        self.last_obs = obs
        final_obs = (np.stack(finals) if finals
                     else np.zeros((0, *self.spec.obs_shape), self.obs_dtype))
        return p.StepResult(incarnation="", epoch=0, seq=0, first=False, obs=obs, reward=reward,
                            terminated=terminated, truncated=truncated, final_obs=final_obs,
                            **self.episodes())

    def _new_episode(self, i: int) -> int:
        """Env i starts its next episode: the seed to reset it (and its spaces) with."""
        self.episode[i] += 1
        seed = episode_seed(self.cfg.seed, self.cfg.worker_index, i, int(self.episode[i]))
        self.episode_seed[i] = seed
        seed_spaces(self.envs[i], seed)
        return seed

    def episodes(self) -> dict[str, np.ndarray]:
        """Each row's episode index and reset seed, for a STEP_RESULT."""
        return {"episode": np.repeat(self.episode, self.width),
                "episode_seed": np.repeat(self.episode_seed, self.width)}

    # PettingZoo parallel envs: row base + j is agent j of env u (base = u * width). Only alive
    # rows act; an env whose agents are all done resets within the same step, as above.

    def _reset_parallel(self, options: dict) -> np.ndarray:
        obs, alive = np.zeros_like(self.last_obs), np.zeros(self.rows, bool)
        self.without_options.clear()
        for u, env in enumerate(self.envs):
            try:
                first = self._env_call(env.reset, seed=self._new_episode(u),
                                       options=options or None)[0]
            except Exception as exc:
                first = self._recreate(u, exc, {}, counted=not options)
                self.without_options.add(u)
            self._place(u, first, obs, alive)
            self.tick()
        self.last_obs, self.alive = obs, alive
        return obs

    def _step_parallel(self, actions: np.ndarray, options: dict,
                       out: np.ndarray | None = None) -> p.StepResult:
        if out is None:
            obs = np.zeros_like(self.last_obs)
        else:
            out.fill(0)
            obs = out
        alive = np.zeros(self.rows, bool)
        reward = np.zeros(self.rows, np.float32)
        terminated, truncated = np.zeros(self.rows, bool), np.zeros(self.rows, bool)
        finals: list[np.ndarray] = []  # in row order, as the ended rows
        if self.action_bounds is not None:
            shape = (self.rows, *self.spec.action_shape)
            actions = np.clip(actions.reshape(self.rows, -1), *self.action_bounds).reshape(shape)
        for u, env in enumerate(self.envs):
            base = u * self.width
            acting = [a for a in self.agent_keys if self.alive[base + self.agent_row[a]]]
            try:
                nxt, rew, term, trunc, _ = self._env_call(
                    env.step, {a: actions[base + self.agent_row[a]] for a in acting})
            except Exception as exc:  # the env's fault: cut every acting agent's episode
                for a in acting:
                    i = base + self.agent_row[a]
                    truncated[i] = True
                    finals.append(self.last_obs[i].copy())
                self._place(u, self._recreate(u, exc, self._options_for(u, options)), obs,
                            alive)
                continue
            finally:
                self.tick()
            # Acting next: in env.agents, observed, and not done this step (an env may keep
            # done agents listed). An agent that acted and is none of these nor done vanished:
            # its episode is cut here (truncated, from the observation the env gave, if any).
            going_on = {a for a in env.agents
                        if a in nxt and not (term.get(a, False) or trunc.get(a, False))}
            for a in acting:
                i = base + self.agent_row[a]
                reward[i] = rew.get(a, 0.0)
                terminated[i], truncated[i] = bool(term.get(a, False)), bool(trunc.get(a, False))
                if not (terminated[i] or truncated[i]) and a not in going_on:
                    truncated[i] = True  # vanished
                    self.agents_vanished += 1
                if terminated[i] or truncated[i]:
                    finals.append(np.array(nxt.get(a, self.last_obs[i]), self.obs_dtype))
            if not going_on:  # all done: the next episode starts within this step
                try:
                    nxt = self._env_call(env.reset, seed=self._new_episode(u),
                                         options=self._options_for(u, options))[0]
                except Exception as exc:
                    nxt = self._recreate(u, exc, {})
                going_on = set(self.envs[u].agents)
            self._place(u, nxt, obs, alive, going_on)
        self.last_obs, self.alive = obs, alive
        final_obs = (np.stack(finals) if finals
                     else np.zeros((0, *self.spec.obs_shape), self.obs_dtype))
        return p.StepResult(incarnation="", epoch=0, seq=0, first=False, obs=obs, reward=reward,
                            terminated=terminated, truncated=truncated, final_obs=final_obs,
                            alive=alive, **self.episodes())

    def _options_for(self, u: int, options: dict) -> dict | None:
        """An env that rejected the barrier's options goes on without them."""
        return None if u in self.without_options else options or None

    def _place(self, u: int, observations: dict, obs: np.ndarray, alive: np.ndarray,
               agents: set | None = None) -> None:
        """Env u's acting agents' observations into their rows; those rows are alive."""
        base = u * self.width
        for agent in self.envs[u].agents:
            j = self.agent_row.get(agent)
            if j is not None and agent in observations and (agents is None or agent in agents):
                obs[base + j] = observations[agent]
                alive[base + j] = True

    def alive_rows(self) -> np.ndarray | None:
        """The alive mask to send (None for single-agent envs: every row is alive)."""
        return self.alive.copy() if self.agents else None

    def _env_call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run env code with `in_env` set: only then may the timer signal send heartbeats,
        because only then is this thread surely not inside a ZeroMQ call of its own."""
        was, self.in_env = self.in_env, True
        try:
            return fn(*args, **kwargs)
        finally:
            self.in_env = was

    def _recreate(self, i: int, exc: Exception, options: dict, *, counted: bool = True) -> Any:
        """Report the error, replace env i, and return its first observation (a map by agent
        for a parallel env); past the restart
        bound, raise EnvFailure instead (one line for the operator, not endless tracebacks)."""
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
                context={"env": self.cfg.env, "env_index": i, "episode": episode,
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
            self._env_call(self.envs[i].close)
        seed = self._new_episode(i)
        try:
            self.envs[i] = self._env_call(make_env, self.cfg.env)
            seed_spaces(self.envs[i], seed)
            return self._env_call(self.envs[i].reset, seed=seed, options=options or None)[0]
        except Exception as again:
            raise EnvFailure(f"env {i} ({self.cfg.env}) raised again while being recreated: "
                             f"{type(again).__name__}: {again}") from again

    def actions_problem(self, actions: np.ndarray) -> str:
        """Why an action batch cannot be stepped (empty if it can)."""
        k, spec = self.rows, self.spec
        if spec.action_kind == "discrete":
            if actions.shape != (k,) or actions.dtype.kind not in "iu":
                return f"expected {k} integer actions, got {actions.dtype} {actions.shape}"
            if actions.size and not (actions.min() >= 0 and actions.max() < spec.action_n):
                return f"actions outside [0, {spec.action_n})"
        elif actions.shape != (k, *spec.action_shape) or actions.dtype.kind != "f":
            return f"expected float actions of shape {(k, *spec.action_shape)}, got {actions.shape}"
        return ""

    def close(self) -> None:
        for env in self.envs:
            env.close()


class BusyBeats:
    """`with BUSY_BEATS:` raises SIGALRM every BUSY_BEAT_S while a batch is being stepped, so an
    env call longer than the liveness timeout still lets the handler `run` installs send
    heartbeats. Armed only around env work (two setitimer calls per batch, about 1 us), so no
    signal interrupts the worker while it waits on ZeroMQ. A class, not a generator-based
    context manager, because that costs twice as much on every batch."""

    def __enter__(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, BUSY_BEAT_S, BUSY_BEAT_S)

    def __exit__(self, *exc_info: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)


BUSY_BEATS = BusyBeats()


def run(cfg: Config) -> int:
    log = node.setup_logging("worker")
    stop = node.StopFlag()
    ctx = wiring.context(cfg.security)
    link = node.ControllerLink(ctx, role="worker", name=cfg.name, controller=cfg.controller,
                               broadcast=cfg.broadcast, log=log)
    # On another host a worker needs only the controller's address: it says where the rest is.
    steps = cfg.steps or link.discover("steps", stop)
    if not steps:
        link.close()
        wiring.destroy(ctx, wiring.LINGER_MS)
        return 0  # told to stop while waiting
    # While no broker is connected, hellos are dropped rather than queued to flood it later.
    dealer = wiring.socket(ctx, zmq.DEALER, connect=steps, identity=cfg.name.encode(),
                           immediate=True)
    rejects = node.RejectLog(log)
    busy_beat = [0.0]

    def report(error: p.RemoteError) -> None:
        link.send(error)  # the controller logs it for the operator
        node.send(dealer, error, block=False)  # the broker, for a running reset barrier

    def tick() -> None:
        now = time.monotonic()
        link.beat(now)  # the controller too must not take a slow batch for a dead worker
        if now - busy_beat[0] >= node.HEARTBEAT_INTERVAL_S:  # a slow batch is not a dead worker
            busy_beat[0] = now
            node.send(dealer, p.Heartbeat(role="worker", name=cfg.name, host=link.host,
                                          pid=link.pid, leaving=False, figures={}), block=False)

    try:
        envs = EnvSet(cfg, report, log, tick)
    except Exception as exc:  # a typo in --env deserves one clear line, not a traceback
        log.error("cannot create environment %r: %s: %s", cfg.env, type(exc).__name__, exc)
        link.close()
        wiring.destroy(ctx, wiring.LINGER_MS)
        return 2

    def on_alarm(signum: int, frame: Any) -> None:
        # Python runs this in this (the main) thread between bytecodes. Inside env code we are
        # not inside a ZeroMQ call, so our sends cannot interleave with a half-sent message.
        # Limit: a single C call that never returns to Python leaves no bytecode to run it in.
        if envs.in_env:
            envs.in_env = False  # an alarm during these sends must not interleave its own
            try:
                tick()
            finally:
                envs.in_env = True

    signal.signal(signal.SIGALRM, on_alarm)
    # Blocking C calls inside an env (a simulator's read, usleep) restart instead of failing
    # with EINTR; Python-level sleeps still run the handler (PEP 475).
    signal.siginterrupt(signal.SIGALRM, False)
    incarnation = uuid.uuid4().hex[:8]
    segment: shm.Writer | None = None
    if cfg.shm_frames:
        try:
            if shm.remove_orphans(cfg.name):
                log.info("removed shared-memory segments of earlier, dead incarnations")
            segment = shm.Writer(shm.segment_name(cfg.name, incarnation), envs.rows,
                                 tuple(envs.spec.obs_shape), envs.obs_dtype)
        except OSError as exc:
            log.warning("--shm-frames: cannot create a segment in %s (%s); observations go on "
                        "the socket", shm.DIR, exc)
    hello = p.WorkerHello(worker=cfg.name, incarnation=incarnation, env_id=cfg.env,
                          num_envs=cfg.envs_per_worker, seed=cfg.seed,
                          spec=dataclasses.asdict(envs.spec), seq=0, agents=envs.agents,
                          shm=segment.name if segment else "",
                          shm_nonce=segment.nonce.hex() if segment else "")
    use_shm = False  # the broker marked our segment (before its RESET) as mapped
    shm_counts = {"shm_batches": 0, "shm_full": 0}
    no_rows = np.zeros((0, *envs.spec.obs_shape), envs.obs_dtype)
    epoch, options, seq = -1, {}, 0
    steps_done = 0
    acting_version = -1  # the policy version that chose the last actions (for status lag)
    log.info("%s: %d x %s%s, connecting to %s", cfg.name, cfg.envs_per_worker, cfg.env,
             f" ({len(envs.agents)} agents each)" if envs.agents else "", steps)

    def reply(result: p.StepResult) -> None:
        node.send(dealer, dataclasses.replace(result, incarnation=incarnation, epoch=epoch,
                                              seq=seq), block=False)

    def figures() -> dict:
        return {"env_steps": steps_done, "env_errors": envs.errors,
                "policy_version": acting_version,
                "agents_vanished": envs.agents_vanished, **rejects.figures(),
                **(shm_counts | {"shm_reclaimed": segment.reclaimed} if segment else {})}

    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    for sock in link.sockets():
        poller.register(sock, zmq.POLLIN)
    last_heard = 0.0
    try:
        while not stop and not link.shutdown_reason:
            now = time.monotonic()
            if now - last_heard >= node.HEARTBEAT_INTERVAL_S:
                # registration and liveness; `seq` lets a new broker continue our numbering
                node.send(dealer, dataclasses.replace(hello, seq=seq), block=False)
                last_heard = now
            link.beat(now, figures)
            events = dict(poller.poll(node.MAX_POLL_MS))
            link.poll(events)
            if dealer not in events:
                continue
            for _ in range(100):
                if not dealer.poll(0, zmq.POLLIN):
                    break
                _, msg = node.recv(dealer, rejects)
                last_heard = time.monotonic()
                busy_beat[0] = last_heard
                if isinstance(msg, p.Step) and msg.epoch == epoch:
                    problem = envs.actions_problem(msg.actions)
                    if problem:
                        rejects.refuse("broker", p.ProtocolError("bad actions", problem))
                        continue
                    seq, acting_version = msg.seq, msg.policy_version
                    acting = int(envs.alive.sum())  # agent steps this batch takes
                    slot = segment.acquire() if segment is not None and use_shm else -1
                    with BUSY_BEATS:
                        result = envs.step(msg.actions, options,
                                           None if slot < 0 else segment.views[slot])
                    if slot >= 0:
                        segment.publish(slot, seq)
                        result = dataclasses.replace(result, obs=no_rows, obs_slot=slot)
                        shm_counts["shm_batches"] += 1
                    elif use_shm:
                        shm_counts["shm_full"] += 1  # every slot still read: the socket it is
                    reply(result)
                    steps_done += acting
                    last_heard = time.monotonic()
                elif isinstance(msg, p.Reset):
                    epoch, options, seq = msg.epoch, msg.options, msg.seq
                    use_shm = segment is not None and segment.take_broker_mark()
                    with BUSY_BEATS:
                        obs = envs.reset(options)
                    k = envs.rows
                    reply(p.StepResult(
                        incarnation="", epoch=0, seq=0, first=True, obs=obs,
                        reward=np.zeros(k, np.float32), terminated=np.zeros(k, bool),
                        truncated=np.zeros(k, bool), final_obs=obs[:0],
                        alive=envs.alive_rows(), **envs.episodes()))
        log.info("%s stopping (%s) after %d env steps", cfg.name,
                 link.shutdown_reason or stop.reason, steps_done)
        return 0
    except EnvFailure as exc:
        log.error("%s; worker exiting", exc)
        return 1
    finally:
        if segment is not None:
            segment.close()
        link.close()
        envs.close()
        wiring.destroy(ctx, wiring.LINGER_MS)
