"""An environment worker: K environments, one DEALER to the broker, one reply per action batch.

The worker never decides anything: it announces its spaces (WORKER_HELLO, repeated while the
broker is silent, so a restarted broker learns of it), resets when told, and steps when told.
Episodes autoreset in the same step; the observation an episode ended on travels in
`final_obs` (see `envset`).

Liveness: heartbeats (to the broker and the controller) go out between env calls, and during
one long env call from a thread of their own, which may use the worker's sockets only while env
code runs (a lock the main thread holds at every other time). So a slow env looks busy, not
dead; only a single C call that holds the GIL and never returns still looks dead.
An env that keeps raising is recreated up to --max-env-restarts-per-minute times, then the
worker exits 1 with one line saying so.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
import socket as pysocket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from stepbus.bus import checks, lane, node, rows, shm, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.exits import Exit
from stepbus.bus.lane import Lane
from stepbus.bus.topology import PortName, Role
from stepbus.workers import calls, envs
from stepbus.workers.envset import EnvFailure, EnvSet

__all__ = ["BusyBeats", "Config", "EnvFailure", "EnvSet", "Worker", "run"]

# While env code runs, the heartbeat thread looks this often whether a busy heartbeat is due.
# Half the heartbeat interval, so a beat skipped by the rate limits still leaves the next one in
# time.
BUSY_BEAT_S = node.HEARTBEAT_INTERVAL_S / 2
# A broker silent this long hears our hello again (registration, liveness, our numbering).
HELLO_INTERVAL_S = node.HEARTBEAT_INTERVAL_S
# Until a broker first answers, and for the first seconds only, hellos go out this often: the
# first ones are dropped while the connection is still being made (the DEALER is `immediate`),
# which at the hello interval cost every honcho start 0.5 s. A broker that refuses our spaces,
# or a vector client that has not reset yet, never answers: after FIRST_HELLOS_FOR_S the
# interval is the usual one.
FIRST_HELLO_INTERVAL_S = node.DISCOVER_INTERVAL_S
FIRST_HELLOS_FOR_S = node.DISCOVER_QUICK_FOR_S
# After a stall, how long a due hello waits: one poll, which reads what arrived meanwhile.
READ_FIRST_S = 0.005
# Double buffering (--splits): a handful of groups hides the inference round trip (Sample
# Factory uses 2); one digit keeps the splits' names sorting in env order (deterministic mode
# batches workers by name).
MAX_SPLITS = 9


def _default_name() -> str:
    return os.environ.get("HONCHO_PROCESS_NAME") or f"worker-{pysocket.gethostname()}-{os.getpid()}"


def _default_index() -> int:
    """honcho names workers worker.1, worker.2, ...: index 0, 1, ..."""
    name = os.environ.get("HONCHO_PROCESS_NAME", "")
    suffix = name.rpartition(".")[2]
    return int(suffix) - 1 if suffix.isdigit() else 0


@dataclass
class Config:
    env: str = envs.env_field()
    env_kwargs: str = envs.env_kwargs_field()
    envs_per_worker: int = field(default=8, metadata={
        "min": 1, "max": checks.MAX_ENVS_PER_WORKER, "help": "environments hosted (K)"})
    seed: int = field(default=0, metadata={"min": 0,
        "help": "base seed; episode e of env i of worker w is reset with a seed derived from "
                "(seed, w, i, e)"})
    worker_index: int = field(default_factory=_default_index, metadata={"min": 0,
        "help": "w in the seed derivation (default: from honcho's worker.N, else 0)"})
    name: str = field(default_factory=_default_name, metadata={
        "help": "unique worker name (default: honcho's process name, else host and pid)"})
    steps: str = wiring.discovered("steps", "broker endpoint to connect (default: where the "
                                   "controller says the broker bound it)")
    controller: str = wiring.endpoint("controller", "controller endpoint to connect")
    broadcast: str = wiring.discovered("broadcast", "controller broadcast endpoint to connect "
                                       "(default: where the controller says it bound it)")
    max_env_restarts_per_minute: int = field(default=10, metadata={"min": 0,
        "help": "env recreations (after an env raised) allowed within 60 s; one more makes the "
                "worker exit 1, since an env that keeps raising needs fixing, not retrying"})
    episode_statistics: bool = field(default=False, metadata={
        "help": "wrap each env in Gymnasium's RecordEpisodeStatistics, so a vector env's "
                "infos carry `episode` (r, l, t) at each episode's end"})
    shm_frames: bool = field(default=True, metadata={
        "help": "observations (every leaf of any space) through a shared-memory segment in "
                "/dev/shm when a batch of them is at least --shm-min-batch-bytes and the steps "
                "endpoint is on this host "
                "(ipc or loopback), where the broker (and the assembler) can map it; ZeroMQ "
                "then carries only a slot number. Otherwise, and whenever the assembler lags "
                "16 batches behind for 20 ms, they go on the socket, as with --no-shm-frames"})
    shm_min_batch_bytes: int = field(default=shm.MIN_BATCH_BYTES, metadata={
        "min": 0, "help": "the smallest batch of observations that goes through shared memory, "
                          "in bytes: one observation's times the batch's rows (its envs, times "
                          "the agents of a multi-agent env; with --splits, a split's); smaller "
                          "ones cost more to pass there than on the socket (0: every batch)"})
    splits: int = field(default=1, metadata={"min": 1, "max": MAX_SPLITS,
        "help": "groups the envs are divided into (double buffering, as Sample Factory's "
                "worker_num_splits): each group is a worker of its own to the broker (named "
                "NAME:0, NAME:1, ...; agent ids and env seeds stay the whole worker's), and one "
                "group steps while the others wait for their actions"})
    lane: str = field(default="", metadata={
        "help": "PREFIX of the two named pipes (PREFIX.in, PREFIX.out) a vector env on this "
                "host made for this worker: what the env asks of it and its answers go there "
                "instead of the steps socket, which keeps its hellos and heartbeats "
                "(`stepbus.vector.make` passes it; empty: none)"})
    security: wiring.Security = field(default_factory=wiring.Security)


class CannotCreateEnv(RuntimeError):
    """`--env` names nothing that can be made (a typo, a missing package), or a setting is out
    of range: exit 2."""


def make_envs(cfg: Config, log: logging.Logger) -> EnvSet:
    """The worker's environments, made before it looks for a controller or broker, so a bad
    `--env` or `--envs-per-worker` is told at once, as what it is. Raises CannotCreateEnv."""
    if not 1 <= cfg.envs_per_worker <= checks.MAX_ENVS_PER_WORKER:
        raise CannotCreateEnv(f"--envs-per-worker must be 1 to {checks.MAX_ENVS_PER_WORKER}, "
                              f"not {cfg.envs_per_worker}")
    try:
        envs.env_kwargs(cfg.env_kwargs)
    except ValueError as exc:
        raise CannotCreateEnv(f"--env-kwargs: {exc}") from None
    try:
        return EnvSet(cfg, lambda error: None, log)
    except Exception as exc:
        raise CannotCreateEnv(f"cannot create environment {cfg.env!r}: "
                              f"{type(exc).__name__}: {exc}") from exc


def split_sizes(envs: int, splits: int) -> list[int]:
    """Envs per split, as even as can be, the larger first."""
    return [envs // splits + (i < envs % splits) for i in range(splits)]


def split_name(name: str, index: int) -> str:
    return f"{name}:{index}"


def make_split_envs(cfg: Config, log: logging.Logger) -> list[EnvSet]:
    """One env set per split (`--splits`), env i of the worker in the split that holds its
    index, so it gets the seeds it gets unsplit. Raises CannotCreateEnv."""
    if cfg.splits == 1:
        return [make_envs(cfg, log)]
    if not 1 <= cfg.splits <= min(MAX_SPLITS, cfg.envs_per_worker):
        raise CannotCreateEnv(f"--splits must be 1 to {MAX_SPLITS} and at most "
                              f"--envs-per-worker ({cfg.envs_per_worker}), not {cfg.splits}")
    made: list[EnvSet] = []
    first = 0
    try:
        for i, k in enumerate(split_sizes(cfg.envs_per_worker, cfg.splits)):
            made.append(make_envs(dataclasses.replace(
                cfg, envs_per_worker=k, name=split_name(cfg.name, i), splits=1), log))
            made[-1].first_env, first = first, first + k
    except BaseException:
        for group in made:
            group.close()
        raise
    return made


class BusyBeats:
    """A thread that sends a worker's busy heartbeats while its env code runs, however long one
    env call takes, as long as the call lets the GIL go now and then (Python code does, every
    5 ms; so do sleeps, I/O and most C libraries' long calls). The worker's main thread holds
    `gate` at all times but while env code runs (`EnvSet.in_env`), so the thread, which only
    tries the gate, never uses a socket the main thread is using: ZeroMQ allows a socket to
    change threads across a full memory barrier, which the lock is. A thread, not a timer
    signal: a signal handler runs only between bytecodes of the main thread, so it could not
    beat through a long C call, and it took SIGALRM away from the env."""

    def __init__(self, beat: Callable[[], None], gate: threading.Lock) -> None:
        self.beat, self.gate = beat, gate
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="busy-heartbeats", daemon=True)

    def run(self) -> None:
        while not self.stopping.wait(BUSY_BEAT_S):
            if self.gate.acquire(blocking=False):  # the main thread is in env code
                try:
                    self.beat()
                finally:
                    self.gate.release()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5 * BUSY_BEAT_S)


def beat_while_envs_run(envsets: list[EnvSet], beat: Callable[[], None]) -> BusyBeats:
    """Start the heartbeat thread for these envs (a worker's, or its splits'): from now on the
    calling thread holds their gate except while their env code runs."""
    gate = threading.Lock()
    gate.acquire()
    for envset in envsets:
        envset.gate = gate
    beats = BusyBeats(beat, gate)
    beats.thread.start()
    return beats


class Phase(enum.Enum):
    """Where the worker is with the broker."""

    WAITING = "waiting"  # no RESET yet: steps are not taken, the hello repeats
    STEPPING = "stepping"  # reset for `epoch`: steps of that epoch are taken


@dataclass
class WorkerCounts:
    """The worker's figures in `stepbus status`."""

    env_steps: int = 0  # agent steps taken
    policy_version: int = -1  # the version that chose the last actions (status shows the lag)


@dataclass
class ShmCounts:
    """Batches by way of the shared-memory segment (figures only where there is one)."""

    shm_batches: int = 0  # observations in a slot of the segment
    shm_full: int = 0  # every slot still being read: observations on the socket


class Worker(node.Process):
    """K environments serving the broker: RESET and STEP in, one STEP_RESULT out for each.

    Ports: "steps" (the DEALER to the broker) and "controller" (where env errors are reported).
    `controller_beat` keeps the controller's heartbeats going while a batch is stepped."""

    role = "worker"
    sockets = Role.WORKER

    def __init__(self, cfg: Config, ports: node.Ports, log: logging.Logger, *,
                 clock: Callable[[], float] = time.monotonic,
                 controller_beat: Callable[[float], object] | None = None,
                 envs: EnvSet | None = None, split_of: str = "",
                 lane: Lane | None = None) -> None:
        """`envs`: made already (by `make_envs`), else made here. `split_of`: this is a split
        of that worker (`cfg` is the split's, `envs.first_env` where its envs begin). `lane`:
        where a vector env's requests come (`ports` sends the answers down it). Raises
        CannotCreateEnv when the environments cannot be made."""
        super().__init__(ports, log, name=cfg.name, clock=clock)
        self.cfg, self.controller_beat = cfg, controller_beat
        self.incarnation = uuid.uuid4().hex[:8]
        self.host, self.pid = pysocket.gethostname(), os.getpid()
        self.phase = Phase.WAITING
        self.epoch, self.seq = -1, 0  # of the broker's latest word
        self.options: dict[str, Any] = {}  # the reset options of `epoch`
        self.step_options: dict[str, Any] = {}  # ... as autoresets get them (Gymnasium: none)
        self.counts, self.shm_counts = WorkerCounts(), ShmCounts()
        self.busy_beat_at = 0.0  # the last heartbeat sent to (or message heard from) the broker
        self.answered = False  # a broker has spoken to us (then hellos slow to their interval)
        self.hello_postponed = False  # after a stall, until the hello goes out (`on_stalled`)
        self.busy_beats: BusyBeats | None = None  # the heartbeat thread, when it is ours
        self.envs = envs or make_envs(cfg, log)
        self.envs.report, self.envs.tick = self.report, self.beat_while_busy
        self.segment = self.open_segment() if cfg.shm_frames else None
        self.use_shm = False  # the broker marked our segment (before its RESET) as mapped
        self.no_rows = rows.copy(rows.take(self.envs.last_obs, slice(0, 0)))  # the layout alone
        self.hello = p.WorkerHello(
            worker=cfg.name, incarnation=self.incarnation, env_id=cfg.env,
            num_envs=cfg.envs_per_worker, seed=cfg.seed, spec=self.envs.spec,
            seq=0, agents=self.envs.agents, shm=self.segment.name if self.segment else "",
            shm_nonce=self.segment.nonce.hex() if self.segment else "",
            split_of=split_of, first_env=self.envs.first_env)
        self.every("hello", HELLO_INTERVAL_S, self.say_hello, first_due=self.now)
        self.lane = lane
        if lane is not None:
            self.wake_on_readable_fds = {lane.read_fd}

    def open_segment(self) -> shm.Writer | None:
        """The shared-memory segment (None: observations on the socket): for batches of at
        least --shm-min-batch-bytes, with --shm-frames."""
        if rows.nbytes(self.envs.last_obs) < self.cfg.shm_min_batch_bytes:
            return None
        try:
            if shm.remove_orphans(self.cfg.name):
                self.log.info("removed shared-memory segments of earlier, dead incarnations")
            return shm.Writer(shm.segment_name(self.cfg.name, self.incarnation),
                              self.envs.last_obs)
        except OSError as exc:
            self.log.warning("--shm-frames: cannot create a segment in %s (%s); observations "
                             "go on the socket", shm.DIR, exc)
            return None

    # -- the broker
    def say_hello(self, now: float) -> None:
        """Registration and liveness; `seq` lets a new broker continue our numbering."""
        self.send(PortName.STEPS, dataclasses.replace(self.hello, seq=self.seq))
        self.hello_postponed = False
        if not self.answered and now - self.started < FIRST_HELLOS_FOR_S:
            self.timers["hello"].due = now + FIRST_HELLO_INTERVAL_S

    def on_stalled(self, seconds: float) -> None:
        """What the broker sent while we did not run is read before a hello goes out: a hello
        that arrives while the broker has waited over a second for our reply to a request
        waiting here tells it that request was lost, and it resets us (which a deterministic
        run must never see happen because of timing). Once per hello: a loop late on every
        pass still says hello."""
        hello = self.timers["hello"]
        if not self.hello_postponed and hello.due < self.now + READ_FIRST_S:
            hello.due, self.hello_postponed = self.now + READ_FIRST_S, True

    def heard(self, now: float) -> None:
        """The broker spoke: no hello and no busy heartbeat is due for an interval (and the
        next stall may postpone that one)."""
        self.timers["hello"].due, self.hello_postponed = now + HELLO_INTERVAL_S, False
        self.busy_beat_at, self.answered = now, True

    def on_reset(self, peer: bytes, msg: p.Reset) -> None:
        self.heard(self.now)
        problem = self.reset_problem(msg)
        if problem:
            self.refuse("bad reset", problem)
            return
        self.epoch, self.options, self.seq = msg.epoch, msg.options, msg.seq
        self.step_options = {} if msg.seeding == p.SEEDING_GYMNASIUM else msg.options
        self.envs.seeding, self.envs.autoreset = msg.seeding, msg.autoreset
        self.envs.with_infos = msg.infos
        self.phase = Phase.STEPPING
        self.use_shm = self.segment is not None and self.segment.take_broker_mark()
        seeds = [None if s < 0 else s for s in msg.seeds] if msg.seeds else None
        obs = self.envs.reset(self.options, msg.rows or None, seeds)
        k = self.envs.rows
        self.reply(p.StepResult(
            incarnation="", epoch=0, seq=0, first=True, obs=obs,
            reward=np.zeros(k, np.float32), terminated=np.zeros(k, bool),
            truncated=np.zeros(k, bool), final_obs=rows.take(obs, slice(0, 0)),
            alive=self.envs.alive_rows(),
            **self.envs.episodes(), **self.envs.info_fields()))

    def reset_problem(self, msg: p.Reset) -> str:
        """Why a RESET cannot be done ("": it can): its modes, rows and seeds."""
        n = len(self.envs.envs)
        if msg.seeding not in p.SEEDINGS or msg.autoreset not in p.AUTORESETS:
            return f"seeding {msg.seeding[:20]!r}, autoreset {msg.autoreset[:20]!r}"
        if len(set(msg.rows)) != len(msg.rows) or not all(0 <= r < n for r in msg.rows):
            return f"rows must be distinct envs 0 to {n - 1}"
        if msg.seeds and (len(msg.seeds) != (len(msg.rows) or n)
                          or not all(-1 <= s < 2**63 for s in msg.seeds)):
            return "seeds: one per env reset, each -1 (none) or 0 to 2**63 - 1"
        vector = bool(msg.rows or msg.seeds or msg.infos) or msg.autoreset != p.AUTORESET_SAME_STEP
        if vector and self.envs.agents:
            return "rows, seeds, autoreset modes and infos are for Gymnasium envs, not agents"
        return ""

    def on_step(self, peer: bytes, msg: p.Step) -> None:
        """Step every env once; a step of another epoch than our last reset's is not ours."""
        self.heard(self.now)
        if msg.epoch != self.epoch or self.phase is not Phase.STEPPING:
            return
        problem = self.envs.actions_problem(msg.actions)
        if problem:
            self.refuse("bad actions", problem)
            return
        self.seq, self.counts.policy_version = msg.seq, msg.policy_version
        acting = int(self.envs.alive.sum())  # agent steps this batch takes
        segment = self.segment if self.use_shm else None
        slot = segment.acquire() if segment is not None else -1
        result = self.envs.step(msg.actions, self.step_options,
                                None if segment is None or slot < 0 else segment.views[slot])
        if segment is not None and slot >= 0:
            segment.publish(slot, self.seq)
            result = p.renumbered(result, obs=self.no_rows, obs_slot=slot)
            self.shm_counts.shm_batches += 1
        elif segment is not None:
            self.shm_counts.shm_full += 1  # every slot still read: the socket it is
        self.reply(result)
        self.counts.env_steps += acting
        self.timers["hello"].due = self.clock() + HELLO_INTERVAL_S

    def on_env_call(self, peer: bytes, msg: p.EnvCall) -> None:
        """A vector client's call/get_attr/set_attr on every env, answered as data."""
        self.heard(self.now)
        # env code: a long call is beaten through, as a long step is
        answer = self.envs.env_call(calls.answer, self.envs.envs, msg, self.cfg.name)
        self.send(PortName.STEPS, answer)

    def reply(self, result: p.StepResult) -> None:
        self.send(PortName.STEPS, p.renumbered(result, incarnation=self.incarnation,
                                               epoch=self.epoch, seq=self.seq))


    # -- errors and liveness while envs run
    def report(self, error: p.RemoteError) -> None:
        self.send(PortName.CONTROLLER, error)  # the controller logs it for the operator
        self.send(PortName.STEPS, error)  # the broker, for a running reset barrier

    def beat_while_busy(self) -> None:
        """Between env calls of a batch (and from the heartbeat thread): a slow batch is not a dead
        worker, to the controller nor to the broker."""
        now = self.clock()
        if self.controller_beat is not None:
            self.controller_beat(now)
        if now - self.busy_beat_at >= node.HEARTBEAT_INTERVAL_S:
            self.busy_beat_at = now
            self.send(PortName.STEPS, p.Heartbeat(role="worker", name=self.cfg.name, host=self.host,
                                           pid=self.pid, leaving=False, figures={}))

    # -- hooks the loop calls
    def tick(self, now: float) -> float:
        if self.lane is not None:
            self.take_lane()
        return super().tick(now)

    def take_lane(self) -> None:
        """What the vector env asked down the lane; its end closed, the env is gone and so
        are we."""
        assert self.lane is not None
        try:
            lane.deliver_all(self.lane, self, b"", (p.Reset, p.Step, p.EnvCall),
                             f"the lane {self.cfg.lane}")
        except lane.LaneError as exc:
            self.stop(f"the lane broke: {exc}")
            return
        if self.lane.ended:
            self.wake_on_readable_fds = set()
            self.stop("its vector env closed the lane")

    def figures(self) -> dict[str, Any]:
        figures = {**dataclasses.asdict(self.counts), "env_errors": self.envs.errors,
                   "agents_vanished": self.envs.agents_vanished,
                   "info_values_dropped": self.envs.info_encoder.dropped,
                   **self.rejects.figures()}
        if self.segment is not None:
            figures |= {**dataclasses.asdict(self.shm_counts),
                        "shm_reclaimed": self.segment.reclaimed}
        return figures

    def finish(self) -> None:
        self.log.info("%s stopping (%s) after %d env steps", self.cfg.name, self.stop_reason,
                      self.counts.env_steps)

    def close(self) -> None:
        if self.busy_beats is not None:
            self.busy_beats.stop()
        if self.lane is not None:
            self.lane.close()
        if self.segment is not None:
            self.segment.close()
        with node.beating_through():  # a simulator may take seconds to close
            self.envs.close()


class Splits:
    """The splits of one double-buffered worker, on one thread: while one split's env code
    runs, every split's heartbeats go out (the others wait for actions meanwhile, and must not
    look dead to the broker or the controller)."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        for w in workers:
            w.envs.tick = self.beat_all

    def beat_all(self) -> None:
        for w in self.workers:
            w.beat_while_busy()


def run(cfg: Config) -> int:
    log = node.setup_logging("worker")
    stop = node.StopFlag()
    try:
        if cfg.lane and cfg.splits != 1:
            raise CannotCreateEnv(f"--lane takes a whole worker: --splits must be 1, "
                                  f"not {cfg.splits}")
        envsets = make_split_envs(cfg, log)
    except CannotCreateEnv as exc:  # a typo in --env deserves one clear line, not a traceback
        log.error("%s", exc)
        return Exit.SETTING
    try:
        return node.run_role(functools.partial(_open_beating, cfg, log, envsets, stop),
                             cfg.security, stop)
    except CannotCreateEnv as exc:  # a --lane with nobody at its other end
        log.error("%s", exc)
        return Exit.SETTING
    except EnvFailure as exc:
        log.error("%s; worker exiting", exc)
        return Exit.FAILED


def _open_beating(cfg: Config, log: logging.Logger, envsets: list[EnvSet],
                  stop: node.StopFlag, ctx: zmq.Context) -> list[node.Opened] | None:
    """A worker process's heartbeats go on during long env calls (the serial runner's workers,
    sharing a thread with every other role, have no such thread)."""
    opened = open_workers(ctx, cfg, log, envsets, stop)
    workers = [o.process for o in opened or [] if isinstance(o.process, Worker)]
    if workers:
        beat = workers[0].beat_while_busy if len(workers) == 1 else Splits(workers).beat_all
        workers[0].busy_beats = beat_while_envs_run([w.envs for w in workers], beat)
    return opened


def open_workers(ctx: zmq.Context, cfg: Config, log: logging.Logger, envsets: list[EnvSet],
                 stop: node.StopFlag) -> list[node.Opened] | None:
    """A worker (`envsets` from `make_split_envs`), or each of its splits, each a worker of
    its own to the broker and the controller; None: told to stop first (envs closed)."""
    if len(envsets) == 1:
        one = open_worker(ctx, cfg, log, envsets[0], stop)
        return None if one is None else [one]
    opened: list[node.Opened] = []
    for i, group in enumerate(envsets):
        split = dataclasses.replace(cfg, name=split_name(cfg.name, i),
                                    envs_per_worker=len(group.envs))
        one = open_worker(ctx, split, log, group, stop, split_of=cfg.name)
        if one is None:
            for o in opened:
                o.cleanup()
                if o.link is not None:
                    o.link.close()
            for rest in envsets[i + 1:]:
                rest.close()
            return None
        opened.append(one)
    return opened


def open_worker(ctx: zmq.Context, cfg: Config, log: logging.Logger, envs: EnvSet,
                stop: node.StopFlag, split_of: str = "") -> node.Opened | None:
    """None: told to stop while waiting to learn where the broker is (envs closed)."""
    its_lane = open_lane(cfg)  # first: nothing else to close if it cannot be opened
    link = node.ControllerLink(ctx, role="worker", name=cfg.name, controller=cfg.controller,
                               broadcast=cfg.broadcast, log=log)
    # On another host a worker needs only the controller's address: it says where the rest is.
    steps = cfg.steps or link.discover("steps", stop)
    try:
        if not steps:
            envs.close()
            return None
        dealer = topology.open_role(ctx, Role.WORKER, {"steps": steps},
                                    name=cfg.name)[PortName.STEPS]
    except BaseException:
        link.close()
        raise
    if not wiring.on_this_host(steps):  # a broker elsewhere could never map a segment
        cfg = dataclasses.replace(cfg, shm_frames=False)
    sockets: dict[str, zmq.Socket] = {PortName.STEPS: dealer, PortName.CONTROLLER: link.dealer}
    ports = node.SocketPorts(sockets) if its_lane is None else lane.LanePorts(sockets, its_lane)
    worker = Worker(cfg, ports, log, controller_beat=link.beat, envs=envs, split_of=split_of,
                    lane=its_lane)
    log.info("%s: %d x %s%s, connecting to %s", cfg.name, cfg.envs_per_worker, cfg.env,
             f" ({len(worker.envs.agents)} agents each)" if worker.envs.agents else "", steps)
    return node.Opened(worker, {PortName.STEPS: node.Port(dealer, (p.Reset, p.Step, p.EnvCall))},
                       link, cleanup=worker.close)


def open_lane(cfg: Config) -> Lane | None:
    """The worker's end of its `--lane` (None: none given); its sockets close with the context.

    Raises:
        CannotCreateEnv: no such lane, or nobody at its other end (exit 2: a setting).
    """
    if not cfg.lane:
        return None
    try:
        return Lane.worker_end(lane.LanePaths.of(cfg.lane))
    except (lane.LaneError, OSError) as exc:
        raise CannotCreateEnv(f"--lane: {exc}") from None
