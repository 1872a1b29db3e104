"""The step broker: serves whichever workers are ready, batches their observations for one
policy inference, stamps actions with the policy version, and forwards experience.

Never waits for the slowest worker: by default the results at hand are acted on at once (those
that arrived during the last inference batch together). With `batch_wait_ms`, a result waits
until every other worker has also replied or that long, whichever is first, and only for a
worker expected back within that bound (each worker's step round trip is tracked). Waiting
measured slower on every benchmark here, so it is off by default.

Flow control is a credit window per policy (bus/credit.py): the broker steps at most `window`
env steps beyond what the trainer reports as received, so stepping pauses, not drops, while no
trainer is consuming. The workers live in bus/worker_table.py, the reset barrier in
bus/barrier.py; `PolicySlot` below is the one place the broker touches the model.

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
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from stepbus import normalize, policy
from stepbus.bus import checks, node, policies, relay, rows, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.barrier import ResetBarrier
from stepbus.bus.credit import (
    STARVING_PATIENCE_S,
    STEPS_BEYOND_HORIZON,
    Credit,
    DueVersions,
    Weights,
)
from stepbus.bus.exits import SettingError
from stepbus.bus.memory import Memory
from stepbus.bus.topology import PortName, Role
from stepbus.bus.worker_table import Worker, WorkerTable
from stepbus.policy import ModelConfig, Policy, State

# How long a new broker defers new workers' hellos until the controller has told it the run's
# epoch and reset options: a broker restarted mid-run must not reset envs without the last
# barrier's options (and step them) before it knows them. Deferred hellos are answered as soon as
# the run state is in (one controller round trip); without a controller, after this grace.
RUN_STATE_GRACE_S = 2 * node.HEARTBEAT_INTERVAL_S * node.LIVENESS_INTERVALS
IDLE_RESET_S = 2 * node.HEARTBEAT_INTERVAL_S  # a worker idle this long while we wait: reset it
EXPERIENCE_EVENTS = "experience_events"  # the experience socket's monitor: the assembler gone
RATE_INTERVAL_S = 2.0  # steps_per_s is measured over this long
MAX_AWAITING_SPEC = 64  # trainers answered once the first worker brings the spec; others retry

Outputs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # actions, logp, value, versions


@dataclass
class Config:
    steps: str = wiring.endpoint("steps", "ROUTER endpoint to bind for workers")
    policy: str = wiring.endpoint("policy", "ROUTER endpoint to bind for trainers")
    experience: str = wiring.endpoint("experience", "assembler endpoint to PUSH experience to")
    controller: str = wiring.endpoint("controller", "controller endpoint to connect")
    broadcast: str = wiring.endpoint("broadcast", "controller broadcast endpoint to connect")
    batch_wait_ms: float = field(default=0.0, metadata={"min": 0,
        "help": "longest wait for more workers to fill one inference batch (only for "
                "workers expected back within it; 0: act on whoever is ready)"})
    max_steps_ahead: int = field(default=0, metadata={"min": 0,
        "help": "credit window in env steps beyond what the trainer received "
                "(0: two trainer batches + the horizon + 2 per env)"})
    seed: int = field(default=0, metadata={"min": 0,
                                           "help": "seeds the policy's action sampling"})
    deterministic: bool = field(default=False, metadata={
        "help": "reproducible runs (with one worker): wait for every worker's reply and batch "
                "them by name, no batch wait; act at step count S with the newest policy "
                "version made from at most S minus the credit window steps"})
    policy_map: str = field(default="", metadata={
        "help": "agents to policies by name pattern, first match wins, e.g. "
                "'adversary_*=red,*=default' (fnmatch; unmatched agents and a Gymnasium env's "
                "unnamed agent: 'default'); each policy is served by its own trainer"})
    models: ModelConfig = field(default_factory=ModelConfig)
    external: bool = field(default=False, metadata={
        "help": "relay for a vector env client (stepbus.vector): the policy lives in the "
                "client, so no model, trainer or assembler; workers' results go to the client "
                "on --vector and its actions back (bus/relay.py)"})
    vector: str = wiring.endpoint("vector", "ROUTER endpoint to bind for a vector env client "
                                  "(with --external)")
    security: wiring.Security = field(default_factory=wiring.Security)


@dataclass
class BrokerCounts:
    """What the broker dropped, refused or lost, and how observations crossed shared memory;
    each field is a figure of `stepbus status` under its own name."""

    stale_dropped: int = 0  # replies from before a reset or a restart
    experience_dropped: int = 0  # the assembler's queue was full or it went away
    workers_lost: int = 0
    stale_hellos: int = 0  # a known worker's, from the connection it replaced: dropped
    spec_refused: int = 0  # hellos whose spaces are unusable or differ from the run's
    act_failures: int = 0  # batches the model raised on (its weights put aside)
    weights_refused: int = 0  # weights the model cannot load (another model's, or broken)
    determinism_lost: int = 0  # deterministic mode gave up waiting for a trainer's intake
    shm_refused: int = 0  # segments we would not or could not map
    shm_slots_forwarded: int = 0  # batches the assembler reads from the segment itself
    shm_rows_forwarded: int = 0  # batches whose rows we copied onto the socket
    shm_segments_removed: int = 0  # segments of dead workers removed
    assembler_disconnects: int = 0  # the assembler's connection dropped (it died or was killed)

    def figures(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class ActFailed(RuntimeError):
    """A policy's model raised while acting: its weights are put aside."""


class PolicySlot:
    """One policy: the model it acts with, its credit window, and (deterministic mode) the
    versions received and not due yet. The only place the broker touches the model, and only
    through the `Policy` interface (stepbus/policy.py): built once the first worker tells the
    spaces; weights that come before them are held until then."""

    def __init__(self, name: str, rng: np.random.Generator, max_steps_ahead: int,
                 model: policy.ModelConfig | None = None, *, deterministic: bool = False
                 ) -> None:
        self.name, self.rng = name, rng
        self.model = model or policy.ModelConfig(model=policy.DEFAULT)
        self.policy: Policy | None = None
        self.early: tuple[Weights, int] | None = None  # weights that came before the spaces
        self.refused = ""  # why the newest weights were refused ("": they were not)
        self.newest = -1  # the newest version received (deterministic mode: maybe not yet due)
        # deterministic mode places due versions on the credit scale: it must not rescale
        self.credit = Credit(max_steps_ahead, rescales=not deterministic)
        self.due = DueVersions()
        # The weights acted with, and those before them: what to go back to should the
        # current ones fail on observations their trial step did not cover.
        self.current: tuple[Weights, int] | None = None
        self.previous: tuple[Weights, int] | None = None

    @property
    def version(self) -> int:
        """The version we act with (-1: none yet)."""
        if self.policy is not None:
            return self.policy.version
        return self.early[1] if self.early is not None else -1

    @property
    def loaded(self) -> bool:
        return self.version >= 0

    def build(self, spec: p.SpaceSpec) -> None:
        """Act on these spaces; weights that came before them and do not fit are dropped.

        Raises:
            ValueError: the model cannot act on these spaces.
        """
        # The learner's observation statistics, when its weights carry them, act here too.
        with node.beating_through():  # a user's model may load pretrained weights here
            self.policy = built = normalize.Normalizing(
                policy.make_policy(self.model.model, spec, device=self.model.device))
        early, self.early = self.early, None
        if early is not None and not built.weights_problem(early[0]):
            built.load(*early)
        self.due.pending = collections.deque(
            due for due in self.due.pending if not built.weights_problem(due[2]))
        # Dropped versions are not the newest: the trainer's republished ones are taken again.
        self.newest = max([self.version, *(due[1] for due in self.due.pending)])

    def check(self, params: Weights) -> str:
        """Why these weights cannot drive inference (empty: they can, or no spaces yet)."""
        problem = self.policy.weights_problem(params) if self.policy is not None else ""
        self.refused = problem and (f"{problem} (weights {policy.fingerprint(params)}; this "
                                    f"broker serves --model {self.model.model})")
        return self.refused

    def load(self, params: Weights, version: int) -> None:
        if self.policy is None:
            self.early = (params, version)
        else:
            if self.policy.loaded and self.current is not None:
                self.previous = self.current
            self.policy.load(params, version)
            self.current = (params, version)

    def act(self, obs: p.Obs, state: State | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, State | None]:
        """Actions, their log-probabilities and the values for a batch of observations, and
        (a recurrent model, acting from `state`) each row's next state.

        Raises:
            ActFailed: the model raised on these observations with these weights; they are
                put aside (the slot acts with the weights before them, or waits for new ones).
        """
        assert self.policy is not None
        try:
            if state is not None:
                return self.policy.act_recurrent(obs, state, self.rng)
            return (*self.policy.act(obs, self.rng), None)
        except Exception as exc:  # weights passed their checks yet fail here: never crash
            failed = self.policy.version
            self.fall_back()
            self.refused = f"version {failed} failed to act: {type(exc).__name__}: {exc}"[:200]
            raise ActFailed(self.refused) from exc

    def fall_back(self) -> None:
        """Back to the weights before the current ones, or to none (wait for the trainer)."""
        assert self.policy is not None
        previous, self.previous, self.current = self.previous, None, None
        if previous is not None:
            self.load(*previous)
        else:
            self.policy.version = -1


def credit_figures(credit: Credit) -> dict[str, int]:
    """A policy's credit window as `stepbus status` shows it (docs/operations.md)."""
    return {"outstanding_steps": credit.outstanding(), "credit_window": credit.window(),
            "credit_topups": credit.topups, "credit_rebases": credit.rebases,
            "credit_unexplained": credit.unexplained, "credit_braked": credit.braked,
            "credit_rescaled": credit.rescaled, "credit_rescale_held": credit.rescale_held}


class Broker(node.Process):
    """Workers on "steps", trainers on "policy", experience out on "experience" and barrier
    reports on "controller". `tick` purges silent workers, ends a barrier once every worker
    reset, and dispatches the ready results."""

    role = "broker"
    sockets = Role.BROKER

    def __init__(self, cfg: Config, ports: node.Ports, log: logging.Logger, *,
                 rules: list[tuple[str, str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(ports, log, clock=clock)
        self.cfg, self.rules = cfg, rules
        rng = np.random.default_rng(cfg.seed)
        self.slots = [PolicySlot(name, rng, cfg.max_steps_ahead, cfg.models,
                                 deterministic=cfg.deterministic)
                      for name in policies.policy_names(rules)]
        self.by_name = {slot.name: slot for slot in self.slots}
        self.table = WorkerTable(rules, list(self.by_name))
        self.barrier = ResetBarrier()
        self.counts = BrokerCounts()
        self.env_id = ""
        self.spec: p.SpaceSpec | None = None  # the spaces every worker must share
        # Trainers that said hello before the spec was known, answered as soon as it is (or
        # they would wait for their next hello); bounded, as anyone can say hello.
        self.awaiting_spec: dict[bytes, p.TrainerHello] = {}
        self.memory: Memory | None = None  # each agent's state, for a recurrent model
        self.assembler_blocked = False  # only true while it is what holds ready work back
        self.held_by = ""  # with several policies: the one whose weights or window holds us
        self.rate_steps, self.rate_since, self.steps_per_s = 0, self.now, 0.0
        self.every("rate", RATE_INTERVAL_S, self.measure_rate)
        self.at("run_state_grace", self.started + RUN_STATE_GRACE_S, self.run_state_grace_over)
        log.info("broker: workers on %s, trainers on %s, experience to %s%s",
                 cfg.steps, cfg.policy, cfg.experience,
                 f"; policies {', '.join(self.by_name)} ({cfg.policy_map})" if rules else "")

    # -- workers
    def on_worker_hello(self, peer: bytes, msg: p.WorkerHello) -> None:
        w = self.table.get(peer)
        if w is None and self.table.known_as(msg.worker, msg.incarnation):
            # Queued on a connection the worker has replaced since (a reconnect after we froze):
            # ROUTER_HANDOVER gives the old connection a made-up routing id until it is gone.
            self.counts.stale_hellos += 1
            return
        if w is not None and w.incarnation == msg.incarnation:
            w.last_seen = self.now
            if w.unreachable_since is not None or (
                    w.in_flight and self.now - w.ready_since > IDLE_RESET_S):
                self.reset_worker(w)  # it is idle, yet we wait on it: a message was lost
                w.ready_since = self.now
            return
        if self.run_state is None and self.now - self.started < RUN_STATE_GRACE_S:
            if self.table.defer(peer, msg):
                self.log.info("worker %s waits until the controller tells the run's epoch and "
                              "reset options (at most %.0fs)", msg.worker, RUN_STATE_GRACE_S)
            return
        if self.accepts(msg):
            self.join(peer, msg)

    def accepts(self, msg: p.WorkerHello) -> bool:
        """The hello is usable: its rows in range, its agents well named, the run's spaces
        (the first usable hello sets them)."""
        problem = checks.hello_rows_problem(msg)
        if problem:
            self.refuse("bad hello", problem, claims=msg.worker)
            return False
        if self.spec is None:
            problem = checks.spec_problem(msg.spec)
            if problem:
                self.counts.spec_refused += 1
                self.refuse("bad spec", problem, claims=msg.worker)
                return False
            try:
                for slot in self.slots:
                    slot.build(msg.spec)
            except ValueError as exc:  # the model does not fit these spaces
                self.counts.spec_refused += 1
                self.refuse("bad spec", str(exc)[:300], claims=msg.worker)
                return False
            self.env_id, self.spec = msg.env_id, msg.spec
            built = self.slots[0].policy
            if built is not None and built.recurrent:
                self.memory = Memory(built.initial_state)
            for trainer, hello in self.awaiting_spec.items():
                self.on_trainer_hello(trainer, hello)
            self.awaiting_spec.clear()
        elif msg.spec != self.spec:
            self.counts.spec_refused += 1
            self.refuse("spec mismatch",
                        f"{msg.env_id} {msg.spec} differs from {self.env_id} {self.spec}",
                        claims=msg.worker)
            return False
        return True

    def join(self, peer: bytes, msg: p.WorkerHello) -> None:
        w, old = self.table.join(peer, msg, self.now)
        if old is not None:
            self.log.info("worker %s restarted (incarnation %s)", msg.worker, msg.incarnation)
        else:
            self.log.info("worker %s joined: %d x %s", msg.worker, msg.num_envs, msg.env_id)
        if self.rules:
            self.log.info("worker %s: %s", msg.worker, ", ".join(
                f"{agent or '(agent)'} -> {name}" for agent, name in
                zip(msg.agents or [""], w.agent_policies, strict=True)))
        if old is not None:
            self.counts.shm_segments_removed += self.table.detach(old)
        refused = self.table.attach(w, msg)
        if refused:
            self.counts.shm_refused += 1
            self.log.warning("worker %s: %s", msg.worker, refused)
        self.count_rows()
        self.reset_worker(w)

    def on_step_result(self, peer: bytes, msg: p.StepResult) -> None:
        w = self.table.get(peer)
        if w is None or not w.expects(msg):
            self.counts.stale_dropped += 1
            return
        w.last_seen, w.in_flight, w.stepping = self.now, False, False
        if msg.obs_slot != -1:  # the rows are in its segment: read them in place
            view = self.segment_rows(w, msg)
            if view is None:
                self.refuse("bad step result",
                            f"obs_slot {msg.obs_slot} is not a batch we can read", claims=w.name)
                self.reset_worker(w)
                return
            msg = dataclasses.replace(msg, obs=view)
        problem = checks.result_problem(msg, w.num_envs, self.spec)
        if problem:
            self.refuse("bad step result", problem, claims=w.name)
            self.reset_worker(w)
            return
        if msg.epoch != self.barrier.epoch:  # drained from before a barrier: keep it, reset
            self.forward(w, msg, None)
            self.reset_worker(w)
            return
        w.took_result(msg, self.now)

    def segment_rows(self, w: Worker, msg: p.StepResult) -> p.Obs | None:
        """The observations of a result that names a slot of w's segment, read in place (None:
        not a batch we can read); the result's zero rows name their layout, which the spec's
        checks then hold them to."""
        if w.segment is None or self.spec is None:
            return None
        view = w.segment.view(msg.obs_slot, msg.obs)
        return view if view is not None and w.segment.holds(msg.obs_slot, msg.seq) else None

    def on_remote_error(self, peer: bytes, msg: p.RemoteError) -> None:
        if self.table.get(peer) is not None:
            self.barrier.env_error(f"{msg.origin}: {msg.error_type}: {msg.message}")

    def on_heartbeat(self, peer: bytes, msg: p.Heartbeat) -> None:
        w = self.table.get(peer)
        if w is not None:
            w.last_seen = self.now  # busy in a long step, not dead

    def send_worker(self, w: Worker, msg: p.Message) -> None:
        """A failed send does not lose the worker at once: after a freeze its hellos queued on
        a connection that is gone come before the one that replaces it. Its next hello retries
        a RESET; unreachable for the liveness timeout, it is lost (`tick`)."""
        if self.send(PortName.STEPS, msg, to=w.ident):
            w.unreachable_since = None
        elif w.unreachable_since is None:
            w.unreachable_since = self.now
            self.log.debug("worker %s unreachable; waiting for its next hello", w.name)

    def reset_worker(self, w: Worker) -> None:
        if w.stepping:  # the STEP's reply will not come: the steps acted for it are lost
            self.may_have_lost(w, 1)
        if w.result is not None:  # its observation gets no action: it becomes a bootstrap
            self.forward(w, w.result, None)
            w.result = None
        w.seq, w.in_flight, w.stepping = w.seq + 1, True, False
        if w.segment is not None:
            w.segment.mark()  # we map it: the worker may send slot numbers after this reset
        self.send_worker(w, p.Reset(epoch=self.barrier.epoch, seq=w.seq,
                                    options=self.barrier.options))

    def forget(self, w: Worker, why: str) -> None:
        if not self.table.forget(w):
            return
        self.counts.shm_segments_removed += self.table.detach(w)
        self.count_rows()
        self.counts.workers_lost += 1
        # its steps in flight and awaiting their rewards (its partial trajectories are sent on)
        self.may_have_lost(w, STEPS_BEYOND_HORIZON)
        self.barrier.worker_lost(w.name)
        if self.memory is not None:
            self.memory.drop(w.name)
        self.log.warning("worker %s %s; serving the others", w.name, why)
        self.send(PortName.EXPERIENCE, p.WorkerLost(worker=w.name, incarnation=w.incarnation,
                                             reason=why))

    def may_have_lost(self, w: Worker, per_row: int) -> None:
        """`per_row` steps of each of `w`'s rows may be lost: each policy may grant that many
        of its rows' back."""
        if len(self.slots) == 1:
            self.slots[0].credit.may_have_lost(w.num_envs * per_row)
            return
        rows = np.bincount(w.row_policy, minlength=len(self.slots)).tolist()
        for slot, n in zip(self.slots, rows, strict=True):
            slot.credit.may_have_lost(n * per_row)

    def on_socket_event(self, port: str, event: int) -> None:
        """The assembler's connection dropped (it died): every step it held or was sent may
        be lost."""
        if event == zmq.EVENT_DISCONNECTED:
            self.counts.assembler_disconnects += 1
            for slot in self.slots:
                slot.credit.may_have_lost(slot.credit.outstanding())

    def count_rows(self) -> None:
        rows = self.table.rows_per_policy(len(self.slots))
        for slot, n in zip(self.slots, rows, strict=True):
            slot.credit.rows = n

    # -- experience
    def forward(self, w: Worker, r: p.StepResult, outputs: Outputs | None,
                state: State | None = None) -> None:
        """A worker's step to the assembler, with the policy's outputs for it (None: no
        action was chosen for its observation, which ends its trajectories as a bootstrap),
        and the recurrent state they were chosen from."""
        action, logp, value, versions = outputs if outputs is not None else (None,) * 4
        version = -1 if versions is None else self.slots[0].version if len(self.slots) == 1 \
            else int(versions.min())
        obs, slot = self.experience_obs(w, r)
        segment = w.segment
        msg = p.Experience(worker=w.name, incarnation=w.incarnation, epoch=r.epoch, seq=r.seq,
                           first=r.first, policy_version=version, obs=obs,
                           reward=r.reward, terminated=r.terminated, truncated=r.truncated,
                           final_obs=r.final_obs, action=action, logp=logp, value=value,
                           alive=r.alive, agents=w.agents,
                           episode=r.episode, episode_seed=r.episode_seed,
                           no_final_obs=r.no_final_obs, agent_policies=w.agent_policies,
                           policy_versions=versions if len(self.slots) > 1 else None,
                           obs_slot=slot, shm=segment.name if segment is not None else "",
                           shm_nonce=w.shm_nonce if segment is not None else "",
                           state=state or {}, split_of=w.split_of, first_env=w.first_env)
        if not self.send(PortName.EXPERIENCE, msg):
            self.counts.experience_dropped += 1
            # Not the worker's fault: counted against the socket it could not go out on.
            self.rejects.refuse(f"assembler at {self.cfg.experience}", p.ProtocolError(
                "experience dropped", "the assembler's queue is full or it went away"))

    def experience_obs(self, w: Worker, r: p.StepResult) -> tuple[p.Obs, int]:
        """A result's observations as the assembler gets them, and their slot: the slot alone
        when the assembler maps the worker's segment too, else the rows (the slot goes back)."""
        segment = w.segment
        if r.obs_slot < 0 or segment is None:
            return r.obs, r.obs_slot
        if segment.reader_fresh():
            self.counts.shm_slots_forwarded += 1
            return rows.take(r.obs, slice(0, 0)), r.obs_slot
        copied = rows.copy(r.obs)  # no (live) assembler here maps it: the rows go on the socket
        segment.release(r.obs_slot, r.seq)
        self.counts.shm_rows_forwarded += 1
        return copied, -1

    # -- trainers
    def known_policy(self, trainer: str, name: str) -> PolicySlot | None:
        slot = self.by_name.get(name)
        if slot is None:
            self.refuse("unknown policy",
                        f"{name[:64]!r}: --policy-map names {', '.join(self.by_name)}",
                        claims=trainer)
        return slot

    def on_trainer_hello(self, peer: bytes, msg: p.TrainerHello) -> None:
        slot = self.known_policy(msg.trainer, msg.policy)
        if slot is None:
            return
        if self.spec is None:
            if len(self.awaiting_spec) < MAX_AWAITING_SPEC or peer in self.awaiting_spec:
                self.awaiting_spec[peer] = msg
            return
        self.send(PortName.POLICY, p.EnvSpec(env_id=self.env_id, spec=self.spec,
                                      policy_version=slot.newest), to=peer)

    def on_weights(self, peer: bytes, msg: p.Weights) -> None:
        if not (1 <= msg.batch_steps <= checks.MAX_BATCH_STEPS and 0 <= msg.consumed_steps < 2**53
                and 0 <= msg.version < 2**53):
            self.refuse("bad weights", f"batch_steps {msg.batch_steps}, consumed_steps "
                        f"{msg.consumed_steps}, version {msg.version}", claims=msg.trainer)
            return
        slot = self.known_policy(msg.trainer, msg.policy)
        if slot is None:
            return
        newer = msg.version > slot.newest
        if newer:  # judged before anything else is taken from the message
            problem = slot.check(msg.params)
            if problem:
                self.counts.weights_refused += 1
                self.refuse("bad weights", problem, claims=msg.trainer)
                return
        unexplained = slot.credit.unexplained
        connected = slot.credit.report(msg.incarnation, msg.consumed_steps, msg.batch_steps,
                                       msg.starving, msg.checkpointed_steps, msg.run,
                                       now=self.now)
        if not msg.starving:  # a starving report's lag is of data that came before the wait
            slot.credit.steer(msg.policy_lag, msg.max_policy_lag)
        if slot.credit.unexplained > unexplained and _power_of_two(slot.credit.unexplained):
            self.log.warning(
                "trainer %s has starved for %.0fs with the credit window full (%d steps "
                "outstanding) and no fault known to have lost steps: granting more; stepping "
                "may run past its policy-lag bound (%d such grants so far, said at powers of "
                "two)", msg.trainer, STARVING_PATIENCE_S, slot.credit.outstanding(),
                slot.credit.unexplained)
        if newer:
            slot.newest = msg.version
            if not self.cfg.deterministic:
                slot.load(msg.params, msg.version)
            else:  # the first message of a version comes right after the trainer made it
                slot.due.add(slot.credit.made_from(msg.consumed_steps), msg.version, msg.params)
        if connected:
            self.log.info("trainer %s (incarnation %s) connected at %s version %d; its count "
                          "of %d steps received %s", msg.trainer, msg.incarnation,
                          "policy" if len(self.slots) == 1 else f"policy {slot.name!r}",
                          msg.version, msg.consumed_steps,
                          "continues the last trainer's" if connected == "continues"
                          else "starts where stepping is now")

    # -- the controller
    def on_barrier(self, peer: bytes, msg: p.Barrier) -> None:
        self.begin_barrier(msg.epoch, msg.options)

    def on_run_state(self, peer: bytes, msg: p.RunState) -> None:
        super().on_run_state(peer, msg)
        for slot in self.slots:
            slot.credit.horizon = msg.horizon or slot.credit.horizon
        if msg.epoch > self.barrier.epoch:  # a missed broadcast
            self.begin_barrier(msg.epoch, msg.options)
        self.answer_deferred()

    def run_state_grace_over(self, now: float) -> None:
        self.now = now
        if self.run_state is None and self.table.deferred:
            self.log.warning("no run state from the controller at %s within %.0fs; serving "
                             "workers at epoch %d without it", self.cfg.controller,
                             RUN_STATE_GRACE_S, self.barrier.epoch)
        self.answer_deferred()

    def answer_deferred(self) -> None:
        for ident, hello in self.table.take_deferred():
            self.deliver(ident, hello, self.now)  # refused, it is counted against `ident`

    def begin_barrier(self, epoch: int, options: dict[str, Any]) -> None:
        if not self.barrier.begin(epoch, options):
            return
        self.log.info("barrier: epoch %d, draining %d workers", epoch, len(self.table))
        for w in self.table:
            if not w.in_flight:
                self.reset_worker(w)

    # -- timekeeping and stepping
    def on_stalled(self, seconds: float) -> None:
        self.log.log(self.stall_log_level, "the broker itself did not run for %.1fs (stopped, "
                     "or starved of CPU): every worker gets a new liveness allowance", seconds)
        self.table.heard_from_all(self.clock())

    def tick(self, now: float) -> float:
        self.now = now  # what is sent from here (a failed send's time) is stamped now
        for w, why in self.table.silent(now):
            self.forget(w, why)
        done = self.barrier.complete(self.table.epochs(), len(self.table))
        if done is not None:
            self.log.info("barrier epoch %d complete: %d workers reset, %d lost during it",
                          done.epoch, done.workers_reset, done.workers_lost)
            self.send(PortName.CONTROLLER, done)
        look_again = self.dispatch(now) if self.barrier.running else math.inf
        self.wake_on_writable = {PortName.EXPERIENCE} if self.assembler_blocked else set()
        return look_again

    def dispatch(self, now: float) -> float:
        """Act on the ready results if nothing holds us back; when to look again (inf: when
        the next message arrives)."""
        self.assembler_blocked = False  # only true while it is what holds ready work back
        ready = self.table.ready()
        if not ready or self.spec is None:
            return math.inf
        acting = [slot for slot in self.slots if slot.credit.rows]
        self.held_by = next((f"{slot.name}: {slot.refused or 'no weights'}"[:120]
                             for slot in acting
                             if not slot.loaded and not slot.due.pending), "") or next(
            (f"{slot.name}: credit window" for slot in acting if slot.credit.full()), "")
        if self.held_by:
            return math.inf  # that trainer's next WEIGHTS message wakes us
        self.assembler_blocked = not self.ports.writable(PortName.EXPERIENCE)
        if self.assembler_blocked:
            return math.inf  # no assembler connected (or it is full): stepping would lose data
        waiting = self.table.in_flight()
        if self.cfg.deterministic:
            if waiting or not all([self.take_due(slot, now) for slot in acting]):
                return math.inf  # every live worker's reply, and the versions due at this count
            ready.sort(key=lambda w: w.name)  # one inference batch, in a fixed order
        elif waiting:
            # Wait (up to the bound) only for a worker expected back within it.
            deadline = min(w.ready_since for w in ready) + self.cfg.batch_wait_ms / 1000
            soonest = min(w.sent_at + w.round_trip_s for w in waiting)
            if now < deadline and soonest < deadline:
                return deadline
        self.step(ready, now)
        return math.inf

    def take_due(self, slot: PolicySlot, now: float) -> bool:
        """Deterministic mode: act with the version due at this step count; False: wait for
        the trainer."""
        due = slot.due.take(slot.credit, now, loaded=slot.loaded)
        if due.wait:
            return False
        if due.abandoned:
            self.counts.determinism_lost += 1
            self.log.warning("deterministic: the %r trainer starves %.0fs short of %d steps it "
                             "must take in before the next policy version is due (lost data, or "
                             "a horizon longer than --max-steps-ahead allows for); going on, so "
                             "this run is no longer reproducible", slot.name, due.waited_s,
                             due.abandoned)
        if due.weights is not None:
            slot.load(due.weights, due.version)
        return slot.loaded

    def step(self, ready: list[Worker], now: float) -> None:
        """One inference batch over the ready workers; each gets its actions and its step
        goes to the assembler."""
        # One worker's observations are the batch as they came: no copy of its frames.
        results = [w.result for w in ready if w.result is not None]
        obs = rows.concat([r.obs for r in results])
        before = None if self.memory is None else [
            self.memory.before_step(w.name, w.incarnation, r, w.num_envs)
            for w, r in zip(ready, results, strict=True)]
        state = None if before is None else {
            key: np.concatenate([held[key] for held in before]) for key in before[0]}
        try:
            actions, logp, value, versions, after = self.act(obs, ready, state)
        except ActFailed as exc:  # the results stay ready: acted on with the weights to come
            self.counts.act_failures += 1
            self.log.error("the model failed to act (%s); %s", exc,
                           "acting with the weights before them" if any(
                               s.loaded for s in self.slots) else "waiting for new weights")
            return
        ends = np.cumsum([w.num_envs for w in ready]).tolist()
        spans = list(zip([0, *ends], ends, strict=False))  # each worker's rows of the batch
        # Every worker gets its actions before any experience is encoded: each steps sooner.
        for w, r, (start, end) in zip(ready, results, spans, strict=True):
            if before is not None and after is not None and self.memory is not None:
                self.memory.after_step(w.name, {k: v[start:end] for k, v in after.items()})
            self.count_steps(w, r)
            w.seq, w.in_flight, w.stepping, w.result = r.seq + 1, True, True, None
            w.ready_since = w.sent_at = now
            self.send_worker(w, p.Step(epoch=self.barrier.epoch, seq=w.seq,
                                       policy_version=int(versions[start]),
                                       actions=actions[start:end]))
        for i, (w, r, (start, end)) in enumerate(zip(ready, results, spans, strict=True)):
            self.forward(w, r, (actions[start:end], logp[start:end], value[start:end],
                                versions[start:end]), None if before is None else before[i])

    def act(self, obs: p.Obs, ready: list[Worker], state: State | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, State | None]:
        """Every policy's outputs on its own rows of one batch, each row's version, and (a
        recurrent model) each row's next state."""
        b = rows.count(obs)
        if len(self.slots) == 1:
            slot = self.slots[0]
            a, lp, v, after = slot.act(obs, state)
            return a, lp, v, np.full(b, slot.version, np.int64), after
        row_policy = np.concatenate([w.row_policy for w in ready])
        versions = np.empty(b, np.int64)
        parts = []
        for k, slot in enumerate(self.slots):
            mine = np.flatnonzero(row_policy == k)
            if len(mine):
                mine_state = None if state is None else {n: v[mine] for n, v in state.items()}
                parts.append((mine, *slot.act(rows.take(obs, mine), mine_state)))
                versions[mine] = slot.version
        _, a, lp, v, after = parts[0]
        actions = np.empty((b, *a.shape[1:]), a.dtype)
        logp, value = np.empty(b, lp.dtype), np.empty(b, v.dtype)
        next_state = None if after is None else {
            n: np.empty((b, *x.shape[1:]), x.dtype) for n, x in after.items()}
        for mine, a, lp, v, after in parts:
            actions[mine], logp[mine], value[mine] = a, lp, v
            for n, x in (after or {}).items():
                next_state[n][mine] = x  # type: ignore[index]
        return actions, logp, value, versions, next_state

    def count_steps(self, w: Worker, r: p.StepResult) -> None:
        """Agent steps, as the learners count them: absent agents' rows are not steps."""
        if len(self.slots) == 1:
            acted = w.num_envs if r.alive is None else int(r.alive.sum())
            self.slots[0].credit.produced += acted
            self.rate_steps += acted
            return
        rows = w.row_policy if r.alive is None else w.row_policy[r.alive]
        for k, n in enumerate(np.bincount(rows, minlength=len(self.slots)).tolist()):
            self.slots[k].credit.produced += n
            self.rate_steps += n

    def measure_rate(self, now: float) -> None:
        self.steps_per_s = self.rate_steps / max(now - self.rate_since, 1e-9)
        self.rate_steps, self.rate_since = 0, now

    def figures(self) -> dict[str, Any]:
        default = self.slots[0]
        figures: dict[str, Any] = {
            "workers": len(self.table), "policy_version": default.version,
            "epoch": self.barrier.epoch, "steps_per_s": round(self.steps_per_s),
            **credit_figures(default.credit),
            "assembler_blocked": self.assembler_blocked, **self.rejects.figures(),
            **self.counts.figures(), "held_by": self.held_by}
        if self.memory is not None:
            figures |= {**self.memory.figures(),
                        "memory_resets": dict(self.memory.resets)}
        if len(self.slots) > 1:  # the figures above are the default policy's; these, each one's
            for slot in self.slots:
                figures[f"policy_version_{slot.name}"] = slot.version
                figures[f"policy_rows_{slot.name}"] = slot.credit.rows
                figures |= {f"{key}_{slot.name}": value
                            for key, value in credit_figures(slot.credit).items()}
        return figures

    def finish(self) -> None:
        self.log.info("broker stopping (%s)", self.stop_reason)


def run(cfg: Config) -> int:
    if cfg.external:
        return relay.run(cfg.steps, cfg.vector, cfg.controller, cfg.broadcast, cfg.security)
    log = node.setup_logging("broker")
    return node.run_role(lambda ctx: open_broker(ctx, cfg, log), cfg.security, node.StopFlag())


def open_broker(ctx: zmq.Context, cfg: Config, log: logging.Logger) -> node.Opened:
    """Raises SettingError for a bad --policy-map or a model that cannot be had."""
    try:
        rules = policies.parse_map(cfg.policy_map)
        policy.check_model(cfg.models)
    except ValueError as exc:
        raise SettingError(str(exc)) from None
    link = node.ControllerLink(ctx, role="broker", name="broker", controller=cfg.controller,
                               broadcast=cfg.broadcast, log=log,
                               binds={"steps": cfg.steps, "policy": cfg.policy})
    try:
        sockets = topology.open_role(ctx, Role.BROKER, topology.endpoints_of(cfg))
        # an assembler gone: the steps it held may be lost, credit may be granted back for them
        assembler_gone = sockets[PortName.EXPERIENCE].get_monitor_socket(zmq.EVENT_DISCONNECTED)
    except BaseException:
        link.close()
        raise
    broker = Broker(cfg, node.SocketPorts({**sockets, PortName.CONTROLLER: link.dealer}), log,
                    rules=rules)
    # What the broker receives where (anything else is refused as bad input).
    ports: dict[str, node.Port] = {
        PortName.STEPS: node.Port(sockets[PortName.STEPS], (
            p.WorkerHello, p.StepResult, p.Heartbeat, p.RemoteError), routed=True),
        PortName.POLICY: node.Port(sockets[PortName.POLICY], (p.TrainerHello, p.Weights),
                                   routed=True),
        PortName.EXPERIENCE: node.Port(sockets[PortName.EXPERIENCE]),
        EXPERIENCE_EVENTS: node.Port(assembler_gone, monitor=True)}
    return node.Opened(broker, ports, link,
                       cleanup=sockets[PortName.EXPERIENCE].disable_monitor)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
