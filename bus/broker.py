"""The step broker: serves whichever workers are ready, batches their observations for one
policy inference, stamps actions with the policy version, and forwards experience.

Never waits for the slowest worker: by default the results at hand are acted on at once (those
that arrived during the last inference batch together). With `batch_wait_ms`, a result waits
until every other worker has also replied or that long, whichever is first, and only for a
worker expected back within that bound (each worker's step round trip is tracked). Waiting
measured slower on every benchmark here (issue 6), so it is off by default.

Flow control is a credit window: the broker steps at most `window` env steps beyond what the
trainer reports as received (in each WEIGHTS message). That bounds policy lag and memory, and
makes stepping pause, not drop, while no trainer is consuming.

A broker started mid-run (the old one crashed) knows nothing of it: it defers workers' hellos
until the controller tells it the run's epoch and reset options, then resets every worker (the
assembler closes their open trajectories as truncated), and steps once the trainer's weights
arrive, within 0.25 s, because a trainer without data re-publishes them.

Deterministic mode (`--deterministic`) takes timing out of what is stepped: it waits for every
live worker and batches them by name, and acts at each step count S with the newest policy
version the trainer made from at most S - window steps (each version's WEIGHTS message says how
many steps it was made from), not with whichever version happened to arrive last.

With `--policy-map`, agents are served by several policies, each with its own trainer, weights,
versions and credit window (see bus/policies.py). One inference batch still covers every ready
worker: each policy acts on its own rows of it. Stepping needs every policy that has agents to
have weights, and pauses while any of them is a window ahead of its trainer.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time
from dataclasses import dataclass, field

import numpy as np
import zmq
from stepbus.bus import checks, node, policies, shm, wiring
from stepbus.bus import protocol as p
from stepbus.trainer import model, spaces

# Steps per env the window leaves for what is neither trained on nor trainable yet: a partial
# trajectory in the assembler (up to the default horizon, 32), the step awaiting its reward, and
# the step in flight. Too small a window deadlocks until the trainer reports itself starving.
HORIZON_ALLOWANCE = 32 + 2

# How long a new broker defers new workers' hellos until the controller has told it the run's
# epoch and reset options: a broker restarted mid-run must not reset envs without the last
# barrier's options (and step them) before it knows them. Deferred hellos are answered as soon as
# the run state is in (one controller round trip); without a controller, after this grace.
RUN_STATE_GRACE_S = 2 * node.HEARTBEAT_INTERVAL_S * node.LIVENESS_INTERVALS
MAX_DEFERRED_HELLOS = 1000  # hellos are untrusted: a flood of names cannot grow memory
EXPERIENCE_HWM = 1000  # messages (one per worker step) queued toward the assembler
MAX_REMEMBERED_WORKERS = 10_000  # lost workers whose last sequence number we keep
MAX_PENDING_VERSIONS = 64  # deterministic mode: versions received, not yet due (a few normally)
# Deterministic mode: how long the trainer may say it starves while we wait for it to take in
# steps it never gets (lost data, or a horizon longer than the window allows) before we give up
# reproducibility rather than stall the run for good. A healthy run never waits this long.
DETERMINISM_GIVE_UP_S = 5.0


@dataclass
class Config:
    steps: str = wiring.endpoint("steps", "ROUTER endpoint to bind for workers")
    policy: str = wiring.endpoint("policy", "ROUTER endpoint to bind for trainers")
    experience: str = wiring.endpoint("experience", "assembler endpoint to PUSH experience to")
    controller: str = wiring.endpoint("controller", "controller endpoint to connect")
    broadcast: str = wiring.endpoint("broadcast", "controller broadcast endpoint to connect")
    batch_wait_ms: float = field(default=0.0, metadata={
        "help": "longest wait for more workers to fill one inference batch (only for "
                "workers expected back within it; 0: act on whoever is ready)"})
    max_steps_ahead: int = field(default=0, metadata={
        "help": "credit window in env steps beyond what the trainer received "
                "(0: two trainer batches + 34 per env)"})
    seed: int = field(default=0, metadata={"help": "seeds the policy's action sampling"})
    deterministic: bool = field(default=False, metadata={
        "help": "reproducible runs (with one worker): wait for every worker's reply and batch "
                "them by name, no batch wait; act at step count S with the newest policy "
                "version made from at most S minus the credit window steps"})
    policy_map: str = field(default="", metadata={
        "help": "agents to policies by name pattern, first match wins, e.g. "
                "'adversary_*=red,*=default' (fnmatch; unmatched agents and a Gymnasium env's "
                "unnamed agent: 'default'); each policy is served by its own trainer"})
    security: wiring.Security = field(default_factory=wiring.Security)


class Phase(enum.Enum):
    RUNNING = "running"
    BARRIER = "barrier"  # stepping paused until every live worker has reset into the new epoch


@dataclass
class Worker:
    ident: bytes
    name: str
    incarnation: str
    num_envs: int  # rows: envs, or envs x agents for multi-agent envs
    last_seen: float
    agents: list[str]  # a multi-agent env's possible agents ([] for Gymnasium envs)
    seq: int = 0  # the seq of the reply we expect next
    in_flight: bool = True  # a RESET or STEP was sent and its reply has not arrived
    result: p.StepResult | None = None  # a reply waiting for inference
    ready_since: float = 0.0
    sent_at: float = 0.0  # when its current STEP was sent
    round_trip_s: float = 0.0  # moving average of STEP -> STEP_RESULT (0: not known yet)
    epoch: int = -1  # the epoch the worker has reset into
    agent_policies: list[str] = field(default_factory=list)  # per agent; [] without a map
    row_policy: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))  # per row
    segment: shm.Reader | None = None  # its --shm-frames segment, if we could map it
    shm_nonce: str = ""


@dataclass
class Credit:
    """Env steps stepped but not yet reported received by the current trainer incarnation."""

    produced: int = 0
    baseline: int = 0
    consumed: int = 0
    trainer: str = ""
    batch_steps: int = 256
    topups: int = 0
    extra: int = 0  # granted by top-ups; doubles, so a far too small window grows in few steps
    start: int = 0  # produced - consumed when the trainer connected: baseline without top-ups
    starving: bool = False  # what the trainer's latest WEIGHTS message said

    def outstanding(self) -> int:
        return self.produced - self.baseline - self.consumed


@dataclass
class Policy:
    """One policy's weights and flow control; there is one ("default") unless --policy-map."""

    name: str
    params: dict[str, np.ndarray] | None = None
    version: int = -1  # the version we act with
    newest: int = -1  # the newest version received (deterministic mode: maybe not yet due)
    # Deterministic mode: (steps it was made from, on our step scale; version; params) of the
    # versions received and not yet acted with, oldest first.
    due: collections.deque[tuple[int, int, dict[str, np.ndarray]]] = field(
        default_factory=collections.deque)
    waiting_since: float | None = None  # deterministic mode: waiting for the trainer's intake
    credit: Credit = field(default_factory=Credit)
    rows: int = 0  # rows of live workers this policy acts for


def run(cfg: Config) -> int:
    log = node.setup_logging("broker")
    try:
        rules = policies.parse_map(cfg.policy_map)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    stop = node.StopFlag()
    ctx = wiring.context(cfg.security)
    link = node.ControllerLink(ctx, role="broker", name="broker", controller=cfg.controller,
                               broadcast=cfg.broadcast, log=log,
                               binds={"steps": cfg.steps, "policy": cfg.policy})
    steps = wiring.socket(ctx, zmq.ROUTER, bind=cfg.steps)
    steps.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a departed worker is an error, not a silent drop
    policy_sock = wiring.socket(ctx, zmq.ROUTER, bind=cfg.policy)
    # No assembler connected: not writable, so dispatch holds instead of queueing into the void.
    # A short queue: when the assembler stops taking experience in, stepping stops soon after.
    experience = wiring.socket(ctx, zmq.PUSH, connect=cfg.experience, immediate=True,
                               sndhwm=EXPERIENCE_HWM)
    rejects = node.RejectLog(log)
    rng = np.random.default_rng(cfg.seed)

    workers: dict[bytes, Worker] = {}
    env_id, spec = "", None  # the spaces every worker must share
    pols = [Policy(name) for name in policies.policy_names(rules)]
    by_name = {pol.name: pol for pol in pols}
    names = list(by_name)
    action_space: model.ActionSpace | None = None
    phase, epoch, options = Phase.RUNNING, 0, {}
    counts = {"stale_dropped": 0, "experience_dropped": 0, "workers_lost": 0, "spec_refused": 0,
              "determinism_lost": 0, "shm_refused": 0, "shm_slots_forwarded": 0,
              "shm_rows_forwarded": 0, "shm_segments_removed": 0}
    rate_steps, rate_t0, steps_per_s = 0, time.monotonic(), 0.0
    assembler_blocked, look_again = False, None
    held_by = ""  # with several policies: the one whose weights or window holds stepping
    barrier_lost: set[str] = set()  # workers that died during the current barrier
    barrier_errors: list[str] = []  # env errors workers reported during it
    started = time.monotonic()
    highest_seq: dict[str, int] = {}  # lost worker name -> the last seq we used with it
    deferred: dict[bytes, p.WorkerHello] = {}  # the latest hello per sender, until the run state
    log.info("broker: workers on %s, trainers on %s, experience to %s%s",
             cfg.steps, cfg.policy, cfg.experience,
             f"; policies {', '.join(by_name)} ({cfg.policy_map})" if rules else "")

    def window(pol: Policy) -> int:
        return cfg.max_steps_ahead or 2 * pol.credit.batch_steps + HORIZON_ALLOWANCE * pol.rows

    def count_rows() -> None:
        for pol in pols:
            pol.rows = 0
        for w in workers.values():
            for k, n in enumerate(np.bincount(w.row_policy, minlength=len(pols)).tolist()):
                pols[k].rows += n

    def send_worker(w: Worker, msg: p.Message) -> None:
        if not node.send(steps, msg, to=w.ident, block=False):
            forget(w, "unreachable")

    def detach(w: Worker) -> None:
        """Drop our mapping of w's segment, and the segment itself if its worker is dead."""
        if w.segment is not None:
            counts["shm_segments_removed"] += w.segment.remove_if_orphaned()
            w.segment = None

    def attach(w: Worker, msg: p.WorkerHello) -> None:
        """Map w's shared-memory segment if it has one we can read: same host, same uid, the
        hello's nonce. Otherwise its observations keep coming on the socket."""
        if not msg.shm:
            return
        try:
            w.segment, w.shm_nonce = shm.Reader(msg.shm, msg.shm_nonce), msg.shm_nonce
        except shm.Refused as exc:
            counts["shm_refused"] += 1
            log.warning("worker %s: not mapping its shared-memory segment (%s); its "
                        "observations come on the socket", msg.worker, exc)
            return
        if w.segment.rows != w.num_envs:
            counts["shm_refused"] += 1
            log.warning("worker %s: its segment has %d rows per slot, not %d; observations come "
                        "on the socket", msg.worker, w.segment.rows, w.num_envs)
            w.segment = None

    def forget(w: Worker, why: str) -> None:
        if workers.pop(w.ident, None) is not None:
            detach(w)
            count_rows()
            if len(highest_seq) < MAX_REMEMBERED_WORKERS:
                highest_seq[w.name] = w.seq
            counts["workers_lost"] += 1
            if phase is Phase.BARRIER:
                barrier_lost.add(w.name)
            log.warning("worker %s %s; serving the others", w.name, why)
            node.send(experience, p.WorkerLost(worker=w.name, incarnation=w.incarnation,
                                               reason=why), block=False)

    def forward(w: Worker, r: p.StepResult, outputs: tuple | None) -> None:
        action, logp, value, versions = outputs if outputs is not None else (None,) * 4
        version = -1 if versions is None else pols[0].version if len(pols) == 1 else int(
            versions.min())
        obs, slot, segment = r.obs, r.obs_slot, w.segment
        if slot >= 0 and segment is not None:
            if segment.reader_fresh():  # the assembler maps it too: the slot number will do
                obs = r.obs[:0]
                counts["shm_slots_forwarded"] += 1
            else:  # no (live) assembler on this host maps it: the rows go on the socket
                obs, slot = r.obs.copy(), -1
                segment.release(r.obs_slot, r.seq)
                counts["shm_rows_forwarded"] += 1
        msg = p.Experience(worker=w.name, incarnation=w.incarnation, epoch=r.epoch, seq=r.seq,
                           first=r.first, policy_version=version, obs=obs,
                           reward=r.reward, terminated=r.terminated, truncated=r.truncated,
                           final_obs=r.final_obs, action=action, logp=logp, value=value,
                           alive=r.alive, agents=w.agents,
                           episode=r.episode, episode_seed=r.episode_seed,
                           agent_policies=w.agent_policies,
                           policy_versions=versions if len(pols) > 1 else None,
                           obs_slot=slot, shm=segment.name if segment is not None else "",
                           shm_nonce=w.shm_nonce if segment is not None else "")
        if not node.send(experience, msg, block=False):
            counts["experience_dropped"] += 1
            rejects.refuse("assembler", p.ProtocolError(
                "experience dropped", "the assembler's queue is full or it went away"))

    def reset_worker(w: Worker) -> None:
        if w.result is not None:  # its observation gets no action: it becomes a bootstrap
            forward(w, w.result, None)
            w.result = None
        w.seq, w.in_flight = w.seq + 1, True
        if w.segment is not None:
            w.segment.mark()  # we map it: the worker may send slot numbers after this reset
        send_worker(w, p.Reset(epoch=epoch, seq=w.seq, options=options))

    def on_hello(ident: bytes, msg: p.WorkerHello, now: float) -> None:
        nonlocal env_id, spec, action_space
        w = workers.get(ident)
        if w is not None and w.incarnation == msg.incarnation:
            w.last_seen = now
            if w.in_flight and now - w.ready_since > 2 * node.HEARTBEAT_INTERVAL_S:
                reset_worker(w)  # it is idle, yet we wait on it: a message was lost
                w.ready_since = now
            return
        if link.state is None and now - started < RUN_STATE_GRACE_S:
            if ident not in deferred and len(deferred) < MAX_DEFERRED_HELLOS:
                log.info("worker %s waits until the controller tells the run's epoch and reset "
                         "options (at most %.0fs)", msg.worker, RUN_STATE_GRACE_S)
            if ident in deferred or len(deferred) < MAX_DEFERRED_HELLOS:
                deferred[ident] = msg
            return
        if not 1 <= msg.num_envs <= checks.MAX_ENVS_PER_WORKER:
            rejects.refuse(msg.worker, p.ProtocolError("bad hello", f"num_envs {msg.num_envs}"))
            return
        problem = checks.agents_problem(msg.agents, msg.num_envs)
        if problem:
            rejects.refuse(msg.worker, p.ProtocolError("bad hello", problem))
            return
        if spec is None:
            problem = checks.spec_problem(msg.spec)
            if problem:
                counts["spec_refused"] += 1
                rejects.refuse(msg.worker, p.ProtocolError("bad spec", problem))
                return
            env_id, spec = msg.env_id, msg.spec
            action_space = spaces.action_space(spec)
            for pol in pols:
                if pol.params is not None and checks.weights_problem(pol.params, spec,
                                                                     action_space):
                    # weights that came first do not fit these spaces
                    pol.params, pol.version = None, -1
        elif msg.spec != spec:
            counts["spec_refused"] += 1
            rejects.refuse(msg.worker, p.ProtocolError(
                "spec mismatch", f"{msg.env_id} {msg.spec} differs from {env_id} {spec}"))
            return
        old = w
        if w is not None:
            log.info("worker %s restarted (incarnation %s)", msg.worker, msg.incarnation)
        else:
            log.info("worker %s joined: %d x %s", msg.worker, msg.num_envs, msg.env_id)
        # Number above anything either side used, so no old message can pass for a new one.
        first_seq = max(msg.seq, highest_seq.pop(msg.worker, 0)) if 0 <= msg.seq < 2**62 else 0
        rows = msg.num_envs * max(1, len(msg.agents))
        agent_policies = [policies.policy_of(agent, rules) for agent in msg.agents or [""]]
        w = workers[ident] = Worker(
            ident, msg.worker, msg.incarnation, rows, now, msg.agents, seq=first_seq,
            ready_since=now, agent_policies=agent_policies if rules else [],
            row_policy=np.tile([names.index(name) for name in agent_policies], msg.num_envs))
        if rules:
            log.info("worker %s: %s", msg.worker, ", ".join(
                f"{agent or '(agent)'} -> {name}"
                for agent, name in zip(msg.agents or [""], agent_policies, strict=True)))
        if old is not None:
            detach(old)
        attach(w, msg)
        count_rows()
        reset_worker(w)

    def on_result(ident: bytes, msg: p.StepResult, now: float) -> None:
        w = workers.get(ident)
        if w is None or not w.in_flight or msg.incarnation != w.incarnation or msg.seq != w.seq:
            counts["stale_dropped"] += 1
            return
        w.last_seen, w.in_flight = now, False
        if msg.obs_slot != -1:  # the rows are in its segment: read them in place
            view = None
            if w.segment is not None and spec is not None and msg.obs.shape[0] == 0:
                view = w.segment.view(msg.obs_slot, np.dtype(spec["obs_dtype"]),
                                      tuple(spec["obs_shape"]))
            if view is None or not w.segment.holds(msg.obs_slot, msg.seq):  # type: ignore
                rejects.refuse(w.name, p.ProtocolError(
                    "bad step result", f"obs_slot {msg.obs_slot} is not a batch we can read"))
                reset_worker(w)
                return
            msg = dataclasses.replace(msg, obs=view)
        problem = checks.result_problem(msg, w.num_envs, spec)
        if problem:
            rejects.refuse(w.name, p.ProtocolError("bad step result", problem))
            reset_worker(w)
            return
        if msg.epoch != epoch:  # drained from before a barrier: keep the transition, then reset
            forward(w, msg, None)
            reset_worker(w)
            return
        w.epoch, w.result, w.ready_since = msg.epoch, msg, now
        if not msg.first:  # the reply to a STEP: how long this worker takes
            trip = now - w.sent_at
            w.round_trip_s = trip if not w.round_trip_s else 0.8 * w.round_trip_s + 0.2 * trip

    def on_worker_error(ident: bytes, msg: p.RemoteError, now: float) -> None:
        if phase is Phase.BARRIER and ident in workers:
            barrier_errors.append(f"{msg.origin}: {msg.error_type}: {msg.message}"[:300])

    def on_worker_heartbeat(ident: bytes, msg: p.Heartbeat, now: float) -> None:
        w = workers.get(ident)
        if w is not None:
            w.last_seen = now  # busy in a long step, not dead

    def known_policy(trainer: str, name: str) -> Policy | None:
        pol = by_name.get(name)
        if pol is None:
            rejects.refuse(trainer, p.ProtocolError(
                "unknown policy", f"{name[:64]!r}: --policy-map names {', '.join(by_name)}"))
        return pol

    def on_trainer_hello(ident: bytes, msg: p.TrainerHello, now: float) -> None:
        pol = known_policy(msg.trainer, msg.policy)
        if spec is not None and pol is not None:
            node.send(policy_sock, p.EnvSpec(env_id=env_id, spec=spec,
                                             policy_version=pol.newest), to=ident, block=False)

    def on_weights(ident: bytes, msg: p.Weights, now: float) -> None:
        if not (1 <= msg.batch_steps <= checks.MAX_BATCH_STEPS and 0 <= msg.consumed_steps < 2**53
                and 0 <= msg.version < 2**53):
            rejects.refuse(msg.trainer, p.ProtocolError(
                "bad weights", f"batch_steps {msg.batch_steps}, consumed_steps "
                f"{msg.consumed_steps}, version {msg.version}"))
            return
        pol = known_policy(msg.trainer, msg.policy)
        if pol is None:
            return
        credit = pol.credit
        if msg.version > pol.newest:  # judged before anything else is taken from the message
            problem = checks.weights_problem(msg.params, spec, action_space)
            if problem:
                rejects.refuse(msg.trainer, p.ProtocolError("bad weights", problem))
                return
            pol.newest = msg.version
            # Inference params: a wide (pixel) input's first layer in float32 (see model).
            params = model.for_inference(msg.params)
            if not cfg.deterministic:
                pol.params, pol.version = params, msg.version
            else:
                # The first message of a version is the one the trainer sent right after making
                # it, so its consumed_steps are the steps the version was made from.
                start = (credit.start if msg.incarnation == credit.trainer
                         else credit.produced - msg.consumed_steps)
                if len(pol.due) >= MAX_PENDING_VERSIONS:
                    pol.due.popleft()
                pol.due.append((start + msg.consumed_steps, msg.version, params))
        if msg.incarnation != credit.trainer:
            credit.trainer, credit.baseline = msg.incarnation, credit.produced - msg.consumed_steps
            credit.start, credit.extra = credit.baseline, 0
            log.info("trainer %s (incarnation %s) connected at %s version %d",
                     msg.trainer, msg.incarnation,
                     "policy" if len(pols) == 1 else f"policy {pol.name!r}", msg.version)
        credit.consumed, credit.batch_steps = msg.consumed_steps, msg.batch_steps
        credit.starving = msg.starving
        if msg.starving and credit.outstanding() >= window(pol):
            # The trainer waits for data we think is in flight: it was lost (a restarted
            # assembler) or is held in partial trajectories longer than we allowed for.
            # Doubling, but never more than one window at a time: while the assembler holds
            # intake, queues (not stepping) would absorb the credit.
            grant = min(max(credit.batch_steps, credit.extra), window(pol))
            credit.baseline += grant
            credit.extra = min(credit.extra + grant, window(pol))
            credit.topups += 1

    def on_barrier(new_epoch: int, new_options: dict) -> None:
        nonlocal phase, epoch, options
        if new_epoch <= epoch:
            return
        phase, epoch, options = Phase.BARRIER, new_epoch, new_options
        barrier_lost.clear()
        barrier_errors.clear()
        log.info("barrier: epoch %d, draining %d workers", epoch, len(workers))
        for w in list(workers.values()):
            if not w.in_flight:
                reset_worker(w)

    def take_due_weights(pol: Policy, now: float) -> bool:
        """Deterministic mode: switch to the newest version made from at most `produced -
        window()` steps, once the trainer's reports show that no other such version can still
        come: it makes a version as soon as a batch is full, so a trainer that has taken in N
        steps has made (and sent) every version made from N or fewer. With an untouched credit
        window this always holds already. False: wait for the trainer."""
        credit = pol.credit
        limit = credit.produced - window(pol)
        short = limit - (credit.start + credit.consumed)
        if short > 0:
            pol.waiting_since = now if pol.waiting_since is None else pol.waiting_since
            if not credit.starving or now - pol.waiting_since < DETERMINISM_GIVE_UP_S:
                return False
            # It will never have them (lost data, or a horizon longer than the window allows).
            credit.start += short
            counts["determinism_lost"] += 1
            log.warning("deterministic: the %r trainer starves %.0fs short of %d steps it must "
                        "take in before the next policy version is due (lost data, or a horizon "
                        "longer than --max-steps-ahead allows for); going on, so this run is no "
                        "longer reproducible", pol.name, now - pol.waiting_since, short)
        pol.waiting_since = None
        while pol.due and (pol.due[0][0] <= limit or pol.params is None):
            _, pol.version, pol.params = pol.due.popleft()
        return pol.params is not None

    def act(obs: np.ndarray, ready: list[Worker]) -> tuple[np.ndarray, ...]:
        """Every policy's outputs on its own rows of one batch, and each row's version."""
        if len(pols) == 1:
            pol = pols[0]
            assert pol.params is not None
            return (*model.act(pol.params, obs, action_space, rng),
                    np.full(len(obs), pol.version, np.int64))
        actions = logp = value = None
        versions = np.empty(len(obs), np.int64)
        row_policy = np.concatenate([w.row_policy for w in ready])
        for k, pol in enumerate(pols):
            rows = np.flatnonzero(row_policy == k)
            if not len(rows):
                continue
            assert pol.params is not None
            a, lp, v = model.act(pol.params, obs[rows], action_space, rng)
            if actions is None:
                actions = np.empty((len(obs), *a.shape[1:]), a.dtype)
                logp, value = np.empty(len(obs), lp.dtype), np.empty(len(obs), v.dtype)
            actions[rows], logp[rows], value[rows] = a, lp, v  # type: ignore[index]
            versions[rows] = pol.version
        return actions, logp, value, versions  # type: ignore[return-value]

    def dispatch(now: float) -> float | None:
        """Act on the ready results if nothing holds us back; returns when to look again
        (None: when the next message arrives)."""
        nonlocal rate_steps, assembler_blocked, held_by
        assembler_blocked = False  # only true while it is what holds ready work back
        ready = [w for w in workers.values() if w.result is not None]
        acting = [pol for pol in pols if pol.rows]
        if not ready or action_space is None:
            return None
        held_by = next((f"{pol.name}: no weights" for pol in acting
                        if pol.params is None and not pol.due), "") or next(
            (f"{pol.name}: credit window" for pol in acting
             if pol.credit.outstanding() >= window(pol)), "")
        if held_by:
            return None  # that trainer's next WEIGHTS message wakes us
        assembler_blocked = not experience.poll(0, zmq.POLLOUT)
        if assembler_blocked:
            return None  # no assembler connected (or it is full): stepping would lose data
        waiting = any(w.in_flight for w in workers.values())
        if cfg.deterministic:
            if waiting or not all([take_due_weights(pol, now) for pol in acting]):
                return None  # every live worker's reply, and the versions due at this count
            ready.sort(key=lambda w: w.name)  # one inference batch, in a fixed order
        elif waiting:
            # Wait (up to the bound) only for a worker expected back within it.
            deadline = min(w.ready_since for w in ready) + cfg.batch_wait_ms / 1000
            soonest = min(w.sent_at + w.round_trip_s for w in workers.values() if w.in_flight)
            if now < deadline and soonest < deadline:
                return deadline
        # One worker's observations are the batch as they came: no copy of its frames.
        obs = (ready[0].result.obs if len(ready) == 1  # type: ignore[union-attr]
               else np.concatenate([w.result.obs for w in ready]))  # type: ignore[union-attr]
        actions, logp, value, versions = act(obs, ready)
        start = 0
        for w in ready:
            r, end = w.result, start + w.num_envs
            assert r is not None
            # Agent steps, as the learners count them: absent agents' rows are not steps.
            if len(pols) == 1:
                acted = w.num_envs if r.alive is None else int(r.alive.sum())
                pols[0].credit.produced += acted
                rate_steps += acted
            else:
                acting_rows = w.row_policy if r.alive is None else w.row_policy[r.alive]
                for k, n in enumerate(np.bincount(acting_rows, minlength=len(pols)).tolist()):
                    pols[k].credit.produced += n
                    rate_steps += n
            w.seq, w.in_flight, w.result = r.seq + 1, True, None
            w.ready_since = w.sent_at = now
            send_worker(w, p.Step(epoch=epoch, seq=w.seq, policy_version=int(versions[start]),
                                  actions=actions[start:end]))
            forward(w, r, (actions[start:end], logp[start:end], value[start:end],
                           versions[start:end]))
            start = end
        return None

    def figures() -> dict:
        default = pols[0]
        figures = {"workers": len(workers), "policy_version": default.version, "epoch": epoch,
                   "steps_per_s": round(steps_per_s),
                   "outstanding_steps": default.credit.outstanding(),
                   "credit_window": window(default), "credit_topups": default.credit.topups,
                   "assembler_blocked": assembler_blocked, **rejects.figures(), **counts}
        figures["held_by"] = held_by
        if len(pols) > 1:  # the figures above are the default policy's; these, each one's
            for pol in pols:
                figures[f"policy_version_{pol.name}"] = pol.version
                figures[f"policy_rows_{pol.name}"] = pol.rows
                figures[f"outstanding_steps_{pol.name}"] = pol.credit.outstanding()
                figures[f"credit_window_{pol.name}"] = window(pol)
                figures[f"credit_topups_{pol.name}"] = pol.credit.topups
        return figures

    worker_handlers = {p.WorkerHello: on_hello, p.StepResult: on_result,
                       p.Heartbeat: on_worker_heartbeat, p.RemoteError: on_worker_error}
    trainer_handlers = {p.TrainerHello: on_trainer_hello, p.Weights: on_weights}

    poller = zmq.Poller()
    for sock in (steps, policy_sock, *link.sockets()):
        poller.register(sock, zmq.POLLIN)
    try:
        while not stop and not link.shutdown_reason:
            now = time.monotonic()
            if now - rate_t0 >= 2.0:
                steps_per_s, rate_steps, rate_t0 = rate_steps / (now - rate_t0), 0, now
            next_beat = link.beat(now, figures)
            timeout_s = min(next_beat, look_again or next_beat) - now
            poller.register(experience, zmq.POLLOUT if assembler_blocked else 0)
            events = dict(poller.poll(max(0, min(timeout_s * 1000, node.MAX_POLL_MS))))
            for msg in link.poll(events):
                if isinstance(msg, p.Barrier):
                    on_barrier(msg.epoch, msg.options)
            if link.state is not None and link.state.epoch > epoch:  # a missed broadcast
                on_barrier(link.state.epoch, link.state.options)
            if deferred and (link.state is not None or now - started >= RUN_STATE_GRACE_S):
                if link.state is None:
                    log.warning("no run state from the controller at %s within %.0fs; serving "
                                "workers at epoch %d without it", cfg.controller,
                                RUN_STATE_GRACE_S, epoch)
                for ident, hello in list(deferred.items()):
                    on_hello(ident, hello, time.monotonic())
                deferred.clear()
            if steps in events:
                node.serve(steps, rejects, worker_handlers)
            if policy_sock in events:
                node.serve(policy_sock, rejects, trainer_handlers)
            now = time.monotonic()
            for w in list(workers.values()):
                if now - w.last_seen > node.HEARTBEAT_INTERVAL_S * node.LIVENESS_INTERVALS:
                    forget(w, f"silent for {now - w.last_seen:.1f}s")
            if phase is Phase.BARRIER and all(w.epoch == epoch for w in workers.values()):
                phase = Phase.RUNNING
                log.info("barrier epoch %d complete: %d workers reset, %d lost during it", epoch,
                         len(workers), len(barrier_lost))
                link.send(p.BarrierDone(epoch=epoch, workers_reset=len(workers),
                                        workers_lost=len(barrier_lost),
                                        errors=barrier_errors[:20]))
            look_again = dispatch(now) if phase is Phase.RUNNING else None
        log.info("broker stopping (%s)", link.shutdown_reason or stop.reason)
        return 0
    finally:
        link.close()
        wiring.destroy(ctx, wiring.LINGER_MS)
