"""The evaluator: greedy episodes of each new policy version (or of every --eval-every N) on
envs of its own, and their mean return sent back to the learner that made the version.

It sits beside the training path, never on it. A learner sends each new version's WEIGHTS (the
message the broker gets) on its "evaluation" DEALER too, which queues only to a connected
evaluator and only two deep: with no evaluator, or a busy one, the send fails at once and the
version goes unevaluated, so no learner or broker ever waits for it. The evaluator binds
(ROUTER), as the long-lived processes do, and answers on the same connection with an
EVAL_RESULT, which the learner writes into its metrics. Losing it loses evaluations only.

Episodes: --eval-episodes spread over --eval-envs envs, env i playing its share (as SB3's
`evaluate_policy` does, so short episodes are not favoured), every evaluation resetting env i
with the same seed, so every version meets the same episodes. Actions are the policy's greedy
ones (`Policy.act(..., deterministic=True)`) on observations normalised with the statistics the
version's weights carry, as the broker acts (`normalize.Normalizing`). Episodes are played one
batch step after another in `tick`, at most TURN_BUDGET_S at a time, so the loop keeps
heartbeating and taking newer weights in while it plays; a version that came while another was
played waits, and only the newest waiting one is played next.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from stepbus import normalize, policy
from stepbus.bus import checks, node, policies, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.exits import SettingError
from stepbus.bus.topology import PortName, Role
from stepbus.policy import ModelConfig, State
from stepbus.workers import envs as env_making
from stepbus.workers.envset import EnvSet

TURN_BUDGET_S = 0.02  # playing takes the loop for at most this long before it looks around
DEFAULT_CPU_SHARE = 0.05  # --eval-cpu-share
MAX_EPISODES = 10_000
# The `worker_index` of the evaluator's episode seeds: none of a run's workers has it, so an
# evaluation's episodes are not the first ones training stepped.
SEED_INDEX = 1 << 20
RATE_INTERVAL_S = 2.0
PRIORITY_IDLE, PRIORITY_LOW, PRIORITY_NORMAL = "idle", "low", "normal"  # --cpu-priority


def _priority(text: str) -> str:
    """--cpu-priority's check: ValueError naming the choices."""
    if text not in (PRIORITY_IDLE, PRIORITY_LOW, PRIORITY_NORMAL):
        raise ValueError(f"idle, low or normal, not {text!r}")
    return text


def lower_priority(priority: str) -> None:
    """This process's CPU priority, as --cpu-priority says: SCHED_IDLE where there is one
    (else nice 19), or nice 10."""
    if priority == PRIORITY_IDLE and hasattr(os, "sched_setscheduler"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif priority != PRIORITY_NORMAL:
        os.nice(19 if priority == PRIORITY_IDLE else 10)


@dataclass
class Config:
    env: str = env_making.env_field()
    env_kwargs: str = env_making.env_kwargs_field()
    eval_episodes: int = field(default=10, metadata={"min": 1, "max": MAX_EPISODES,
        "help": "greedy episodes played for each version evaluated; their mean return is "
                "eval_return"})
    eval_every: int = field(default=1, metadata={"min": 1,
        "help": "evaluate a version only once it is at least this many versions above the "
                "last one evaluated (1: each new version the evaluator has time for)"})
    eval_envs: int = field(default=4, metadata={"min": 1, "max": checks.MAX_ENVS_PER_WORKER,
        "help": "envs stepped together as one batch (no more than --eval-episodes are made)"})
    seed: int = field(default=0, metadata={"min": 0,
        "help": "env i of every evaluation is reset with a seed derived from this, so every "
                "version meets the same episodes"})
    policy_name: str = field(default=policies.DEFAULT, metadata={
        "help": "the policy evaluated; weights of other policies are ignored (counted)"})
    eval_cpu_share: float = field(default=DEFAULT_CPU_SHARE, metadata={"above": 0, "max": 1,
        "help": "the most of one core playing may take: after each 20 ms slice of play "
                "the evaluator rests so that playing is at most this share of its time (a "
                "flat-out evaluator slowed a 2-core CartPole run's stepping by a fifth even at "
                "idle priority; docs/performance.md); 1: no rest"})
    cpu_priority: str = field(default=PRIORITY_IDLE, metadata={wiring.CHECK: _priority,
        "help": "idle: Linux SCHED_IDLE (a woken worker, broker or learner takes the core "
                "at once; else nice 19); low: nice 10; normal. With --eval-cpu-share, what "
                "keeps the evaluator from slowing training"})
    evaluation: str = wiring.endpoint("evaluation", "ROUTER endpoint to bind for learners")
    controller: str = wiring.endpoint("controller", "controller endpoint to connect")
    broadcast: str = wiring.endpoint("broadcast", "controller broadcast endpoint to connect")
    models: ModelConfig = field(default_factory=ModelConfig)
    security: wiring.Security = field(default_factory=wiring.Security)


@dataclass(frozen=True)
class EnvSettings:
    """What the evaluator's `EnvSet` reads (`envset.EnvSettings`)."""

    env: str
    env_kwargs: str
    envs_per_worker: int
    seed: int
    name: str
    worker_index: int = SEED_INDEX
    max_env_restarts_per_minute: int = 10
    episode_statistics: bool = False


class Phase(enum.Enum):
    IDLE = "idle"  # waiting for the weights of a version that is due
    PLAYING = "playing"  # one version's episodes under way


@dataclass
class EvalCounts:
    """What the evaluator did and passed over; each a figure of `stepbus status`."""

    evaluations: int = 0
    versions_skipped: int = 0  # due, and replaced by a newer one before they were played
    other_policy_weights: int = 0  # another policy's (--policy-name)
    act_failures: int = 0  # versions whose weights raised while acting: not evaluated
    env_errors: int = 0  # env calls that raised (the env was recreated)


class Episodes:
    """One evaluation's episodes: env i plays `targets[i]` of them; each env's return and
    length run until it ends one."""

    def __init__(self, n_envs: int, n_episodes: int) -> None:
        self.targets = np.array([(n_episodes + i) // n_envs for i in range(n_envs)])
        self.played = np.zeros(n_envs, np.int64)
        self.running_return = np.zeros(n_envs, np.float64)
        self.running_length = np.zeros(n_envs, np.int64)
        self.returns: list[float] = []
        self.lengths: list[int] = []

    def add(self, reward: np.ndarray, ended: np.ndarray) -> None:
        self.running_return += reward
        self.running_length += 1
        for i in np.flatnonzero(ended):
            if self.played[i] < self.targets[i]:
                self.returns.append(float(self.running_return[i]))
                self.lengths.append(int(self.running_length[i]))
                self.played[i] += 1
            self.running_return[i], self.running_length[i] = 0.0, 0

    @property
    def finished(self) -> bool:
        return bool((self.played >= self.targets).all())


class Evaluator(node.Process):
    """Takes WEIGHTS in on "evaluation" (a learner's DEALER), plays the newest due version's
    greedy episodes in `tick`, and answers that learner with an EVAL_RESULT."""

    role = "evaluator"
    sockets = Role.EVALUATOR

    def __init__(self, cfg: Config, envs: EnvSet, ports: node.Ports, log: logging.Logger, *,
                 name: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        """Raises ValueError when the model cannot act on the env's spaces."""
        super().__init__(ports, log, name=name, clock=clock)
        self.cfg, self.envs = cfg, envs
        envs.report = self.on_env_error
        self.policy = normalize.Normalizing(
            policy.make_policy(cfg.models.model, envs.spec, device=cfg.models.device))
        self.rng = np.random.default_rng(cfg.seed)  # greedy acting draws nothing from it
        self.phase = Phase.IDLE
        self.due: tuple[bytes, p.Weights] | None = None  # the next version to play
        self.learner = b""  # the one whose version is being played
        self.last_started = -1  # the version played last (or now)
        self.episodes = Episodes(envs.rows, cfg.eval_episodes)
        self.obs: p.Obs = envs.last_obs
        self.state: State | None = None
        self.began = self.now
        self.last_result: p.EvalResult | None = None
        self.resting_until = -math.inf  # playing waits until then (--eval-cpu-share)
        self.counts = EvalCounts()
        self.rows_stepped, self.rate_rows, self.rate_since, self.rows_per_s = 0, 0, self.now, 0.0
        self.every("rate", RATE_INTERVAL_S, self.measure_rate)

    # -- weights in
    def on_weights(self, peer: bytes, msg: p.Weights) -> None:
        if msg.policy != self.cfg.policy_name:
            self.counts.other_policy_weights += 1
            return
        if not 0 <= msg.version < 2**53:
            self.refuse("bad weights", f"version {msg.version}", claims=msg.trainer)
            return
        waiting = self.due[1].version if self.due is not None else -1
        if msg.version <= max(self.last_started, waiting):
            return  # sent again, or older than what is played or waiting
        if self.last_started >= 0 and msg.version < self.last_started + self.cfg.eval_every:
            return  # not due (--eval-every)
        problem = self.policy.weights_problem(msg.params)
        if problem:
            self.refuse("bad weights", f"{problem} (weights {policy.fingerprint(msg.params)}; "
                        f"this evaluator acts with --model {self.cfg.models.model})",
                        claims=msg.trainer)
            return
        if self.due is not None:
            self.counts.versions_skipped += 1
        self.due = (peer, msg)

    # -- playing
    def tick(self, now: float) -> float:
        if self.phase is Phase.IDLE and self.due is not None:
            self.start()
        began = self.clock()
        if began < self.resting_until:  # woken by a message mid-rest: the rest goes on
            return self.resting_until
        while self.phase is Phase.PLAYING and self.clock() < began + TURN_BUDGET_S:
            self.step()
        if self.phase is not Phase.PLAYING:
            return math.inf
        share, ended = self.cfg.eval_cpu_share, self.clock()
        self.resting_until = ended + (ended - began) * (1 - share) / share
        return self.resting_until

    def start(self) -> None:
        """The due version's episodes begin: every env reset with its evaluation seed."""
        assert self.due is not None
        (self.learner, weights), self.due = self.due, None
        self.last_started = weights.version
        self.policy.load(weights.params, weights.version)
        n = self.envs.rows
        self.envs.seeding = p.SEEDING_GYMNASIUM  # later episodes continue each env's generator
        seeds: list[int | None] = [env_making.episode_seed(self.cfg.seed, SEED_INDEX, i, 0)
                                   for i in range(n)]
        self.obs = self.envs.reset({}, seeds=seeds)
        self.state = self.policy.initial_state(n) if self.policy.recurrent else None
        self.episodes = Episodes(n, self.cfg.eval_episodes)
        self.phase, self.began = Phase.PLAYING, self.clock()

    def step(self) -> None:
        """One greedy action for every env, and what came of it."""
        try:
            actions, state = self.act()
        except Exception as exc:  # weights that passed their checks yet fail here: go on
            self.counts.act_failures += 1
            self.log.warning("version %d failed to act (%s: %s): not evaluated",
                             self.policy.version, type(exc).__name__, str(exc)[:200])
            self.phase = Phase.IDLE
            return
        result = self.envs.step(actions, {})
        ended = result.terminated | result.truncated
        self.episodes.add(result.reward, ended)
        if state is not None and ended.any():  # an ended episode's next one starts afresh
            fresh = self.policy.initial_state(len(ended))
            for key, rows in state.items():
                rows[ended] = fresh[key][ended]
        self.obs, self.state = result.obs, state
        self.rows_stepped += len(ended)
        if self.episodes.finished:
            self.report()

    def act(self) -> tuple[np.ndarray, State | None]:
        if self.state is not None:
            actions, _, _, state = self.policy.act_recurrent(self.obs, self.state, self.rng,
                                                             deterministic=True)
            return actions, state
        return self.policy.act(self.obs, self.rng, deterministic=True)[0], None

    def report(self) -> None:
        """The version's result, to the learner that sent it."""
        returns = np.asarray(self.episodes.returns)
        result = p.EvalResult(
            evaluator=self.name, policy=self.cfg.policy_name, version=self.last_started,
            episodes=len(returns), mean_return=float(returns.mean()),
            std_return=float(returns.std()), mean_length=float(np.mean(self.episodes.lengths)))
        self.send(PortName.EVALUATION, result, to=self.learner)
        self.last_result, self.phase = result, Phase.IDLE
        self.counts.evaluations += 1
        self.log.info("version %d: mean return %.2f +- %.2f over %d greedy episodes (%.1fs)",
                      result.version, result.mean_return, result.std_return, result.episodes,
                      self.clock() - self.began)

    def on_env_error(self, error: p.RemoteError) -> None:
        """An env raised: its `EnvSet` logged it and recreates it; counted here."""
        self.counts.env_errors += 1

    # -- figures
    def measure_rate(self, now: float) -> None:
        self.rows_per_s = (self.rows_stepped - self.rate_rows) / max(now - self.rate_since, 1e-9)
        self.rate_rows, self.rate_since = self.rows_stepped, now

    def figures(self) -> dict[str, Any]:
        last = self.last_result
        return {"state": self.phase.value, "policy": self.cfg.policy_name,
                "policy_version": last.version if last is not None else -1,
                "evaluating": self.last_started if self.phase is Phase.PLAYING else -1,
                "eval_return": None if last is None else round(last.mean_return, 2),
                "eval_return_std": None if last is None else round(last.std_return, 2),
                "eval_episodes": None if last is None else last.episodes,
                "eval_steps_per_s": round(self.rows_per_s, 1),
                **dataclasses.asdict(self.counts), **self.rejects.figures()}

    def finish(self) -> None:
        self.envs.close()
        self.log.info("evaluator stopping (%s); %d versions evaluated", self.stop_reason,
                      self.counts.evaluations)


def make_envs(cfg: Config, name: str, log: logging.Logger) -> EnvSet:
    """The evaluator's own envs, made before anything connects, so a bad --env is told at once.
    Raises SettingError."""
    try:
        env_making.env_kwargs(cfg.env_kwargs)
        made = EnvSet(EnvSettings(cfg.env, cfg.env_kwargs, min(cfg.eval_envs, cfg.eval_episodes),
                                  cfg.seed, name), lambda error: None, log)
    except Exception as exc:
        raise SettingError(f"cannot create environment {cfg.env!r}: {type(exc).__name__}: "
                           f"{exc}") from None
    if made.agents:
        made.close()
        raise SettingError(f"{cfg.env} is a multi-agent env: the evaluator plays Gymnasium "
                           "envs only")
    return made


def open_evaluator(ctx: zmq.Context, cfg: Config, log: logging.Logger, *,
                   raise_env_errors: bool = False) -> node.Opened:
    """The evaluator on its sockets, for its own process (`run`) or the serial runner, which
    has an env's exception raised as it is (`raise_env_errors`). Raises SettingError."""
    name = os.environ.get("HONCHO_PROCESS_NAME") or "evaluator"
    try:
        policy.check_model(cfg.models)
        policies.check_name(cfg.policy_name)
    except ValueError as exc:
        raise SettingError(str(exc)) from None
    envs = make_envs(cfg, name, log)
    envs.raise_errors = raise_env_errors
    link = node.ControllerLink(ctx, role="evaluator", name=name, controller=cfg.controller,
                               broadcast=cfg.broadcast, log=log,
                               binds={"evaluation": cfg.evaluation})
    try:
        sockets = topology.open_role(ctx, Role.EVALUATOR, topology.endpoints_of(cfg))
        evaluator = Evaluator(cfg, envs, node.SocketPorts(
            {**sockets, PortName.CONTROLLER: link.dealer}), log, name=name)
    except ValueError as exc:  # the model does not fit the env's spaces
        link.close()
        envs.close()
        raise SettingError(f"--model {cfg.models.model} cannot act on {cfg.env}: {exc}") from None
    except BaseException:
        link.close()
        envs.close()
        raise
    log.info("evaluator: weights from learners on %s; %d greedy episodes of %s on %d envs "
             "per version evaluated, every %d version(s) at most", cfg.evaluation,
             cfg.eval_episodes, cfg.env, envs.rows, cfg.eval_every)
    ports: dict[str, node.Port] = {PortName.EVALUATION: node.Port(
        sockets[PortName.EVALUATION], (p.Weights,), routed=True)}
    return node.Opened(evaluator, ports, link)


def run(cfg: Config) -> int:
    log = node.setup_logging("evaluator")
    lower_priority(cfg.cpu_priority)
    return node.run_role(lambda ctx: open_evaluator(ctx, cfg, log), cfg.security,
                         node.StopFlag())
