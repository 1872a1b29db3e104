"""The learner process: pulls trajectories, runs the algorithm (PPO by default), publishes
versioned weights, checkpoints. `stepbus trainer` runs it inside a trainer slot (trainer/slot.py)
that restarts and swaps it; `stepbus learner` runs it bare.

Startup: learn the run id from the controller (the run directory is `runs_dir/run_id`), ask the
broker for the env spec and its newest policy version, resume from the run's checkpoint if there
is one, and publish weights at a version above both. A learner killed and started again inside
the same run therefore continues where the last checkpoint left off, with higher versions and the
next generation. Every trajectory taken in is receipted to the assembler, as learned only once a
checkpoint holds the learning (metrics records wait for it too), and the assembler resends what
a killed learner never receipted as learned: nothing confirmed is lost, nothing is learned zero
times.

A batch is the first trajectories taken in that sum to at least `batch_steps`, in arrival order:
intake stops while a batch is full, so which trajectories an update learns from, and which
policy versions count as stale, never depend on how many happened to be queued. Each metrics
record carries a digest of every trajectory this learner took in, so two runs can be compared.

The wait for the run id and the env spec comes first (`LearnerSetup`, a process on the loop):
what the learner is built from is known only then. `Learner` takes its place on the same loop
and sockets from there on.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import os
import signal
import socket as pysocket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from stepbus import __version__, normalize, policy, runconfig
from stepbus.bus import node, policies, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.exits import Exit, SettingError
from stepbus.bus.topology import PortName, Role
from stepbus.policy import ModelConfig
from stepbus.trainer import algorithm, checkpoint, resume
from stepbus.trainer.algorithm import CannotStart, PPOConfig
from stepbus.trainer.checkpoint import Unsaved
from stepbus.trainer.curriculum import Curriculum
from stepbus.trainer.intake import Batch, RunDigest
from stepbus.trainer.metrics import (
    RECORD_INTERVAL_S,
    IntakeStats,
    MetricsFiles,
    ProgressLog,
    RecordCadence,
)
from stepbus.trainer.model import Model
from stepbus.trainer.progress import TARGET_MET, Progress, progress_of
from stepbus.trainer.receipts import Receipts

RECEIPTS_WARN_S = 5.0  # receipts undelivered this long: say so (a wrong --receipts?)
SHUTDOWN_DRAIN_MAX_S = 1.5  # at shutdown, take the assembler's flush for at most this long
RECEIPT_INTERVAL_S = 0.02  # receipts go out this often at most (the assembler's bound waits)
QUIET_S = 0.25  # no trajectories in and no weights out for this long: send the weights again
SHUTDOWN_REQUEST_INTERVAL_S = 1.0  # a solved run asks this often, until the controller acts
LOG = logging.getLogger("stepbus.trainer")
SETUP_NOTE_S = 3.0  # still waiting for the controller or the broker after this: say so
CHECKPOINT = checkpoint.NPZ_FILE
TORCH_CHECKPOINT = checkpoint.TORCH_FILE  # a torch model's (no pickle: trainer/checkpoint.py)
# Checkpoints at most this often by default: every update or two of PPO on CartPole (about 3%
# of the learner's time), and the learning a kill loses (sent again) is not stale by the time
# it comes back; see docs/performance.md.
CHECKPOINT_INTERVAL_S = 0.1
TARGET_ON_TRAIN, TARGET_ON_EVAL = "train", "eval"  # --target-on


def _target_on(text: str) -> str:
    """--target-on's check: ValueError naming the choices."""
    if text not in (TARGET_ON_TRAIN, TARGET_ON_EVAL):
        raise ValueError(f"train or eval, not {text!r}")
    return text


@dataclass
class Config:
    policy: str = wiring.endpoint("policy", "broker endpoint to send weights to")
    trajectories: str = wiring.endpoint("trajectories", "assembler endpoint to pull from")
    receipts: str = wiring.endpoint("receipts", "assembler endpoint to send receipts to")
    evaluation: str = wiring.endpoint("evaluation", "evaluator endpoint to send each new "
                                      "version's weights to (dropped while none listens)")
    controller: str = wiring.endpoint("controller", "controller endpoint to connect")
    broadcast: str = wiring.endpoint("broadcast", "controller broadcast endpoint to connect")
    runs_dir: str = wiring.from_env("STEPBUS_RUNS_DIR", "runs",
                                    "runs live in RUNS_DIR/<run id from the controller>")
    run_dir: str = field(default="", metadata={
        "help": "use this run directory instead (resumes its checkpoint if present)"})
    resume: str = field(default="", metadata={
        "help": "continue the stopped run RESUME (a run directory, or 'latest') where its "
                "checkpoint left it, with the settings in its config.toml (flags given now "
                "override them); a run that reached its goal exits 0 unless a new goal is "
                "given (docs/operations.md#resuming-a-run)"})
    target_return: float | None = field(default=None, metadata={
        "help": "stop the whole pipeline once the mean return of the last "
                "--target-episodes episodes reaches this (0: never)",
        "default_help": "the env's reward_threshold; none: run until stopped or "
                        "--max-env-steps"})
    target_episodes: int = field(default=20, metadata={"min": 1,
                                                       "help": "episodes in the mean"})
    target_on: str = field(default=TARGET_ON_TRAIN, metadata={
        wiring.CHECK: _target_on,
        "help": "what --target-return is judged on: train (the mean return of the last "
                "--target-episodes training episodes) or eval (the newest mean return of an "
                "evaluator's greedy episodes, `stepbus evaluator`)"})
    max_policy_lag: int = field(default=8, metadata={"min": 0,
        "help": "trajectories acted by a policy more than this many versions old are dropped "
                "(counted); the assembler cuts trajectories short that would span half of it"})
    max_updates: int = field(default=0, metadata={"min": 0,
        "help": "stop the whole pipeline once the run has made this many policy updates "
                "(0: never)"})
    max_env_steps: int = field(default=0, metadata={"min": 0, "aliases": ("total_timesteps",),
        "help": "stop the whole pipeline once the run has learned from this many env steps "
                "(0: no limit)"})
    checkpoint_interval_s: float = field(default=CHECKPOINT_INTERVAL_S, metadata={"min": 0,
        "help": "checkpoint what was learned at most this often (0: after every update); "
                "receipts of learned trajectories and metrics records wait for the checkpoint "
                "that holds them, so a killed learner loses nothing it confirmed"})
    metrics_interval_s: float = field(default=RECORD_INTERVAL_S, metadata={"min": 0,
        "help": "write a metrics record (metrics.jsonl, TensorBoard) at most this often, with "
                "the algorithm's figures averaged over the updates since the last one (0: one "
                "record per update), so a long run's files grow with time, not with the update "
                "rate"})
    seed: int = field(default=0, metadata={"min": 0,
                                           "help": "seeds initial weights and minibatches"})
    policy_name: str = field(default=policies.DEFAULT, metadata={
        "help": "the policy this learner trains (see the broker's --policy-map); pull its "
                "trajectories from the assembler's endpoint for it (--trajectories); a policy "
                "other than 'default' keeps its checkpoint and metrics in RUN_DIR/policy-NAME"})
    algo: str = field(default="stepbus.trainer.ppo:PPO", metadata={
        "help": "learning algorithm, module:Class (interface: trainer/algorithm.py's "
                "Algorithm; with a torch --model, trainer/torch_ppo.py's TorchPPO, which the "
                "default is then)"})
    norm_obs: bool = field(default=False, metadata={
        "help": "normalise observations by their running mean and variance (SB3's VecNormalize "
                "norm_obs; Box leaves of floating dtype, images and categorical leaves as they "
                "are): the statistics travel with the weights, so the broker acts with those "
                "each step is learned with, and are saved in the checkpoint"})
    norm_reward: bool = field(default=False, metadata={
        "help": "divide rewards by the running standard deviation of the discounted return "
                "(SB3's VecNormalize norm_reward), for learning only"})
    clip_obs: float = field(default=normalize.DEFAULT_CLIP, metadata={
        "above": 0, "help": "normalised observations are clipped to +-this"})
    clip_reward: float = field(default=normalize.DEFAULT_CLIP, metadata={
        "above": 0, "help": "scaled rewards are clipped to +-this"})
    ppo: PPOConfig = field(default_factory=PPOConfig)
    models: ModelConfig = field(default_factory=ModelConfig)
    security: wiring.Security = field(default_factory=wiring.Security)


def goal(cfg: Config, env: p.EnvSpec | None) -> tuple[float | None, str]:
    """The mean return that ends the run (None: none does), and the log line saying what ends
    it: --target-return when given (0: none), else the env's own reward_threshold, so an env
    whose registration says when it is solved (CartPole-v1 475, Acrobot-v1 -100) stops there
    and one without a threshold runs until stopped or --max-env-steps."""
    env_id = f"env {env.env_id}" if env is not None else "the env"
    if cfg.target_return is not None:
        target, source = cfg.target_return or None, f"--target-return {cfg.target_return:g}"
    else:
        threshold = env.spec.reward_threshold if env is not None else None
        target = threshold if threshold is not None and math.isfinite(threshold) else None
        source = (f"{env_id}'s reward_threshold" if target is not None
                  else f"{env_id}: {env.spec.goal_note}" if env is not None and env.spec.goal_note
                  else f"{env_id} has no reward_threshold")
    limits = [f"--{flag} {value}" for flag, value in (("max-updates", cfg.max_updates),
                                                      ("max-env-steps", cfg.max_env_steps))
              if value]
    if target is None:
        until = (" or ".join(["stopped", *limits]) if limits
                 else "stopped (give --target-return or --max-env-steps to end it)")
        return None, f"no target return ({source}): the run goes on until {until}"
    judged = (f"an evaluator's mean greedy return (--target-on {TARGET_ON_EVAL})"
              if cfg.target_on == TARGET_ON_EVAL
              else f"the mean return of the last {cfg.target_episodes} episodes")
    return target, (f"the run ends once {judged} reaches {target:g} ({source})"
                    + "".join(f", or at {limit}" for limit in limits))


class Phase(enum.Enum):
    """Where a learner is in its run, once it has the env spec and the run directory."""

    LEARNING = "learning"  # an update on every full batch
    # The run reached its goal (the target return, --max-updates): trajectories are taken in
    # and receipted, no longer learned from, and the controller is asked to shut down.
    SOLVED = "solved"
    # The pipeline is shutting down: the assembler's flush is taken in (not learned from),
    # until it disconnects or SHUTDOWN_DRAIN_MAX_S, so the checkpoint's counts include it.
    DRAINING = "draining"


@dataclass
class Counts:
    """This incarnation's figures about its intake and updates (`stepbus status`)."""

    stale_dropped: int = 0  # acted by a policy more than --max-policy-lag versions old
    updates: int = 0
    trajectories: int = 0  # taken in
    duplicates: int = 0  # sent again after a disconnect, taken in already
    records_lost: int = 0  # metrics records a full disk refused (left out whole)


class Evaluations:
    """What an evaluator said of this learner's versions: the newest result, whether a metrics
    record has it yet, and the newest version offered to it."""

    def __init__(self) -> None:
        self.newest: p.EvalResult | None = None
        self.recorded = True
        self.offered = -1

    @staticmethod
    def problem(msg: p.EvalResult, policy_name: str, version: int) -> str:
        """Why a result cannot be taken ("" if it can): off a socket, so checked whole."""
        if msg.policy != policy_name:
            return f"policy {msg.policy[:64]!r}; this learner trains {policy_name!r}"
        if not 0 <= msg.version <= version or not 1 <= msg.episodes <= 2**31:
            return f"version {msg.version} (ours: {version}), {msg.episodes} episodes"
        figures = (msg.mean_return, msg.std_return, msg.mean_length)
        if not all(math.isfinite(x) for x in figures) or msg.std_return < 0 or \
                msg.mean_length < 0:
            return f"return {msg.mean_return} +- {msg.std_return}, length {msg.mean_length}"
        return ""

    def take_in(self, msg: p.EvalResult) -> bool:
        """Whether `msg` is news: a version above the newest result's."""
        if self.newest is not None and msg.version <= self.newest.version:
            return False
        self.newest, self.recorded = msg, False
        return True

    def take(self) -> dict[str, float | int]:
        """The newest result's figures for a metrics record, once ({} after)."""
        if self.recorded or self.newest is None:
            return {}
        self.recorded = True
        return {**self.figures(), "eval_return_std": round(self.newest.std_return, 4),
                "eval_episodes": self.newest.episodes,
                "eval_length": round(self.newest.mean_length, 2)}

    def figures(self) -> dict[str, float | int]:
        if self.newest is None:
            return {}
        return {"eval_return": round(self.newest.mean_return, 4),
                "eval_version": self.newest.version}


class Learner(node.Process):
    """Takes trajectories in on "trajectories" (TRAJECTORY, TRAJECTORIES from the assembler),
    learns from every full batch, and sends WEIGHTS on "policy" (the broker, whose late ENV_SPEC
    replies come back there), RECEIPTs on "receipts" (the assembler) and its requests on
    "controller". The intake is held while a batch is full or a message's trajectories wait to
    be taken in, so the rest waits in the assembler's queue, not here. The intake's disconnects
    come on "assembler_events": during the shutdown drain, the assembler has finished.

    What a learner confirms (a trajectory receipted as learned, a metrics record) is in a
    checkpoint first: an update's learning is written at most --checkpoint-interval-s after
    it, and its receipts and record go out right after. A successor resumes exactly that, and
    the assembler sends it everything else again. WEIGHTS carry the count of steps of the run
    (the checkpoint's plus those taken in since), so the broker's credit window continues
    across learners without counting a resent step twice.

    Timers: "checkpoint" (learning waits for it), "record" (the metrics record of updates
    made before --metrics-interval-s was up), "report" (the progress line), "receipts" (at
    most every RECEIPT_INTERVAL_S), "slot_beat", "republish" (weights again on a quiet link),
    "curriculum" (a reset barrier the algorithm asked for), "shutdown_request" (once solved)
    and "drain" (the end of the shutdown drain)."""

    role = "trainer"
    sockets = Role.LEARNER

    def __init__(self, cfg: Config, model: Model, progress: Progress, policy_dir: Path,
                 ports: node.Ports, log: logging.Logger, *, name: str, incarnation: str,
                 newest_version: int = 0, slot: node.SupervisorBeat | None = None,
                 controller_beat: Callable[[float], object] | None = None,
                 rejects: node.RejectLog | None = None, env: p.EnvSpec | None = None,
                 clock: Callable[[], float] = time.monotonic, run: str = "") -> None:
        """Starts the next generation of the run, at a version above its checkpoint's and
        `newest_version` (the broker's newest); checkpoints and publishes at once, so the next
        learner's generation is above this one's even if it dies now. `env`: what the
        workers declared (its reward_threshold is the default target return); `run`: the run
        directory's id, which its WEIGHTS carry."""
        super().__init__(ports, log, name=name, clock=clock)
        if rejects is not None:  # with what was refused while setting up
            self.rejects = rejects
        cfg = resume.go_on(cfg, progress, goal(cfg, env)[0], log)  # a solved run, a new goal
        self.cfg, self.model, self.progress = cfg, model, progress
        self.incarnation, self.controller_beat, self.run = incarnation, controller_beat, run
        self.records_refused = 0  # metrics records a full disk refused since the last written
        self.slot = slot or node.supervisor_beat()
        progress.generation += 1
        progress.version = max(progress.version, newest_version) + 1
        self.ckpt_path = policy_dir / checkpoint_name(cfg.models)
        self.returns = collections.deque(progress.recent_returns, maxlen=cfg.target_episodes)
        self.metrics = MetricsFiles(policy_dir)  # metrics.jsonl and TensorBoard scalars
        # policy lag, episode length and link rates per record; a progress line every 5 s
        self.intake_stats = IntakeStats(cfg.target_episodes, clock)
        self.cadence = RecordCadence(cfg.metrics_interval_s)  # a record a second at most
        self.progress_log = ProgressLog(log, progress.env_steps, clock)
        log.info("run directory %s; policy %s version %d, generation %d, algorithm %s",
                 policy_dir, cfg.policy_name, progress.version, progress.generation, cfg.algo)
        self.target_return, goal_line = goal(cfg, env)
        log.info("%s", goal_line)
        self.obs_norm, self.reward_scale = _normalizers(cfg, model.spec, progress)
        if cfg.ppo.anneal_lr and not cfg.max_env_steps:
            log.warning("--anneal-lr lowers the learning rate over --max-env-steps, and there "
                        "is none: it stays %g", cfg.ppo.lr)
        self.phase, self.done = Phase.LEARNING, ""  # done: why no more updates (SOLVED)
        self.batch = Batch()
        self.pending: collections.deque[p.Trajectory] = collections.deque()  # not taken in yet
        # Env steps of the run taken in: the checkpoint's, then every one taken in (the
        # broker's credit). What the checkpoint did not hold comes again and counts then.
        self.steps_taken = progress.env_steps
        self.lags: list[int] = []  # of the trajectories taken in since the last weights went out
        self.checkpointed_steps = progress.env_steps  # what the newest checkpoint holds
        self.counts, self.receipts, self.digest = Counts(), Receipts(), RunDigest()
        self.evaluation = Evaluations()  # what an evaluator said of our versions
        self.receipts.resume(progress.assembler, progress.learned)
        self.unsaved = Unsaved(cfg.checkpoint_interval_s)
        self.curriculum = Curriculum(log)
        self.last_record, self.last_record_steps = self.now, progress.env_steps
        self.last_data = self.last_publish = self.now
        self.last_receipts = -math.inf
        self.shutdown_reason, self.drain_end, self.drained_from = "", "", 0
        self.every("slot_beat", node.HEARTBEAT_INTERVAL_S, self.beat_slot, first_due=self.now)
        self.at("report", self.progress_log.due, self.report)
        if done := self.done_already():  # a resumed, finished run
            self.solve(done)
        self.checkpoint(self.now)
        self.publish()
        self.slot.started(self.now)  # what a trainer slot proves a swapped-in learner by

    def done_already(self) -> str:
        """Why a resumed run has no more to do ("": it goes on): a limit it reached, or the
        goal it met before, with no new one given (trainer/resume.py)."""
        cfg, progress = self.cfg, self.progress
        if cfg.max_updates and progress.updates >= cfg.max_updates:
            return f"the run made --max-updates {cfg.max_updates} policy updates already"
        if cfg.max_env_steps and progress.env_steps >= cfg.max_env_steps:
            return f"the run learned from --max-env-steps {cfg.max_env_steps} env steps already"
        return progress.solved

    # -- taking trajectories in
    def on_trajectory(self, peer: bytes, msg: p.Trajectory) -> None:
        self.last_data = self.now
        problem = self.model.problem(msg)
        if problem:
            self.refuse("bad trajectory", problem)
        elif not self.wrong_policy(msg.policy):
            self.pending.append(msg)
            self.take_pending()

    def on_trajectories(self, peer: bytes, msg: p.Trajectories) -> None:
        self.last_data = self.now
        problem = self.model.problem(msg)
        if problem:
            self.refuse("bad trajectories", problem)
        elif not self.wrong_policy(msg.policy):
            self.pending.extend(msg.split())
            self.take_pending()

    def wrong_policy(self, policy: str) -> bool:
        """Another policy's trajectories are refused, not receipted: the assembler keeps them
        for their own learner."""
        if policy != self.cfg.policy_name:
            self.refuse("wrong policy",
                        f"a trajectory of policy {policy[:64]!r}; this learner trains "
                        f"{self.cfg.policy_name!r}: is --trajectories the assembler's endpoint "
                        "for it?")
        return policy != self.cfg.policy_name

    def full(self) -> bool:
        return self.phase is Phase.LEARNING and self.batch.steps >= self.cfg.ppo.batch_steps

    def holds(self, port: str) -> bool:
        return port == "trajectories" and (bool(self.pending) or self.full())

    def take_pending(self) -> None:
        """Trajectories are taken in one by one up to a full batch, whether they came alone or
        in one message, so a batch's content never depends on how the assembler grouped them."""
        while self.pending and not self.full():
            self.take_in(self.pending.popleft())

    def take_in(self, t: p.Trajectory) -> None:
        if not self.receipts.take(t.assembler, t.seq):
            self.counts.duplicates += 1  # sent again after a disconnect; we have it already
            self.receipt_due()  # if it was receipted as learned, it is again
            return
        self.digest.add(t)
        self.intake_stats.add(t)
        self.steps_taken += t.rewards.shape[0]
        self.counts.trajectories += 1
        self.receipt_due()
        alone = Batch()
        alone.add(t, self.model.record(self.learned_from(t)))
        if self.phase is Phase.DRAINING:
            self.settle(alone, learned=False)  # counted; the run ends, nobody learns from it
        elif self.done:
            self.settle(alone)  # counted, no longer learned from
            self.checkpoint_due()
        elif (lag := self.lag_of(t)) > self.cfg.max_policy_lag:
            self.counts.stale_dropped += 1
            self.lags.append(lag)
            self.settle(alone)
            self.checkpoint_due()
        else:
            self.lags.append(lag)
            self.batch.add(t, alone.trajectories[0])
            if self.obs_norm is not None:
                self.obs_norm.take_in(t)

    def lag_of(self, t: p.Trajectory) -> int:
        """Versions between the oldest policy that acted in `t` and ours (0 for a newer one:
        another learner's of the same policy, overlapping ours for a moment)."""
        return max(0, self.progress.version - int(t.policy_versions.min()))

    def learned_from(self, t: p.Trajectory) -> p.Trajectory:
        """A trajectory as the algorithm sees it: observations normalised with the statistics
        each step was acted with (--norm-obs), rewards scaled (--norm-reward)."""
        if self.obs_norm is not None:
            t = self.obs_norm.normalize(t)
        if self.reward_scale is not None:
            t = self.reward_scale.scale(t)
        return t

    def settle(self, batch: Batch, learned: bool = True) -> None:
        """Trajectories are done with (learned from, or dropped): counted in the progress the
        next checkpoint holds, and receipted as learned once it holds them (`learned`)."""
        progress = self.progress
        progress.env_steps += batch.steps
        for ret in batch.returns:
            if ret is not None:
                progress.episodes += 1
                self.returns.append(ret)
                self.cadence.episode(ret)
        if learned:
            self.receipts.learn(batch.ids)

    def checkpoint_due(self) -> None:
        """Something was settled: checkpoint now, or when the interval since the last one is
        up (what it releases waits until then)."""
        due = self.unsaved.settled(self.now)
        if self.now >= due:
            self.checkpoint(self.now)
        elif "checkpoint" not in self.timers:
            self.at("checkpoint", due, self.checkpoint)

    # -- learning
    def tick(self, now: float) -> float:
        self.now = now
        self.take_pending()
        if self.full():
            self.learn()
        return 0.0 if self.pending else math.inf  # the rest of a message, after an update

    def learn(self) -> None:
        """One update on the full batch, then the new weights, the record and the goal."""
        lr = self.annealed_lr()
        stats = self.model.update(self.batch.trajectories, tick=self.beat_while_learning)
        if lr is not None:
            stats["learning_rate"] = lr
        self.settle(self.batch)  # once checkpointed, the assembler may forget them
        self.batch = Batch()
        self.progress.version += 1
        self.progress.updates += 1
        self.counts.updates += 1
        self.publish()
        self.record(stats)
        self.checkpoint_due()
        options = self.model.curriculum(stats)
        if options is not None:
            self.curriculum.want(options)
            self.at("curriculum", self.curriculum.next_try, self.send_reset_request)
        self.check_goal()

    def annealed_lr(self) -> float | None:
        """--anneal-lr: the learning rate for this update, falling linearly to 0 over
        --max-env-steps with the env steps learned from (so a resumed run goes on where it
        was), given to the algorithm (None: no schedule)."""
        cfg = self.cfg
        if not (cfg.ppo.anneal_lr and cfg.max_env_steps):
            return None
        lr = cfg.ppo.lr * max(0.0, 1.0 - self.progress.env_steps / cfg.max_env_steps)
        self.model.set_learning_rate(lr)
        return lr

    def check_goal(self) -> None:
        """After an update: the run ends once the mean return reaches the target, or at
        --max-updates or --max-env-steps."""
        reason, said = self.goal_reached()
        if not reason:
            return
        self.solve(reason)
        self.log.info("%s at %d env steps (%.1fs); asking the controller to shut the pipeline "
                      "down", said, self.progress.env_steps, self.clock() - self.started)
        self.flush_record()  # the last record is the update that ended the run
        self.checkpoint(self.now)

    def goal_reached(self) -> tuple[str, str]:
        """(why the run ends, for the shutdown request; the log's words) or ("", "")."""
        cfg, progress, mean = self.cfg, self.progress, self.mean_return()
        evaluated = self.evaluation.newest
        if cfg.target_on == TARGET_ON_EVAL:
            if (self.target_return is not None and evaluated is not None
                    and evaluated.mean_return >= self.target_return):
                return (f"{TARGET_MET} eval return {evaluated.mean_return:.1f}",
                        f"solved: mean return {evaluated.mean_return:.1f} over "
                        f"{evaluated.episodes} greedy episodes of version {evaluated.version}")
        elif (self.target_return is not None and len(self.returns) >= cfg.target_episodes
                and mean is not None and mean >= self.target_return):
            return (f"{TARGET_MET} mean return {mean:.1f}",
                    f"solved: mean return {mean:.1f} over the last {len(self.returns)} episodes")
        if cfg.max_updates and progress.updates >= cfg.max_updates:
            return (f"trainer made --max-updates {cfg.max_updates} policy updates",
                    f"{progress.updates} policy updates made (--max-updates)")
        if cfg.max_env_steps and progress.env_steps >= cfg.max_env_steps:
            return (f"trainer learned from --max-env-steps {cfg.max_env_steps} env steps",
                    f"{progress.env_steps} env steps learned from (--max-env-steps)")
        return "", ""

    def solve(self, reason: str) -> None:
        """No more updates: ask the controller to shut the pipeline down until it does."""
        self.phase, self.done = Phase.SOLVED, reason
        self.progress.solved = reason  # a resume needs a new goal to go on (trainer/resume.py)
        self.progress.goal = {"target_return": self.target_return or 0.0,
                              "max_env_steps": self.cfg.max_env_steps,
                              "max_updates": self.cfg.max_updates}
        self.every("shutdown_request", SHUTDOWN_REQUEST_INTERVAL_S, self.request_shutdown,
                   first_due=self.now)

    def request_shutdown(self, now: float) -> None:
        self.send(PortName.CONTROLLER, p.ShutdownRequest(reason=self.done))

    def beat_while_learning(self) -> None:
        """After every gradient step: a long update is not a dead learner."""
        now = self.clock()
        if self.controller_beat is not None:
            self.controller_beat(now)
        self.beat_slot(now)

    def beat_slot(self, now: float) -> None:
        self.slot.beat(now)
        if self.slot.gone and self.phase is not Phase.DRAINING:
            self.stop("its trainer slot is gone")

    def mean_return(self) -> float | None:
        return float(np.mean(self.returns)) if self.returns else None

    # -- what goes out
    def publish(self, starving: bool = False) -> None:
        """Weights to the broker; a new version's to the evaluator too, if one listens (a
        send that fails at once: it never holds anything up)."""
        weights = p.Weights(
            trainer=self.name, incarnation=self.incarnation, policy=self.cfg.policy_name,
            version=self.progress.version, consumed_steps=self.steps_taken,
            batch_steps=self.cfg.ppo.batch_steps, starving=starving,
            params=self.weights(), checkpointed_steps=self.checkpointed_steps, run=self.run,
            policy_lag=int(np.median(self.lags)) if self.lags else -1,
            max_policy_lag=self.cfg.max_policy_lag)
        self.lags.clear()
        self.send(PortName.POLICY, weights)
        if weights.version > self.evaluation.offered:
            self.evaluation.offered = weights.version
            self.send(PortName.EVALUATION, weights)
        self.last_publish = self.clock()
        if self.phase is not Phase.DRAINING:
            self.at("republish", self.last_publish + QUIET_S, self.republish)

    def weights(self) -> dict[str, np.ndarray]:
        """The model's weights, and with --norm-obs the statistics this version acts with."""
        params = self.model.weights()
        if self.obs_norm is not None:
            params |= self.obs_norm.stats_for(self.progress.version).arrays()
        return params

    def republish(self, now: float) -> None:
        """On a quiet link, weights again, marked starving (not once solved: then nothing more
        is wanted): a restarted broker gets them, and a broker whose credit window is full may
        grant more (at once for steps a fault it saw may have lost, otherwise after seconds of
        it: bus/credit.py). Changes nothing but the broker's credit."""
        quiet_since = max(self.last_data, self.last_publish)
        if now >= quiet_since + QUIET_S:
            self.publish(starving=not self.done)
        else:
            self.at("republish", quiet_since + QUIET_S, self.republish)

    def receipt_due(self) -> None:
        """Receipts go out at most every RECEIPT_INTERVAL_S (one message per trajectory was a
        third of this process's time); while draining, at once."""
        if "receipts" not in self.timers:
            due = (self.now if self.phase is Phase.DRAINING
                   else self.last_receipts + RECEIPT_INTERVAL_S)
            self.at("receipts", due, self.send_receipts)

    def send_receipts(self, now: float) -> None:
        msg = self.receipts.message(self.name, self.incarnation, self.cfg.policy_name, now,
                                    self.cfg.max_policy_lag)
        if msg is None:
            return
        self.last_receipts = now
        if self.send(PortName.RECEIPTS, msg):
            self.receipts.delivered()
            return
        if not self.receipts.warned and now - (self.receipts.pending_since or now) > \
                RECEIPTS_WARN_S:
            self.receipts.warned = True
            self.log.warning("receipts to the assembler at %s undelivered for %.0fs: is "
                             "--receipts right? The assembler keeps what it sent until they "
                             "arrive, and pauses the pipeline at its bound", self.cfg.receipts,
                             RECEIPTS_WARN_S)
        self.at("receipts", now + RECEIPT_INTERVAL_S, self.send_receipts)  # until they arrive

    def record(self, stats: dict[str, float]) -> None:
        """An update's figures go into the next metrics record, made at once if one is due,
        else when --metrics-interval-s since the last is up (by then, or at the end of the
        run, with the updates that came meanwhile)."""
        self.intake_stats.updated(self.progress.version - 1)
        self.cadence.add(stats)
        if self.clock() >= self.cadence.due:
            self.make_record()
        elif "record" not in self.timers:
            self.at("record", self.cadence.due, self.record_due)

    def make_record(self) -> None:
        """The metrics record of the updates since the last one, written once a checkpoint
        holds them."""
        self.cancel("record")
        now, progress = self.clock(), self.progress
        rate = (progress.env_steps - self.last_record_steps) / max(now - self.last_record, 1e-9)
        self.last_record, self.last_record_steps = now, progress.env_steps
        counts, means = self.cadence.take(now)
        self.unsaved.records.append({
            "time": time.time(), "wall_s": round(now - self.started, 3),
            "env_steps": progress.env_steps, "episodes": progress.episodes,
            "mean_return": self.mean_return(), "policy_version": progress.version,
            "generation": progress.generation, "steps_per_second": round(rate, 1),
            "stale_dropped": self.counts.stale_dropped, "digest": self.digest.hexdigest(),
            **counts, **self.intake_stats.take(), **means, **self.evaluation.take(),
        })

    def record_due(self, now: float) -> None:
        """The interval is up with updates not yet in a record: it is made now, and written
        now too if the checkpoint that holds them is on disk already."""
        self.make_record()
        if self.unsaved.since is None:  # nothing settled waits for a checkpoint
            for record in self.unsaved.records:
                self.write_record(record)
            self.unsaved.records.clear()

    def flush_record(self) -> None:
        """The run or this learner ends: the updates (or the eval result) waiting for a record
        get it now."""
        if self.cadence.updates or not self.evaluation.recorded:
            self.make_record()

    def checkpoint(self, now: float) -> None:
        """Write what was learned, atomically; then what waited for it may go out: the
        receipts of what it holds and the metrics records of its updates."""
        self.cancel("checkpoint")
        began, progress = self.clock(), self.progress
        progress.recent_returns = list(self.returns)
        progress.assembler, progress.learned = self.receipts.assembler, self.receipts.kept()
        if self.obs_norm is not None:  # new statistics from the next version on
            self.obs_norm.fold(progress.version + 1, progress.version - self.cfg.max_policy_lag)
            progress.obs_norm = self.obs_norm.to_json()
        if self.reward_scale is not None:
            progress.reward_norm = self.reward_scale.to_json()
        progress.rng = self.model.rng_state()
        try:
            with node.beating_through():  # a large model on a slow disk
                self.model.save(self.ckpt_path, dataclasses.asdict(progress))
        except OSError as exc:  # a full disk: the last good checkpoint stays as it was
            self.checkpoint_failed(exc, now)
            return
        if self.unsaved.failed:
            self.log.warning("checkpoint %s written again after %d failed tries",
                             self.ckpt_path, self.unsaved.failed)
        self.checkpointed_steps = progress.env_steps  # goes out with the next weights
        self.receipts.checkpointed()
        for record in self.unsaved.wrote(began, self.clock()):
            self.write_record(record)
        if self.receipts.learned:
            self.receipt_due()

    def write_record(self, record: dict[str, Any]) -> None:
        """Into metrics.jsonl and TensorBoard; a record a full disk refuses is left out whole
        (counted, and said once while the disk stays full)."""
        if self.metrics.write(record):
            self.records_refused = 0
            return
        self.counts.records_lost += 1
        self.records_refused += 1  # in a row
        if self.records_refused == 1:
            self.log.warning("cannot write a metrics record to %s (disk full?): left out "
                             "whole, as the next ones until the disk takes them",
                             self.metrics.jsonl.name)

    def checkpoint_failed(self, exc: OSError, now: float) -> None:
        """Learning goes on in memory; what waits for a checkpoint (receipts, so the
        assembler keeps every trajectory not on disk, and metrics records) goes on waiting,
        and with it, once the assembler's bound is reached, stepping: nothing is lost, and a
        successor resumes the last good checkpoint. Tried again every second or so."""
        if self.unsaved.failed_at(now):
            self.log.warning("cannot write checkpoint %s (%s): the last good one stays; "
                             "learning goes on in memory and receipts and metrics wait until "
                             "a checkpoint is written, tried again every %g s",
                             self.ckpt_path, exc, checkpoint.RETRY_AFTER_FAILURE_S)
        self.checkpoint_due()

    def report(self, now: float) -> None:
        self.progress_log.maybe(self.progress.env_steps, self.mean_return(),
                                self.progress.version)
        self.at("report", self.progress_log.due, self.report)

    def figures(self) -> dict[str, Any]:
        mean, progress = self.mean_return(), self.progress
        return {"algo": self.cfg.algo, "policy": self.cfg.policy_name,
                "policy_version": progress.version, "env_steps": progress.env_steps,
                "episodes": progress.episodes, "generation": progress.generation,
                "mean_return": None if mean is None else round(mean, 2),
                **self.evaluation.figures(),
                **self.rejects.figures(), **dataclasses.asdict(self.counts),
                **self.unsaved.figures(), **self.intake_stats.last, **_resumes(self.cfg)}

    # -- the controller and the broker
    def send_reset_request(self, now: float) -> None:
        msg = self.curriculum.request(now)
        if msg is not None:
            self.send(PortName.CONTROLLER, msg)

    def on_reply(self, peer: bytes, msg: p.Reply) -> None:
        if self.curriculum.asked is not None:  # the barrier it asked for
            self.curriculum.answered(msg, self.now)
            self.at("curriculum", self.curriculum.next_try, self.send_reset_request)

    def on_env_spec(self, peer: bytes, msg: p.EnvSpec) -> None:
        """A late reply to a hello from before the learner started: nothing new."""

    # -- the evaluator
    def on_eval_result(self, peer: bytes, msg: p.EvalResult) -> None:
        """An evaluator's return for one of our versions: into the next metrics record (one a
        --metrics-interval-s at most, as ever), and with --target-on eval, the goal."""
        problem = self.evaluation.problem(msg, self.cfg.policy_name, self.progress.version)
        if problem:
            self.refuse("bad eval result", problem, claims=msg.evaluator)
            return
        if self.phase is not Phase.LEARNING or not self.evaluation.take_in(msg):
            return  # once the run has ended (goal met, or shutting down), its record is made
        if self.clock() >= self.cadence.due:
            self.record_due(self.now)  # written at once: an eval result waits for no checkpoint
        elif "record" not in self.timers:
            self.at("record", self.cadence.due, self.record_due)
        if self.cfg.target_on == TARGET_ON_EVAL:
            self.check_goal()

    # -- shutting down
    def on_run_state(self, peer: bytes, msg: p.RunState) -> None:
        self.run_state = msg
        if msg.shutting_down:
            self.shut_down("controller shutdown")

    def on_shutdown(self, peer: bytes, msg: p.Shutdown) -> None:
        self.shut_down(msg.reason)

    def on_signal(self, reason: str) -> None:
        """SIGINT/SIGTERM: the pipeline is stopping, drain. SIGUSR1 is the trainer slot's "hand
        over": leave at once (what this learner has not learned from, the assembler sends to
        the next one)."""
        if self.phase is Phase.DRAINING:
            return
        if reason in ("SIGINT", "SIGTERM"):
            self.shut_down(reason)
        else:
            self.stop(reason)

    def shut_down(self, reason: str) -> None:
        """On a pipeline shutdown the assembler flushes its open trajectories as truncated:
        take them in (and say so), so the checkpoint's counts include them, as they include
        the partial batch (the run ends: nobody learns from them). It disconnects once it has
        flushed and heard our receipts (or given up on them)."""
        if self.phase is Phase.DRAINING or self.stop_reason:
            return
        self.phase, self.shutdown_reason = Phase.DRAINING, reason
        self.drained_from, self.drain_end = self.counts.trajectories, "the assembler did not finish"
        for name in ("report", "republish", "curriculum", "shutdown_request"):
            self.cancel(name)
        self.flush_record()
        self.checkpoint(self.now)  # what was learned: receipted before the drain
        self.settle(self.batch, learned=False)
        self.batch = Batch()
        self.take_pending()  # all of them: nothing is learned any more
        self.send_receipts(self.now)  # what the interval held back
        self.at("drain", self.now + SHUTDOWN_DRAIN_MAX_S, self.end_drain)

    def on_socket_event(self, port: str, event: int) -> None:
        if self.phase is Phase.DRAINING and event == zmq.EVENT_DISCONNECTED:
            self.drain_end = "the assembler finished"
            self.end_drain(self.now)
        # before the shutdown: old news (an assembler that restarted)

    def on_peer_done(self, role: str) -> None:
        """The serial runner's word that the assembler finished (inproc:// has no
        disconnect events): it heard our receipts for everything, so the drain is over."""
        if role == "assembler":
            self.on_socket_event("assembler_events", zmq.EVENT_DISCONNECTED)

    def end_drain(self, now: float) -> None:
        self.stop(self.shutdown_reason)

    def finish(self) -> None:
        """The last checkpoint, then its receipts. A partial batch (a swap's hand-over) is not
        in it: the assembler sends it to the next learner."""
        if self.phase is Phase.DRAINING:
            self.log.info("took in %d trajectories after the shutdown began (%s)",
                          self.counts.trajectories - self.drained_from, self.drain_end)
        self.flush_record()
        self.checkpoint(self.clock())
        self.send_receipts(self.clock())
        # Also flushes TensorBoard's events (the process ends with os._exit): on a slow disk,
        # the writer thread's queue to drain.
        with node.beating_through():
            self.metrics.close()
        self.log.info("learner stopping (%s); checkpoint at %s; %d trajectories taken in, %d "
                      "messages refused", self.stop_reason, self.ckpt_path,
                      self.counts.trajectories, self.rejects.total)


class LearnerSetup(node.Process):
    """The learner before it learns: it says hello to the broker until the broker's ENV_SPEC
    says what the workers step, and waits for the controller's run id (or --run-dir); then
    the `Learner` takes its place on the same loop and sockets (`successor`). Trajectories
    are not read yet: they wait in their queue (`holds`)."""

    role = "trainer"
    sockets = Role.LEARNER

    def __init__(self, cfg: Config, ports: node.Ports, log: logging.Logger, *, name: str,
                 controller_beat: Callable[[float], object] | None = None,
                 slot: node.SupervisorBeat | None = None, settings: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`settings`: the run's, to record in its run directory (default: the run
        configuration's, and this learner's own)."""
        super().__init__(ports, log, name=name, clock=clock)
        if cfg.resume:  # resolved once: `latest` may point elsewhere by a restart
            cfg = dataclasses.replace(cfg, resume=str(resume.locate(cfg.resume, cfg.runs_dir)))
        self.cfg, self.controller_beat = cfg, controller_beat
        self.settings = settings if settings is not None else {
            **{k: s.value for k, s in runconfig.load().items()}, **runconfig.recorded(cfg)}
        self.slot = slot or node.supervisor_beat()
        self.incarnation = uuid.uuid4().hex[:8]
        self.env_spec: p.EnvSpec | None = None
        self.algo_class = _check_settings(cfg)
        self.every("hello", node.HEARTBEAT_INTERVAL_S, self.hello, first_due=self.now)
        self.every("slot_beat", node.HEARTBEAT_INTERVAL_S, self.beat_slot, first_due=self.now)
        self.at("note", self.now + SETUP_NOTE_S, self.note_waiting)

    def hello(self, now: float) -> None:
        self.send(PortName.POLICY, p.TrainerHello(trainer=self.name, policy=self.cfg.policy_name))

    def beat_slot(self, now: float) -> None:
        self.slot.beat(now)
        if self.slot.gone:
            self.stop("its trainer slot is gone")

    def holds(self, port: str) -> bool:
        return port == PortName.TRAJECTORIES

    def on_env_spec(self, peer: bytes, msg: p.EnvSpec) -> None:
        self.env_spec = msg
        self.start_if_ready()

    def on_run_state(self, peer: bytes, msg: p.RunState) -> None:
        super().on_run_state(peer, msg)
        self.start_if_ready()

    def run_dir(self) -> Path | None:
        if self.cfg.resume or self.cfg.run_dir:
            return Path(self.cfg.resume or self.cfg.run_dir)
        if self.run_state is not None:
            return Path(self.cfg.runs_dir) / self.run_state.run_id
        return None

    def start_if_ready(self) -> None:
        run_dir = self.run_dir()
        if run_dir is None or self.env_spec is None or self.stop_reason:
            return
        try:
            with node.beating_through():  # the model built, a checkpoint resumed and written
                self.successor = _start(self, run_dir, self.env_spec)
        except CannotStart as exc:
            self.log.error("%s", exc)
            self.exit_code = Exit.SETTING
            self.stop("cannot start")

    def note_waiting(self, now: float) -> None:
        _note_waiting(self.cfg, self.log, self.run_dir() is not None, self.env_spec is not None)

    def figures(self) -> dict[str, Any]:
        return {"state": "starting", **self.rejects.figures(), **_resumes(self.cfg)}


def _resumes(cfg: Config) -> dict[str, str]:
    """A resuming learner's word to the controller: the run it continues, whose id the
    controller then carries on (bus/controller.py)."""
    return {"resumes": Path(cfg.resume).name} if cfg.resume else {}


def _normalizers(cfg: Config, spec: p.SpaceSpec, progress: Progress
                 ) -> tuple[normalize.Normalizer | None, normalize.RewardScale | None]:
    """--norm-obs and --norm-reward, as the checkpoint left them. Raises CannotStart when its
    statistics do not fit these spaces."""
    obs = normalize.Normalizer(spec, cfg.clip_obs) if cfg.norm_obs else None
    reward = normalize.RewardScale(cfg.ppo.gamma, cfg.clip_reward) if cfg.norm_reward else None
    if progress.obs_norm and obs is None:
        LOG.warning("the checkpoint has observation statistics, and this learner was not "
                    "given --norm-obs: the policy acts on raw observations from now on")
    try:
        if obs is not None:
            obs.restore(progress.obs_norm)
        if reward is not None:
            reward.restore(progress.reward_norm)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise CannotStart(f"the checkpoint's normalisation statistics cannot be used "
                          f"({type(exc).__name__}: {exc}): start a new run or resume without "
                          "--norm-obs/--norm-reward") from None
    return obs, reward


def _check_settings(cfg: Config) -> algorithm.AlgorithmClass:
    """What can be refused before anything is heard: CannotStart naming the setting."""
    try:
        policies.check_name(cfg.policy_name)
    except ValueError as exc:
        raise CannotStart(f"--policy-name: {exc}") from exc
    try:
        policy.check_model(cfg.models)
    except policy.ModelUnavailable as exc:
        raise CannotStart(str(exc)) from exc
    return algorithm.load(cfg.algo)


def open_learner(ctx: zmq.Context, cfg: Config, log: logging.Logger, *,
                 name: str = "", settings: dict[str, Any] | None = None) -> node.Opened:
    """A learner's setup process on its sockets, what it receives where, and its controller
    link: for its own process (`run`) or one runner of many (`stepbus run`). Raises
    SettingError."""
    name = name or os.environ.get("HONCHO_PROCESS_NAME") or f"trainer-{pysocket.gethostname()}"
    link = node.ControllerLink(ctx, role="trainer", name=name, controller=cfg.controller,
                               broadcast=cfg.broadcast, log=log)
    try:
        sockets = topology.open_role(ctx, Role.LEARNER, topology.endpoints_of(cfg))
        intake = sockets[PortName.TRAJECTORIES]
        ports = {PortName.TRAJECTORIES: node.Port(intake, (p.Trajectory, p.Trajectories)),
                 PortName.POLICY: node.Port(sockets[PortName.POLICY], (p.EnvSpec,)),
                 PortName.EVALUATION: node.Port(sockets[PortName.EVALUATION], (p.EvalResult,)),
                 # the intake's disconnects: in the shutdown drain, the assembler has finished
                 "assembler_events": node.Port(intake.get_monitor_socket(
                     zmq.EVENT_DISCONNECTED), monitor=True)}
        setup = LearnerSetup(cfg, node.SocketPorts({**sockets, PortName.CONTROLLER: link.dealer}),
                             log, name=name, controller_beat=link.beat,
                             settings=settings)
    except CannotStart as exc:
        link.close()
        raise SettingError(str(exc)) from None
    except BaseException:
        link.close()
        raise
    return node.Opened(setup, ports, link, cleanup=intake.disable_monitor)


def run(cfg: Config) -> int:
    log = node.setup_logging("trainer")
    # SIGUSR1 is the trainer slot's "hand over": checkpoint and leave at once (what this
    # learner has not learned from, the assembler sends to the next one).
    stop = node.StopFlag((signal.SIGINT, signal.SIGTERM, signal.SIGUSR1))
    MetricsFiles.preload()
    try:
        if done := resume.finished(cfg):
            log.info("%s", done)
            return Exit.OK
        return node.run_role(lambda ctx: open_learner(ctx, cfg, log), cfg.security, stop)
    except SettingError as exc:  # said in the log too, which the slot passes on
        log.error("%s", exc)
        return Exit.SETTING


def _start(setup: LearnerSetup, run_dir: Path, env_spec: p.EnvSpec) -> Learner:
    """The learner, once the controller and the broker have said what it learns for. Raises
    CannotStart."""
    cfg = setup.cfg
    run_dir.mkdir(parents=True, exist_ok=True)
    _link_latest(run_dir)
    if cfg.resume:  # before config.toml is written again with them
        for line in resume.overrides(run_dir, runconfig.recorded(cfg)):
            setup.log.info("resuming run %s: %s", run_dir.name, line)
    _record_settings(run_dir, setup, env_spec)
    # Each policy's learner keeps its own checkpoint and metrics.
    policy_dir = (run_dir if cfg.policy_name == policies.DEFAULT
                  else run_dir / f"policy-{cfg.policy_name}")
    policy_dir.mkdir(exist_ok=True)
    model = _model(cfg, setup.algo_class, env_spec, policy_dir)
    ckpt = policy_dir / checkpoint_name(cfg.models)
    progress = Progress()
    if ckpt.exists():
        progress = progress_of(model.resume(ckpt), ckpt)
        model.restore_rng(progress.rng, ckpt)
        setup.log.info("resumed from %s (version %d, generation %d, %d env steps, %d "
                       "episodes)", ckpt, progress.version, progress.generation,
                       progress.env_steps, progress.episodes)
    progress.spec, progress.model = p.to_map(env_spec.spec), cfg.models.model
    return Learner(cfg, model, progress, policy_dir, setup.ports, setup.log, name=setup.name,
                   incarnation=setup.incarnation, newest_version=env_spec.policy_version,
                   slot=setup.slot, controller_beat=setup.controller_beat,
                   rejects=setup.rejects, env=env_spec, clock=setup.clock, run=run_dir.name)


def checkpoint_name(models: policy.ModelConfig) -> str:
    """The numpy MLP's params go in an .npz, a torch model's state in a .safetensors."""
    return TORCH_CHECKPOINT if policy.is_torch_model(models.model) else CHECKPOINT


def _model(cfg: Config, algo_class: algorithm.AlgorithmClass, env_spec: p.EnvSpec,
           policy_dir: Path) -> Model:
    """The model --model names, trained by --algo (for a torch model by default
    trainer/torch_ppo.py's TorchPPO). Raises CannotStart, also when the policy's directory
    holds only another model's checkpoint."""
    name = checkpoint_name(cfg.models)
    other = policy_dir / (CHECKPOINT if name == TORCH_CHECKPOINT else TORCH_CHECKPOINT)
    if other.exists() and not (policy_dir / name).exists():
        raise CannotStart(f"{other} is the checkpoint of another model than --model "
                          f"{cfg.models.model}: start a new run, or use that model")
    if name == CHECKPOINT:
        return Model(algo_class, env_spec, cfg.ppo, cfg.seed, name=cfg.algo)
    from stepbus.trainer import torch_model  # imports torch: only for a torch model

    return torch_model.TorchModel(cfg.models, cfg.algo, env_spec, cfg.ppo, cfg.seed)


def _note_waiting(cfg: Config, log: logging.Logger, have_run: bool, have_spec: bool) -> None:
    broker = f"broker (and a worker) at {cfg.policy}" + (
        "" if cfg.policy_name == policies.DEFAULT
        else f" to know policy {cfg.policy_name!r} (its --policy-map)")
    log.info("waiting for %s", " and ".join(
        w for w, ok in ((f"controller at {cfg.controller}", have_run), (broker, have_spec))
        if not ok))


def _record_settings(run_dir: Path, setup: LearnerSetup, env_spec: p.EnvSpec) -> None:
    """RUN_DIR/config.toml: how the run was made, as a run configuration (STEPBUS_CONFIG=it
    makes the run again), with stepbus's version."""
    run_id = (setup.run_state.run_id if setup.run_state is not None and not setup.cfg.resume
              else run_dir.name)
    header = (f"stepbus {__version__}, run {run_id}: the run's settings, written by its learner "
              f"at start.\nSTEPBUS_CONFIG={run_dir / 'config.toml'} makes the run again "
              "(settings given only as flags\nto other processes than the trainer are not "
              "known here; stepbus run records them all).")
    settings = {"stepbus_version": __version__, "env": env_spec.env_id, **setup.settings}
    try:
        (run_dir / "config.toml").write_text(runconfig.dumps(settings, header))
    except OSError as exc:
        setup.log.warning("could not write %s: %s", run_dir / "config.toml", exc)


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
