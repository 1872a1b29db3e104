"""Continuing a run after everything stopped: `stepbus trainer --resume RUN` (or
`STEPBUS_RESUME=RUN`, which honcho gives every process from `.env`).

RUN is a run directory, or `latest` (RUNS_DIR/latest, the newest run). Before a command
builds its flags, `prepare` checks that RUN is a run (a checkpoint in it; else one line, exit
2), resolves it once (a learner restarted later resumes the same run, wherever `latest` points
by then) and makes RUN_DIR/config.toml the run configuration: the run goes on with the settings
it was made with, and a flag or a STEPBUS_<FLAG> variable given now still overrides them (the
learner logs each, `overrides`). With STEPBUS_RESUME every process reads it, so the workers step
the run's env with the run's settings.

The learner uses RUN_DIR as its run directory and continues what its checkpoint holds; its
heartbeats say which run it resumes, and the controller carries that run id on
(bus/controller.py), so `stepbus status` and a learner that joins later agree with it.

A run that reached its goal is done: `finished` says so in one line and the command exits 0,
unless a new goal is given (a higher --target-return, or a --max-env-steps or --max-updates the
run has not reached); then the parts of the old goal that are met no longer end it (`go_on`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from stepbus import runconfig
from stepbus.bus import policies
from stepbus.bus.exits import SettingError
from stepbus.trainer import checkpoint
from stepbus.trainer.algorithm import CannotStart
from stepbus.trainer.progress import TARGET_MET, Progress, progress_of

RESUME_ENV = "STEPBUS_RESUME"
RUNS_DIR_ENV = "STEPBUS_RUNS_DIR"
CONFIG_FILE = "config.toml"
LATEST = "latest"
# Commands that read the run configuration, and those of them with a --resume flag.
PROCESS_COMMANDS = ("controller", "broker", "worker", "assembler", "trainer", "learner", "run",
                    "supervise")
FLAG_COMMANDS = ("trainer", "learner", "run")


def locate(value: str, runs_dir: str) -> Path:
    """The run directory `value` names (`latest`: RUNS_DIR/latest's target), resolved. Raises
    SettingError, one line, for anything that is not a run with a checkpoint."""
    path = Path(runs_dir) / LATEST if value == LATEST else Path(value)
    if not path.is_dir():
        raise SettingError(f"--resume {value}: {path} is not a run directory"
                           + (" (no run yet)" if value == LATEST else ""))
    path = path.resolve()
    if not any(_checkpoints(path)) and not any(
            any(_checkpoints(d)) for d in path.glob("policy-*") if d.is_dir()):
        raise SettingError(f"--resume {value}: {path} holds no checkpoint "
                           f"({' or '.join(checkpoint.FILE_NAMES)}): not a run, or one stopped "
                           "before its first checkpoint")
    return path


def _checkpoints(directory: Path) -> list[Path]:
    return [directory / name for name in checkpoint.FILE_NAMES if (directory / name).is_file()]


def prepare(argv: list[str], environ: MutableMapping[str, str] | None = None) -> list[str]:
    """`argv` with its --resume value resolved, and the environment made to resume: the run's
    config.toml as the run configuration (STEPBUS_CONFIG) and STEPBUS_RESUME the run's
    directory, for this process and those it starts. Raises SettingError for a RUN that is not
    a run."""
    env = os.environ if environ is None else environ
    command = next(iter(argv), "")
    if command not in PROCESS_COMMANDS:
        return argv
    argv, at = list(argv), _flag_at(argv) if command in FLAG_COMMANDS else None
    value = env.get(RESUME_ENV, "") if at is None else argv[at].partition("=")[2] or (
        argv[at + 1] if at + 1 < len(argv) else "")
    if not value:
        return argv
    run_dir = locate(value, env.get(RUNS_DIR_ENV) or "runs")
    if at is not None:
        argv[at:at + (1 if "=" in argv[at] else 2)] = ["--resume", str(run_dir)]
    env[RESUME_ENV] = str(run_dir)
    if (run_dir / CONFIG_FILE).is_file():
        env[runconfig.CONFIG_ENV] = str(run_dir / CONFIG_FILE)
    return argv


def _flag_at(argv: list[str]) -> int | None:
    """Where --resume is in a command's flags (the last one given wins, as in argparse)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--resume" or arg.startswith("--resume="):
            found = i
    return found


def policy_checkpoint(run_dir: Path, policy_name: str) -> Path | None:
    """The checkpoint of a policy's learner in a run (None: it has none)."""
    directory = run_dir if policy_name == policies.DEFAULT else run_dir / f"policy-{policy_name}"
    found = _checkpoints(directory)
    return found[0] if found else None


def finished(cfg: Any) -> str:
    """The line that says the run a learner's Config resumes reached its goal, and no new one
    is given ("" to go on: no --resume, or a run to continue). Raises SettingError for a run
    or a checkpoint that cannot be read."""
    if not cfg.resume:
        return ""
    run_dir = locate(cfg.resume, cfg.runs_dir)
    path = policy_checkpoint(run_dir, cfg.policy_name)
    if path is None:
        return ""
    try:
        progress = progress_of(checkpoint.progress_only(path), path)
    except CannotStart as exc:
        raise SettingError(str(exc)) from None
    if not progress.solved or new_goal(progress, cfg.target_return, cfg.max_env_steps,
                                       cfg.max_updates):
        return ""
    return (f"run {run_dir.name} reached its goal already ({progress.solved}; version "
            f"{progress.version}, {progress.env_steps} env steps): nothing to do; give a higher "
            "--target-return or --max-env-steps to go on")


def new_goal(progress: Progress, target_return: float | None, max_env_steps: int,
             max_updates: int) -> list[str]:
    """What of these settings is a goal the solved run has not met (empty: none is)."""
    goal = progress.goal
    old_target = float(goal.get("target_return", 0) or 0)
    out = []
    if target_return and (not old_target or target_return > old_target):
        out.append(f"--target-return {target_return:g}")
    if max_env_steps > progress.env_steps and max_env_steps != goal.get("max_env_steps", 0):
        out.append(f"--max-env-steps {max_env_steps}")
    if max_updates > progress.updates and max_updates != goal.get("max_updates", 0):
        out.append(f"--max-updates {max_updates}")
    return out


def go_on(cfg: Any, progress: Progress, target: float | None, log: logging.Logger) -> Any:
    """A solved run given a new goal: the learner's settings without the parts of the old goal
    that are met (they would end it again at once), and the progress no longer solved.
    `cfg`: the learner's Config; `target`: the target return it has now (None: none)."""
    given = new_goal(progress, cfg.target_return, cfg.max_env_steps, cfg.max_updates)
    if not progress.solved or not given:
        return cfg
    changes: dict[str, Any] = {}
    # the target return ended the run (on training or eval return, as --target-on said)
    if (target is not None and not any(g.startswith("--target-return") for g in given)
            and progress.solved.startswith(TARGET_MET)):
        changes["target_return"] = 0.0  # met: no longer a goal
    if cfg.max_env_steps and cfg.max_env_steps <= progress.env_steps:
        changes["max_env_steps"] = 0
    if cfg.max_updates and cfg.max_updates <= progress.updates:
        changes["max_updates"] = 0
    log.info("the run reached its goal before (%s); it goes on to %s%s", progress.solved,
             " and ".join(given), "".join(f", without --{k.replace('_', '-')} (met)"
                                          for k in changes))
    progress.solved, progress.goal = "", {}
    return dataclasses.replace(cfg, **changes)


def overrides(run_dir: Path, now: dict[str, Any]) -> list[str]:
    """The learner's settings `now` that differ from those the run recorded (its
    config.toml), as the log says them."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return [f"{path} is missing: the run goes on with the settings given now"]
    try:
        recorded = {k: s.value for k, s in runconfig.read(path, None).items()}
    except (SettingError, OSError) as exc:
        return [f"{path} cannot be read ({exc}): the run goes on with the settings given now"]
    return [f"--{key.replace('_', '-')} {_shown(value)} overrides the run's "
            f"{_shown(recorded[key])}" for key, value in now.items()
            if key in recorded and not _same(recorded[key], value)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(
            a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)
