"""The learner process: pulls trajectories, runs the algorithm (PPO by default), publishes
versioned weights, checkpoints. `stepbus trainer` runs it inside a trainer slot (trainer/slot.py)
that restarts and swaps it; `stepbus learner` runs it bare.

Startup: learn the run id from the controller (the run directory is `runs_dir/run_id`), ask the
broker for the env spec and its newest policy version, resume from the run's checkpoint if there
is one, and publish weights at a version above both. A learner killed and started again inside
the same run therefore continues where the last checkpoint left off, with higher versions and the
next generation. Every trajectory taken in is receipted to the assembler, which resends what a
killed learner never receipted.

A batch is the first trajectories taken in that sum to at least `batch_steps`, in arrival order:
intake stops while a batch is full, so which trajectories an update learns from, and which
policy versions count as stale, never depend on how many happened to be queued. Each metrics
record carries a digest of every trajectory this learner took in, so two runs can be compared.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import signal
import socket as pysocket
import time
import uuid
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq
from stepbus.bus import checks, node, policies, wiring
from stepbus.bus import protocol as p
from stepbus.trainer import checkpoint, ppo, spaces
from stepbus.trainer.metrics import IntakeStats, MetricsFiles, ProgressLog

from stepbus import imports

SLOT_BEAT_FD_ENV = "STEPBUS_SLOT_BEAT_FD"  # the pipe a trainer slot watches (see SlotBeat)
RECEIPTS_WARN_S = 5.0  # receipts undelivered this long: say so (a wrong --receipts?)
# Numbers receipted as learned that are still recognised if sent again: well above what a
# resend can put ahead of one (twice the assembler's default --max-buffered of 10,000, plus a
# batch). 512 KiB.
LEARNED_KEPT = 1 << 16
SHUTDOWN_DRAIN_MAX_S = 1.5  # at shutdown, take the assembler's flush for at most this long
RECEIPT_INTERVAL_S = 0.02  # receipts go out this often at most (the assembler's bound waits)


@dataclass
class Config:
    policy: str = wiring.endpoint("policy", "broker endpoint to send weights to")
    trajectories: str = wiring.endpoint("trajectories", "assembler endpoint to pull from")
    receipts: str = wiring.endpoint("receipts", "assembler endpoint to send receipts to")
    controller: str = wiring.endpoint("controller", "controller endpoint to connect")
    broadcast: str = wiring.endpoint("broadcast", "controller broadcast endpoint to connect")
    runs_dir: str = field(default_factory=lambda: os.environ.get("STEPBUS_RUNS_DIR", "runs"),
                          metadata={"help": "runs live in RUNS_DIR/<run id from the controller>"})
    run_dir: str = field(default="", metadata={
        "help": "use this run directory instead (resumes its checkpoint if present)"})
    target_return: float = field(default=475.0, metadata={
        "help": "stop the whole pipeline once the mean return of the last "
                "--target-episodes episodes reaches this (0: never)"})
    target_episodes: int = field(default=20, metadata={"help": "episodes in the mean"})
    max_policy_lag: int = field(default=8, metadata={
        "help": "trajectories acted by a policy more than this many versions old are dropped "
                "(counted)"})
    max_updates: int = field(default=0, metadata={
        "help": "stop the whole pipeline once the run has made this many policy updates "
                "(0: never)"})
    checkpoint_interval_s: float = field(default=2.0, metadata={
        "help": "seconds between checkpoints (one is also written on exit)"})
    seed: int = field(default=0, metadata={"help": "seeds initial weights and minibatches"})
    policy_name: str = field(default=policies.DEFAULT, metadata={
        "help": "the policy this learner trains (see the broker's --policy-map); pull its "
                "trajectories from the assembler's endpoint for it (--trajectories); a policy "
                "other than 'default' keeps its checkpoint and metrics in RUN_DIR/policy-NAME"})
    algo: str = field(default="stepbus.trainer.ppo:PPO", metadata={
        "help": "learning algorithm, module:Class (interface: trainer/ppo.py's PPO)"})
    ppo: ppo.PPOConfig = field(default_factory=ppo.PPOConfig)
    security: wiring.Security = field(default_factory=wiring.Security)


@dataclass
class Progress:
    """What the checkpoint carries besides weights, so a resumed trainer continues the run."""

    version: int = 0
    generation: int = 0
    env_steps: int = 0
    episodes: int = 0
    recent_returns: list[float] = field(default_factory=list)
    updates: int = 0  # over the whole run (every generation), for --max-updates


class Receipts:
    """Trajectory numbers taken in and learned from since the last RECEIPT, and what it takes
    to ignore a trajectory the assembler sends again (after a learner connects) that this
    learner has taken in already.

    What can come back is what the assembler still held as unlearned when it resent: numbers
    taken in whose "learned" receipt it had not yet read. So this keeps, exactly, the numbers
    taken in and not yet receipted as learned (`open`: at most a batch and a receipt interval),
    plus the last LEARNED_KEPT numbers receipted as learned (`recent`, a fixed ring). Bounded
    by counting, not time: the assembler sends each policy's trajectories in ascending numbers
    and puts resent ones ahead of the rest, so a copy resent before our receipt was read comes
    in ahead of what was then queued or unlearned, which its --max-buffered bounds; a copy
    cannot wait behind more than that. A number above every one taken in was never taken in
    (numbers rise), so only lower ones are looked up, and those come only with a resend."""

    def __init__(self) -> None:
        self.recent = np.full(LEARNED_KEPT, -1, np.int64)  # allocated once: RSS stays flat
        self._start("")

    def _start(self, assembler: str) -> None:
        self.assembler = assembler
        self.taken: list[int] = []
        self.learned: list[int] = []
        self.open: set[int] = set()  # taken in, "learned" not yet receipted
        self.recent.fill(-1)
        self.recent_next = 0  # where the next receipted number goes in the ring
        self.highest = -1  # of the numbers taken in
        self.pending_since: float | None = None
        self.warned = False

    def had(self, seq: int) -> bool:
        """Whether `seq` was taken in (as far as it can come back)."""
        return seq <= self.highest and (seq in self.open or bool((self.recent == seq).any()))

    def take(self, assembler: str, seq: int) -> bool:
        """Note a trajectory taken in; False if it was taken in already."""
        if not assembler:
            return True  # not numbered by an assembler: nothing to receipt
        if assembler != self.assembler:
            self._start(assembler)  # a new assembler numbers afresh
        if self.had(seq):
            return False
        self.highest = max(self.highest, seq)
        self.open.add(seq)
        self.taken.append(seq)
        return True

    def learn(self, ids: Iterable[tuple[str, int]]) -> None:
        self.learned.extend(seq for assembler, seq in ids
                            if assembler and assembler == self.assembler)

    def message(self, trainer: str, incarnation: str, policy: str,
                now: float) -> p.Receipt | None:
        if not (self.taken or self.learned):
            return None
        if self.pending_since is None:
            self.pending_since = now
        return p.Receipt(trainer=trainer, incarnation=incarnation, assembler=self.assembler,
                         taken=np.asarray(self.taken, np.int64),
                         learned=np.asarray(self.learned, np.int64), policy=policy)

    def delivered(self) -> None:
        for seq in self.learned:  # from `open` into the ring, over the oldest
            self.open.discard(seq)
            self.recent[self.recent_next] = seq
            self.recent_next = (self.recent_next + 1) % LEARNED_KEPT
        self.taken.clear()
        self.learned.clear()
        self.pending_since, self.warned = None, False


class Curriculum:
    """Reset barriers a learning algorithm asks for: sent to the controller, tried again while
    another barrier is running, and the outcome logged. The newest request wins."""

    RETRY_S = 1.0

    def __init__(self, link: node.ControllerLink, log: logging.Logger) -> None:
        self.link, self.log = link, log
        self.options: dict | None = None  # wanted, not yet sent
        self.asked: dict | None = None  # sent, not yet answered
        self.next_try = 0.0

    def want(self, options: dict) -> None:
        try:
            p.encode(p.ResetRequest(options=dict(options)))
        except (p.ProtocolError, TypeError, ValueError) as exc:
            self.log.error("curriculum options %r cannot be sent: %s", options, exc)
            return
        self.options, self.next_try = dict(options), 0.0

    def send_due(self, now: float) -> None:
        if self.options is None or self.asked is not None or now < self.next_try:
            return
        self.log.info("curriculum: asking for a reset barrier with options %s", self.options)
        self.link.send(p.ResetRequest(options=self.options))
        self.asked, self.options = self.options, None

    def answered(self, reply: p.Reply, now: float) -> None:
        asked, self.asked = self.asked, None
        if not reply.ok and "already running" in reply.detail and self.options is None:
            self.options, self.next_try = asked, now + self.RETRY_S  # after that one
            self.log.info("curriculum: a reset barrier is running; asking again in %gs",
                          self.RETRY_S)
            return
        (self.log.info if reply.ok else self.log.warning)("reset barrier: %s", reply.detail)


class SlotBeat:
    """The learner's side of its trainer slot: a byte on a pipe every heartbeat interval, so
    the slot can kill a learner that froze, and a broken pipe when the slot is gone, so a
    killed slot's learner leaves instead of lingering next to its replacement."""

    def __init__(self) -> None:
        fd = os.environ.get(SLOT_BEAT_FD_ENV)
        self.fd = int(fd) if fd and fd.isdigit() else None
        self.gone = False
        self._next = 0.0
        if self.fd is not None:
            try:
                os.set_blocking(self.fd, False)
            except OSError:
                self.fd = None  # not started by a slot after all

    def beat(self, now: float) -> None:
        if self.fd is None or now < self._next:
            return
        self._next = now + node.HEARTBEAT_INTERVAL_S
        try:
            os.write(self.fd, b".")
        except BlockingIOError:
            pass  # the slot has not read the last ones yet: it is alive
        except OSError:
            self.gone = True


@dataclass
class Links:
    """Everything the learner talks through, so its loops take one argument."""

    log: logging.Logger
    stop: node.StopFlag
    link: node.ControllerLink
    broker: zmq.Socket
    intake: zmq.Socket
    assembler_events: zmq.Socket  # the intake's disconnects: the assembler has finished
    receipts: zmq.Socket
    rejects: node.RejectLog
    slot: SlotBeat
    name: str
    incarnation: str

    def beat(self, now: float, figures: Callable[[], dict] | None = None) -> None:
        """Heartbeats to the controller and to the slot; run often (also inside updates)."""
        self.link.beat(now, figures)
        self.slot.beat(now)
        if self.slot.gone and not self.stop:
            self.stop.reason = "its trainer slot is gone"

    def running(self) -> bool:
        return not self.stop and not self.link.shutdown_reason


def run(cfg: Config) -> int:
    log = node.setup_logging("trainer")
    # SIGUSR1 is the trainer slot's "hand over": checkpoint and leave at once (what this
    # learner has not learned from, the assembler sends to the next one).
    stop = node.StopFlag((signal.SIGINT, signal.SIGTERM, signal.SIGUSR1))
    MetricsFiles.preload()
    ctx = wiring.context(cfg.security)
    name = os.environ.get("HONCHO_PROCESS_NAME") or f"trainer-{pysocket.gethostname()}"
    link = node.ControllerLink(ctx, role="trainer", name=name, controller=cfg.controller,
                               broadcast=cfg.broadcast, log=log)
    # Weights are only worth sending fresh; what a killed learner had queued is sent again.
    broker = wiring.socket(ctx, zmq.DEALER, connect=cfg.policy, sndhwm=4)
    intake = wiring.socket(ctx, zmq.PULL, connect=cfg.trajectories, rcvhwm=64)
    assembler_events = intake.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    receipts = wiring.socket(ctx, zmq.PUSH, connect=cfg.receipts, immediate=True)
    links = Links(log, stop, link, broker, intake, assembler_events, receipts,
                  node.RejectLog(log), SlotBeat(), name, uuid.uuid4().hex[:8])
    try:
        return _learn(cfg, links)
    finally:
        intake.disable_monitor()
        link.close()
        wiring.destroy(ctx, wiring.LINGER_MS)


def _wait_for_setup(cfg: Config, io: Links) -> tuple[Path, p.EnvSpec] | None:
    """Block (with a log line) until the controller gave the run id and the broker the spec.
    Trajectories are not read yet: they wait in their queue."""
    poller = zmq.Poller()
    for sock in (io.broker, *io.link.sockets()):
        poller.register(sock, zmq.POLLIN)
    env_spec: p.EnvSpec | None = None
    started, warned = time.monotonic(), False
    next_hello = 0.0
    while io.running():
        now = time.monotonic()
        io.beat(now, lambda: {"state": "starting"})
        if now >= next_hello:
            node.send(io.broker, p.TrainerHello(trainer=io.name, policy=cfg.policy_name),
                      block=False)
            next_hello = now + node.HEARTBEAT_INTERVAL_S
        events = dict(poller.poll(node.MAX_POLL_MS))
        io.link.poll(events)
        if io.broker in events:
            _, msg = node.recv(io.broker, io.rejects)
            if isinstance(msg, p.EnvSpec):
                env_spec = msg
        state = io.link.state
        have_run = cfg.run_dir or state is not None
        if have_run and env_spec is not None:
            run_dir = Path(cfg.run_dir) if cfg.run_dir or state is None else (
                Path(cfg.runs_dir) / state.run_id)
            return run_dir, env_spec
        if not warned and now - started > 3.0:
            warned = True
            io.log.info("waiting for %s", " and ".join(
                w for w, ok in ((f"controller at {cfg.controller}", have_run),
                                (f"broker (and a worker) at {cfg.policy}"
                                 + ("" if cfg.policy_name == policies.DEFAULT else
                                    f" to know policy {cfg.policy_name!r} (its --policy-map)"),
                                 env_spec)) if not ok))
    return None


def _learn(cfg: Config, io: Links) -> int:
    log, stop, link, rejects = io.log, io.stop, io.link, io.rejects
    broker, intake, receipts = io.broker, io.intake, io.receipts
    name, incarnation = io.name, io.incarnation
    try:
        policies.check_name(cfg.policy_name)
    except ValueError as exc:
        log.error("--policy-name: %s", exc)
        return 2
    try:
        algo_class = imports.load_object(cfg.algo)
    except (ImportError, AttributeError, ValueError) as exc:
        log.error("cannot load --algo %s: %s: %s", cfg.algo, type(exc).__name__, exc)
        return 2
    setup = _wait_for_setup(cfg, io)
    if setup is None:
        return 0
    run_dir, env_spec = setup
    run_dir.mkdir(parents=True, exist_ok=True)
    _link_latest(run_dir)
    spec = env_spec.spec
    action = spaces.action_space(spec)
    rng = np.random.default_rng(cfg.seed)
    try:
        algo = algo_class(spaces.obs_dim(spec), action, cfg.ppo, rng)
    except Exception as exc:  # user code: one clear line, and the slot reverts a swap
        log.error("--algo %s failed to start: %s: %s", cfg.algo, type(exc).__name__, exc)
        return 2
    params = algo.params
    # Each policy's learner keeps its own checkpoint and metrics.
    policy_dir = (run_dir if cfg.policy_name == policies.DEFAULT
                  else run_dir / f"policy-{cfg.policy_name}")
    policy_dir.mkdir(exist_ok=True)
    ckpt_path = policy_dir / "checkpoint.npz"
    progress = Progress()
    if ckpt_path.exists():
        saved, optimizer, progress_dict = checkpoint.load(ckpt_path)
        progress = Progress(**progress_dict)
        mismatch = sorted(k for k in params.keys() | saved.keys()
                          if k not in saved or k not in params or saved[k].shape != params[k].shape)
        if mismatch:
            log.error("checkpoint %s does not fit this policy (%s; spaces %s, hidden %s): "
                      "start a new run or use the old settings", ckpt_path,
                      ", ".join(mismatch[:4]), spec, cfg.ppo.hidden)
            return 2
        params.update(saved)
        algo.load_optimizer_state(optimizer)
        log.info("resumed from %s (version %d, generation %d, %d env steps)", ckpt_path,
                 progress.version, progress.generation, progress.env_steps)
    progress.generation += 1
    progress.version = max(progress.version, env_spec.policy_version) + 1
    returns: collections.deque[float] = collections.deque(progress.recent_returns,
                                                          maxlen=cfg.target_episodes)
    metrics = MetricsFiles(policy_dir)  # metrics.jsonl and TensorBoard scalars
    intake_stats = IntakeStats(cfg.target_episodes)  # policy lag, episode length, link rates
    log.info("run directory %s; policy %s version %d, generation %d, algorithm %s", policy_dir,
             cfg.policy_name, progress.version, progress.generation, cfg.algo)

    batch: list[ppo.Trajectory] = []
    batch_steps = received = 0  # received: env steps this incarnation took in (the credit)
    batch_ids: list[tuple[str, int]] = []  # (assembler, seq) of what is in `batch`
    pending: collections.deque[p.Trajectory] = collections.deque()  # received, not yet taken in
    counts = {"stale_dropped": 0, "updates": 0, "trajectories": 0, "duplicates": 0}
    receipt = Receipts()
    t_start = last_record_t = time.monotonic()
    last_record_steps = progress.env_steps
    last_data = last_publish = last_ckpt = t_start
    done = ""  # why this run wants no more updates (the target return, --max-updates)
    if cfg.max_updates and progress.updates >= cfg.max_updates:  # a resumed, finished run
        done = f"the run made --max-updates {cfg.max_updates} policy updates already"
    digest = hashlib.blake2b(digest_size=8)  # of every trajectory taken in, in arrival order
    last_shutdown_request = 0.0
    last_receipts = 0.0
    progress_log = ProgressLog(log, progress.env_steps)  # a line every 5 s, on a fixed beat

    def publish(starving: bool = False) -> None:
        nonlocal last_publish
        node.send(broker, p.Weights(trainer=name, incarnation=incarnation, policy=cfg.policy_name,
                                    version=progress.version, consumed_steps=received,
                                    batch_steps=cfg.ppo.batch_steps, starving=starving,
                                    # copies: frames are zero-copy and the update is in place
                                    params={k: v.copy() for k, v in params.items()}),
                  block=False)
        last_publish = time.monotonic()

    def mean_return() -> float | None:
        return float(np.mean(returns)) if returns else None

    def save() -> None:
        progress.recent_returns = list(returns)
        checkpoint.save(ckpt_path, params, algo.optimizer_state(), progress.__dict__)

    def send_receipts(now_or_never: bool = False) -> None:
        """At most every RECEIPT_INTERVAL_S (one message per trajectory was a third of this
        process's time), unless `now_or_never` (shutdown)."""
        nonlocal last_receipts
        now = time.monotonic()
        if now - last_receipts < RECEIPT_INTERVAL_S and not now_or_never:
            return
        msg = receipt.message(name, incarnation, cfg.policy_name, now)
        if msg is None:
            return
        last_receipts = now
        if node.send(receipts, msg, block=False):
            receipt.delivered()
        elif not receipt.warned and now - (receipt.pending_since or now) > RECEIPTS_WARN_S:
            receipt.warned = True
            log.warning("receipts to the assembler at %s undelivered for %.0fs: is --receipts "
                        "right? The assembler keeps what it sent until they arrive, and pauses "
                        "the pipeline at its bound", cfg.receipts, RECEIPTS_WARN_S)

    def record(stats: dict[str, float]) -> None:
        nonlocal last_record_t, last_record_steps
        now = time.monotonic()
        rate = (progress.env_steps - last_record_steps) / max(now - last_record_t, 1e-9)
        last_record_t, last_record_steps = now, progress.env_steps
        metrics.write({
            "time": time.time(), "wall_s": round(now - t_start, 3),
            "env_steps": progress.env_steps, "episodes": progress.episodes,
            "mean_return": mean_return(), "policy_version": progress.version,
            "generation": progress.generation, "steps_per_second": round(rate, 1),
            "stale_dropped": counts["stale_dropped"], "digest": digest.hexdigest(),
            **intake_stats.take(updated_from=progress.version - 1),
            **{k: round(v, 6) for k, v in stats.items()},
        })

    def wrong_policy(policy: str) -> bool:
        """Another policy's trajectories are refused, not receipted: the assembler keeps them
        for their own learner."""
        if policy != cfg.policy_name:
            rejects.refuse("assembler", p.ProtocolError(
                "wrong policy", f"a trajectory of policy {policy[:64]!r}; this learner trains "
                f"{cfg.policy_name!r}: is --trajectories the assembler's endpoint for it?"))
        return policy != cfg.policy_name

    def on_trajectory(t: p.Trajectory) -> None:
        problem = checks.trajectory_problem(t, spec, action)
        if problem:
            rejects.refuse("assembler", p.ProtocolError("bad trajectory", problem))
        elif not wrong_policy(t.policy):
            take_in(t)

    def on_trajectories(b: p.Trajectories) -> None:
        problem = checks.trajectories_problem(b, spec, action)
        if problem:
            rejects.refuse("assembler", p.ProtocolError("bad trajectories", problem))
        elif not wrong_policy(b.policy):
            pending.extend(b.split())
            take_pending()

    def full() -> bool:
        return batch_steps >= cfg.ppo.batch_steps and not done

    def take_pending(*, all_of_them: bool = False) -> None:
        """Trajectories of a message are taken in one by one up to a full batch, like those
        sent alone, so a batch's content never depends on how the assembler grouped them."""
        while pending and (all_of_them or not full()):
            take_in(pending.popleft())

    def take_in(t: p.Trajectory) -> None:
        nonlocal batch_steps, received
        if not receipt.take(t.assembler, t.seq):
            counts["duplicates"] += 1  # sent again after a disconnect; we have it already
            return
        _digest(digest, t)
        intake_stats.add(t)
        n = t.rewards.shape[0]
        received += n
        counts["trajectories"] += 1
        progress.env_steps += n
        if t.episode_return is not None:
            progress.episodes += 1
            returns.append(t.episode_return)
        if done:
            receipt.learn([(t.assembler, t.seq)])  # counted, no longer learned from
            return
        if int(t.policy_versions.min()) < progress.version - cfg.max_policy_lag:
            counts["stale_dropped"] += 1
            receipt.learn([(t.assembler, t.seq)])
            return
        batch_ids.append((t.assembler, t.seq))
        batch.append(ppo.Trajectory(obs=t.obs, actions=t.actions, logp=t.logp, values=t.values,
                                    rewards=t.rewards, terminated=t.terminated,
                                    truncated=t.truncated, bootstrap_obs=t.bootstrap_obs))
        batch_steps += n

    def figures() -> dict:
        mean = mean_return()
        return {"algo": cfg.algo, "policy": cfg.policy_name, "policy_version": progress.version,
                "env_steps": progress.env_steps,
                "episodes": progress.episodes, "generation": progress.generation,
                "mean_return": None if mean is None else round(mean, 2),
                **rejects.figures(), **counts, **intake_stats.last}

    curriculum = Curriculum(link, log)

    def ask_for_reset(stats: dict[str, float]) -> None:
        """Curriculum: an algorithm with `curriculum(stats) -> options | None` may ask, after an
        update, for a reset barrier with env options (as `stepbus reset --option` does)."""
        hook = getattr(algo, "curriculum", None)
        options = hook(stats) if callable(hook) else None
        if options is not None:
            curriculum.want(options)

    intake_handlers = {p.Trajectory: on_trajectory, p.Trajectories: on_trajectories}

    def take_one() -> None:
        node.handle(intake, rejects, intake_handlers, "assembler")

    save()  # at once, so the next learner's generation is above this one's even if it dies now
    publish()
    poller = zmq.Poller()
    for sock in (broker, intake, *link.sockets()):
        poller.register(sock, zmq.POLLIN)
    while io.running():
        now = time.monotonic()
        io.beat(now, figures)
        events = dict(poller.poll(0 if pending and not full() else node.MAX_POLL_MS))
        for msg in link.poll(events):
            if isinstance(msg, p.Reply) and curriculum.asked:  # the barrier it asked for
                curriculum.answered(msg, time.monotonic())
        curriculum.send_due(time.monotonic())
        if broker in events:
            node.drain(broker, lambda: node.recv(broker, rejects))  # late EnvSpec replies
        take_pending()
        if intake in events:
            # Up to a full batch only: the rest waits for the next batch (see the docstring).
            drain_until = time.monotonic() + node.DRAIN_BUDGET_S  # and the heartbeats wait not
            for _ in range(1000):
                if (full() or pending or not intake.poll(0, zmq.POLLIN)
                        or time.monotonic() > drain_until):
                    break
                take_one()
            last_data = time.monotonic()
        if full():
            stats = algo.update(batch, tick=lambda: io.beat(time.monotonic()))
            receipt.learn(batch_ids)  # only now may the assembler forget them
            batch, batch_ids, batch_steps = [], [], 0
            progress.version += 1
            progress.updates += 1
            counts["updates"] += 1
            publish()
            record(stats)
            ask_for_reset(stats)
            mean = mean_return()
            if (cfg.target_return and len(returns) >= cfg.target_episodes and mean is not None
                    and mean >= cfg.target_return):
                done = f"trainer reached mean return {mean:.1f}"
                log.info("solved: mean return %.1f over the last %d episodes at %d env steps "
                         "(%.1fs); asking the controller to shut the pipeline down", mean,
                         len(returns), progress.env_steps, time.monotonic() - t_start)
            elif cfg.max_updates and progress.updates >= cfg.max_updates:
                done = f"trainer made --max-updates {cfg.max_updates} policy updates"
                log.info("%d policy updates made (--max-updates) at %d env steps (%.1fs); asking "
                         "the controller to shut the pipeline down", progress.updates,
                         progress.env_steps, time.monotonic() - t_start)
            if done:
                save()
        send_receipts()
        now = time.monotonic()
        if done and now - last_shutdown_request > 1.0:  # until the controller broadcasts it
            last_shutdown_request = now
            link.send(p.ShutdownRequest(reason=done))
        if now - last_data > 0.25 and now - last_publish > 0.25:
            # A restarted broker gets weights; a stalled credit window refills (not once done:
            # then nothing more is wanted). Changes nothing but the broker's credit.
            publish(starving=not done)
        if now - last_ckpt > cfg.checkpoint_interval_s:
            save()
            last_ckpt = now
        progress_log.maybe(progress.env_steps, mean_return(), progress.version)
    # On a pipeline shutdown the assembler flushes open trajectories as truncated: take them in
    # (and say so) so that the checkpoint's counts include them. Not on a hand-over (SIGUSR1)
    # or when the slot is gone: what is not learned from goes to the next learner instead.
    # It disconnects once it has flushed and heard our receipts (or given up on them).
    draining = link.shutdown_reason or stop.reason in ("SIGINT", "SIGTERM")
    deadline = time.monotonic() + (SHUTDOWN_DRAIN_MAX_S if draining else 0)
    drainer = zmq.Poller()
    drainer.register(intake, zmq.POLLIN)
    drainer.register(io.assembler_events, zmq.POLLIN)
    node.drain(io.assembler_events, io.assembler_events.recv_multipart)  # old news
    before, drain_end = counts["trajectories"], "nothing to wait for"
    if draining:
        take_pending(all_of_them=True)
    send_receipts(now_or_never=True)  # what the interval held back
    while (left := deadline - time.monotonic()) > 0:
        drain_end = "the assembler did not finish"
        events = dict(drainer.poll(left * 1000))
        node.drain(intake, take_one)
        take_pending(all_of_them=True)
        send_receipts(now_or_never=True)
        if io.assembler_events in events:
            drain_end = "the assembler finished"
            break
    if draining:
        log.info("took in %d trajectories after the shutdown began (%s)",
                 counts["trajectories"] - before, drain_end)
    save()
    metrics.close()  # also flushes TensorBoard's events (the process ends with os._exit)
    log.info("learner stopping (%s); checkpoint at %s; %d trajectories taken in, %d messages "
             "refused", link.shutdown_reason or stop.reason, ckpt_path, counts["trajectories"],
             rejects.total)
    return 0


def _digest(h: hashlib.blake2b, t: p.Trajectory) -> None:
    """Fold one trajectory into a running digest: every field, arrays as dtype, shape and the
    CRC-32 of their bytes (5x faster than hashing them: observation frames run to hundreds of
    MB/s), so equal digests mean equal data up to a CRC collision; except the assembler's
    incarnation and numbering, which name the delivery, not the data (the incarnation is
    random)."""
    for f in dataclasses.fields(t):
        if f.name in ("assembler", "seq"):
            continue
        value = getattr(t, f.name)
        if isinstance(value, np.ndarray):
            crc = zlib.crc32(np.ascontiguousarray(value))
            h.update(f"{f.name} {value.dtype.str} {value.shape} {crc}".encode())
        else:
            h.update(f"{f.name} {value!r}".encode())


def _link_latest(run_dir: Path) -> None:
    """runs/latest points at the newest run, for humans and scripts."""
    latest = run_dir.parent / "latest"
    try:
        tmp = run_dir.parent / f".latest-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name)
        os.replace(tmp, latest)
    except OSError:
        pass
