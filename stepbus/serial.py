"""`stepbus run`: the whole pipeline in one OS process, for debugging and fast tests.

Every role's `Process` object (controller, broker, workers, assembler, learner) runs on one
thread, each on its own `node.Loop` over one shared poller, with the same ZeroMQ sockets as
in separate processes, bound and connected on `inproc://` endpoints: real ZeroMQ semantics
(queues, high-water marks, routing), no fake ports. An exception in an env, a model or an
algorithm is not caught, restarted or reported to a log elsewhere: it raises in the user's
terminal with its own traceback, so `python -m pdb -m stepbus run` and breakpoints work.

What only separate processes show stays with them: a killed or frozen peer, supervision and
restarts, CURVE, TCP. docs/operations.md says when to use which.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import uuid
from dataclasses import dataclass
from typing import Any

import threadpoolctl
import zmq

from stepbus import runconfig
from stepbus.bus import broker, controller, node, wiring
from stepbus.bus.exits import SettingError
from stepbus.processor import assembler, evaluator
from stepbus.trainer import learner, resume
from stepbus.workers import worker

# Flags a serial run does not take: its endpoints are its own, it binds nothing reachable
# from outside (so no keys), and it names its workers itself.
NOT_SERIAL = frozenset({*wiring.ENDPOINTS, "security", "external", "name", "worker_index",
                        "policy_endpoints", "cpu_priority", "lane"})
MAX_WORKERS = 64


@dataclass
class Config:
    """`stepbus run`'s own settings; the roles' flags come with it."""

    workers: int = dataclasses.field(default=1, metadata={
        "help": "environment workers, each with --envs-per-worker envs (all in this process)",
        "min": 1, "max": MAX_WORKERS})
    evaluator: bool = dataclasses.field(default=False, metadata={
        "help": "also run an evaluator (`stepbus evaluator`, its --eval-* flags) on this thread: "
                "greedy episodes of each new policy version, eval_return in the metrics"})


@dataclass
class Roles:
    """The settings of every role of a serial run."""

    controller: controller.Config
    broker: broker.Config
    worker: worker.Config
    assembler: assembler.Config
    learner: learner.Config
    run: Config
    evaluator: evaluator.Config = dataclasses.field(default_factory=evaluator.Config)


def inproc_endpoints() -> dict[str, str]:
    """Endpoints of this run alone: inproc names are per context, the prefix only reads well."""
    tag = uuid.uuid4().hex[:6]
    return {name: f"inproc://stepbus-{tag}-{name}" for name in wiring.ENDPOINTS}


def wired(config: Any, endpoints: dict[str, str]) -> Any:
    """`config` with the run's endpoints in place of its own."""
    names = {f.name for f in dataclasses.fields(config)}
    return dataclasses.replace(config, **{k: v for k, v in endpoints.items() if k in names})


def run(roles: Roles) -> int:
    """Train until the goal (or a stop), every role on this thread; the exit code. Raises
    whatever an env, model or algorithm raises, and SettingError for a bad setting."""
    log = logging.getLogger("stepbus.run")
    if done := resume.finished(roles.learner):  # nothing to do, said before anything starts
        log.info("%s", done)
        return 0
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop = node.StopFlag()
    endpoints = inproc_endpoints()
    ctx = wiring.context(None)
    opened: list[node.Opened] = []
    try:
        for open_role in _openers(roles, endpoints):
            role = open_role(ctx)
            opened.extend(role if isinstance(role, list) else [role])
        log.info("serial run: controller, broker, %d worker(s), assembler%s and learner in "
                 "this process", roles.run.workers, ", evaluator" if roles.run.evaluator else "")
        poller = zmq.Poller()
        with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
            return node.serve([o.loop(stop, poller) for o in opened], poller)
    finally:
        for o in opened:
            o.cleanup()
        wiring.destroy(ctx, 0)
        for sig, handler in handlers.items():  # the caller's again (a test, a notebook)
            signal.signal(sig, handler)


def _openers(roles: Roles, endpoints: dict[str, str]) -> list[Any]:
    """How each role's process is opened, in the order a run needs them."""
    def logger(role: str) -> logging.Logger:
        return logging.getLogger(f"stepbus.{role}")

    openers: list[Any] = [
        lambda ctx: controller.open_controller(ctx, wired(roles.controller, endpoints),
                                               logger("controller")),
        lambda ctx: broker.open_broker(ctx, wired(roles.broker, endpoints), logger("broker")),
        lambda ctx: assembler.open_assembler(ctx, wired(roles.assembler, endpoints),
                                             logger("assembler"))]
    for i in range(roles.run.workers):
        cfg = dataclasses.replace(wired(roles.worker, endpoints), name=f"w{i}", worker_index=i)
        openers.append(lambda ctx, cfg=cfg: _open_worker(ctx, cfg))
    if roles.run.evaluator:
        openers.append(lambda ctx: evaluator.open_evaluator(
            ctx, wired(roles.evaluator, endpoints), logger("evaluator"), raise_env_errors=True))
    settings = {k: s.value for k, s in runconfig.load().items()}
    for config in (roles.controller, roles.broker, roles.worker, roles.assembler,
                   roles.learner, roles.run, *([roles.evaluator] if roles.run.evaluator else [])):
        settings |= runconfig.recorded(config)
    openers.append(lambda ctx: learner.open_learner(ctx, wired(roles.learner, endpoints),
                                                    logger("trainer"), name="learner",
                                                    settings=settings))
    return openers


def _open_worker(ctx: zmq.Context, cfg: worker.Config) -> list[node.Opened]:
    """A worker, or its splits (`--splits`), each a process on the shared thread."""
    log = logging.getLogger(f"stepbus.worker.{cfg.name}")
    try:
        envsets = worker.make_split_envs(cfg, log)
    except worker.CannotCreateEnv as exc:
        raise SettingError(str(exc)) from None
    for envs in envsets:
        envs.raise_errors = True
    opened = worker.open_workers(ctx, cfg, log, envsets, node.StopFlag(()))
    assert opened is not None, "a serial worker is given its broker's endpoint"
    return opened
