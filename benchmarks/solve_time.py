"""Wall time to solve CartPole-v1, stepbus (`honcho start`) next to SB3 PPO (rl-zoo settings).

Solved: the mean return of the last 20 finished episodes is at least 475. One invocation
measures both.

    python benchmarks/solve_time.py --runs 3 [--workers 1] [--deterministic] [--no-sb3]
    python benchmarks/solve_time.py --runs 3 --wait-load 1.5   # each run waits for a quiet machine
    python benchmarks/solve_time.py --runs 4 --evaluator-ab    # the Procfile with an evaluator
                                                               # line and without, alternating

stepbus: each run uses the repository's Procfile in a fresh temp dir, endpoints on free TCP
ports, and seed i for workers, broker and trainer; the figure is `honcho start` to its exit
(start-up of all five processes, training, shutdown). Next to it, start to first policy update:
`honcho start` to the learner's first metrics record (made at its first update, with the
record's `time`), so start-up is measured apart from learning and shutdown.

Stable-Baselines3 (when importable; never required): PPO with rl-zoo3's CartPole-v1
hyperparameters (hyperparams/ppo.yml: 8 envs in a DummyVecEnv, MlpPolicy, n_steps 32, batch 256,
gae_lambda 0.8, gamma 0.98, 20 epochs, ent_coef 0, learning rate and clip range linear from
1e-3 and 0.2 over n_timesteps 1e5), seed i, on the CPU, in a child Python process. A callback
stops training at the first env step where the last 20 finished episodes (Monitor returns, all
envs) average >= 475: the earliest moment SB3 could know (stepbus checks after each policy
update). Its figure is the child's start to its exit, so interpreter start-up and importing
torch and SB3 count, as `honcho start` counts stepbus's start-up. Runs alternate (stepbus seed
0, SB3 seed 0, stepbus seed 1, ...) so a change in machine load hits both alike. Prints one JSON
line per run, the median of each, and the ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stepbus.bus import launch

REPO = Path(__file__).resolve().parents[1]
TARGET_RETURN, TARGET_EPISODES = 475.0, 20
TAG_VAR = "STEPBUS_SOLVE_TIME_TAG"  # in every process a run starts, to find and end them all

# rl-zoo3 hyperparams/ppo.yml, CartPole-v1 (n_timesteps sets the linear schedules' length).
RL_ZOO_CARTPOLE: dict[str, Any] = {
    "n_envs": 8, "n_timesteps": 100_000, "policy": "MlpPolicy", "n_steps": 32,
    "batch_size": 256, "gae_lambda": 0.8, "gamma": 0.98, "n_epochs": 20, "ent_coef": 0.0,
    "learning_rate": ("lin", 0.001), "clip_range": ("lin", 0.2)}


# ----------------------------------------------------------------------------- processes

def tagged(tag: str, var: str = TAG_VAR) -> list[int]:
    """Live processes whose environment carries this run's tag: honcho starts each of its
    children in a session of its own, so a process group cannot reach them all."""
    return launch.find_processes(tag=(var, tag))


def run_tagged(argv: list[str], env: dict[str, str], cwd: Path | None,
               timeout_s: float) -> tuple[int | None, float, str, str]:
    """(exit code or None on timeout, wall seconds, stdout, stderr) of one command; every
    process it started is ended on the way out (SIGTERM to the leader, then SIGKILL to all
    tagged processes left), whatever happens."""
    group = launch.Group(tag_var=TAG_VAR)
    t0 = time.monotonic()
    proc = group.start(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    try:
        out, err = proc.popen.communicate(timeout=timeout_s)
        return proc.poll(), time.monotonic() - t0, out, err
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - t0, "", f"no exit within {timeout_s:.0f} s"
    finally:
        group.stop()  # honcho passes the SIGTERM on to every process


def other_cpu_percent(seconds: float = 2.0) -> float:
    """CPU the rest of the machine uses while we wait, in % of one core: other people's work."""
    def busy() -> float:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(values[:8]) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")

    b0, t0 = busy(), time.monotonic()
    time.sleep(seconds)
    return 100 * (busy() - b0) / (time.monotonic() - t0)


def add_wait_load(parser: argparse.ArgumentParser, each: str) -> None:
    """`--wait-load`, as every benchmark that waits for a quiet machine (`wait_for_quiet`)
    takes it; `each`: what it waits before ("run", "system")."""
    parser.add_argument("--wait-load", type=float, default=0.0, metavar="LOAD",
                        help=f"before each {each}, wait until the 1-min load average is below "
                             "LOAD (0: do not wait)")


def wait_for_quiet(max_load: float, max_wait_s: float) -> None:
    """Until the 1-minute load average is below `max_load` (at most `max_wait_s`)."""
    deadline = time.monotonic() + max_wait_s
    said = False
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        if not said:
            print(f"# waiting for the 1-min load average ({os.getloadavg()[0]:.2f}) to fall "
                  f"below {max_load:g}", file=sys.stderr, flush=True)
            said = True
        time.sleep(5)


def before_run() -> dict[str, float]:
    return {"load_1min": round(os.getloadavg()[0], 2),
            "other_cpu_percent": round(other_cpu_percent())}


# ----------------------------------------------------------------------------- stepbus

EVALUATOR_LINE = "evaluator: exec stepbus supervise evaluator"  # docs/operations.md's
STEADY_AFTER_S = 1.5  # of the learner's time: start-up is over (steady_rate)


def in_work_dir(work: Path, seed: int, flags: dict[str, str],
                evaluator: bool = False) -> dict[str, str]:
    """The repository's Procfile in `work`, `--seed seed` (and `flags` by role) at the end of
    the worker, broker and trainer lines (a supervised line passes them to its child), and
    with `evaluator` the evaluator's line; the environment to start it in: endpoints on free
    TCP ports, this Python's scripts first on PATH."""
    from stepbus.bus import wiring

    lines = []
    for line in (REPO / "Procfile").read_text().splitlines():
        name = line.partition(":")[0]
        if name in ("worker", "broker", "trainer"):  # `stepbus supervise ROLE` passes flags on
            line = f"{line} --seed {seed} {flags.get(name, '')}".rstrip()
        lines.append(line)
    if evaluator:
        lines.append(EVALUATOR_LINE)
    (work / "Procfile").write_text("\n".join(lines) + "\n")
    env = dict(os.environ)
    ports = wiring.free_tcp_ports(len(wiring.ENDPOINTS))
    env.update({spec.env_var: f"tcp://127.0.0.1:{port}"
                for spec, port in zip(wiring.ENDPOINTS.values(), ports, strict=True)})
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def one_run(seed: int, workers: int, timeout_s: float, deterministic: bool = False,
            evaluator: bool = False) -> dict:
    """`honcho start` of the repository's Procfile (with `evaluator`, plus the evaluator's
    line) with this seed, timed to its exit."""
    work = Path(tempfile.mkdtemp(prefix="sb-bench-"))
    try:
        env = in_work_dir(work, seed, {"broker": "--deterministic"} if deterministic else {},
                          evaluator)
        honcho = shutil.which("honcho", path=env["PATH"]) or "honcho"
        started = time.time()  # the metrics records' clock
        rc, wall, _, err = run_tagged([honcho, "start", "-c", f"worker={workers}"], env, work,
                                      timeout_s)
        result: dict[str, Any] = {"system": "stepbus+evaluator" if evaluator else "stepbus",
                                  "seed": seed, "rc": rc, "wall_s": round(wall, 2)}
        metrics_files = list(work.glob("runs/*/metrics.jsonl"))
        lines = metrics_files[0].read_text().splitlines() if metrics_files else []
        records = [json.loads(line) for line in lines]
        if records:
            # the first record made at an update (an evaluator's result may come before one)
            first = next((r for r in records if r.get("updates")), None)
            last = records[-1]
            if first is not None:
                result["first_update_s"] = round(first["time"] - started, 2)
            result.update({"trainer_wall_s": last["wall_s"], "env_steps": last["env_steps"],
                           "mean_return": last["mean_return"],
                           "policy_version": last["policy_version"],
                           "steps_per_s": steady_rate(records),
                           "eval_records": sum("eval_return" in r for r in records)})
        result["solved"] = rc == 0 and (result.get("mean_return") or 0) >= TARGET_RETURN
        if rc != 0:
            result["error"] = (err.strip().splitlines() or ["no output"])[-1][-300:]
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def steady_rate(records: list[dict]) -> int | None:
    """Stepping throughput once under way: env steps learned per second of the learner's time
    from its first record past STEADY_AFTER_S to its last, so the start-up of more or fewer
    processes does not count (None for a run too short to have one)."""
    under_way = [r for r in records if r["wall_s"] >= STEADY_AFTER_S]
    if len(under_way) < 2 or under_way[-1]["wall_s"] <= under_way[0]["wall_s"]:
        return None
    first, last = under_way[0], under_way[-1]
    return round((last["env_steps"] - first["env_steps"]) / (last["wall_s"] - first["wall_s"]))


# ----------------------------------------------------------------------------- SB3

def sb3_run(seed: int, timeout_s: float, torch_threads: int, python: str) -> dict:
    """One SB3 run in a child interpreter, timed from its start to its exit."""
    argv = [python, __file__, "--sb3-child", str(seed),
            "--sb3-torch-threads", str(torch_threads)]
    rc, wall, out, err = run_tagged(argv, dict(os.environ), None, timeout_s)
    result: dict[str, Any] = {"system": "sb3", "seed": seed, "rc": rc, "wall_s": round(wall, 2)}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if lines:
        result.update(json.loads(lines[-1]))
    if rc != 0 or not lines:
        result["solved"] = False
        result["error"] = (err.strip().splitlines() or [f"exit {rc}"])[-1][-300:]
    return result


def sb3_child(seed: int, torch_threads: int) -> int:
    """Child side of `sb3_run`: train until solved (or rl-zoo's n_timesteps), print JSON."""
    t_start = time.monotonic()
    import numpy as np
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv

    if torch_threads > 0:
        torch.set_num_threads(torch_threads)

    def linear(initial: float) -> Any:
        """rl-zoo3's `lin_X`: X times the fraction of training left."""
        return lambda progress_remaining: progress_remaining * initial

    class Solved(BaseCallback):
        """Stops training once the last TARGET_EPISODES finished episodes average the
        target; remembers when."""

        def __init__(self) -> None:
            super().__init__()
            self.returns: list[float] = []
            self.solved_at: float | None = None

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                episode = info.get("episode")
                if episode is not None:
                    self.returns = [*self.returns[1 - TARGET_EPISODES:], float(episode["r"])]
            if (len(self.returns) == TARGET_EPISODES
                    and float(np.mean(self.returns)) >= TARGET_RETURN):
                self.solved_at = time.monotonic()
                return False
            return True

    zoo = RL_ZOO_CARTPOLE
    t_imported = time.monotonic()
    env = make_vec_env("CartPole-v1", n_envs=zoo["n_envs"], seed=seed, vec_env_cls=DummyVecEnv)
    model = PPO(zoo["policy"], env, n_steps=zoo["n_steps"], batch_size=zoo["batch_size"],
                gae_lambda=zoo["gae_lambda"], gamma=zoo["gamma"], n_epochs=zoo["n_epochs"],
                ent_coef=zoo["ent_coef"], learning_rate=linear(zoo["learning_rate"][1]),
                clip_range=linear(zoo["clip_range"][1]), seed=seed, device="cpu", verbose=0)
    callback = Solved()
    t_learn = time.monotonic()
    model.learn(total_timesteps=zoo["n_timesteps"], callback=callback)
    t_end = time.monotonic()
    returns = callback.returns
    print(json.dumps({
        "solved": callback.solved_at is not None, "env_steps": int(model.num_timesteps),
        "mean_return": round(float(np.mean(returns)), 1) if returns else None,
        "import_s": round(t_imported - t_start, 2),
        "train_s": round((callback.solved_at or t_end) - t_learn, 2),
        "torch_threads": torch.get_num_threads()}), flush=True)
    return 0


# ----------------------------------------------------------------------------- main

def sb3_importable(python: str) -> bool:
    """Whether `python` can import SB3 (asked in a child when it is another interpreter)."""
    if python == sys.executable:
        return importlib.util.find_spec("stable_baselines3") is not None
    probe = ("import importlib.util, sys; "
             "sys.exit(not importlib.util.find_spec('stable_baselines3'))")
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def print_evaluator_ab(results: dict[str, list[dict]]) -> None:
    """--evaluator-ab: the runs with the evaluator, and stepping throughput with and without."""
    print(median_line("stepbus + evaluator line in the Procfile", results["stepbus+evaluator"])
          + f"; all exit 0: {all(r['rc'] == 0 for r in results['stepbus+evaluator'])}")
    for system in ("stepbus", "stepbus+evaluator"):
        rates = [r["steps_per_s"] for r in results[system] if r.get("steps_per_s")]
        print(f"{system}: env steps/s once under way (learned per second of the learner's "
              f"time after {STEADY_AFTER_S} s) median "
              f"{statistics.median(rates) if rates else 0:.0f} ({', '.join(map(str, rates))})"
              + ("; eval records per run " + ", ".join(
                  str(r.get("eval_records", 0)) for r in results[system])
                 if system != "stepbus" else ""))


def median_line(name: str, results: list[dict]) -> str:
    walls = [r["wall_s"] for r in results]
    steps = [r["env_steps"] for r in results if r.get("env_steps")]
    solved = sum(bool(r.get("solved")) for r in results)
    firsts = [r["first_update_s"] for r in results if r.get("first_update_s") is not None]
    return (f"{name}: median wall time {statistics.median(walls):.2f} s over {len(walls)} runs "
            f"({', '.join(f'{w:.2f}' for w in walls)}); median env steps "
            f"{statistics.median(steps) if steps else 0:.0f}; solved {solved}/{len(results)}"
            + (f"; start to first policy update median {statistics.median(firsts):.2f} s "
               f"({', '.join(f'{f:.2f}' for f in firsts)})" if firsts else ""))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="seeds 0..runs-1 for each system")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=120)
    parser.add_argument("--deterministic", action="store_true",
                        help="run the broker with --deterministic")
    parser.add_argument("--no-sb3", action="store_true", help="stepbus only")
    parser.add_argument("--evaluator-ab", action="store_true",
                        help="instead of SB3, each seed's stepbus run again with an evaluator "
                             "line in the Procfile (A/B/A/B), and both step rates")
    parser.add_argument("--sb3-python", default="", metavar="PYTHON",
                        help="interpreter for SB3 (default: this one), e.g. a venv of its own")
    parser.add_argument("--sb3-torch-threads", type=int, default=0,
                        help="torch.set_num_threads for SB3 (0: torch's default, as rl-zoo3)")
    add_wait_load(parser, "run")
    parser.add_argument("--wait-max-s", type=float, default=900.0,
                        help="the longest --wait-load waits before running anyway")
    parser.add_argument("--sb3-child", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.sb3_child is not None:
        return sb3_child(args.sb3_child, args.sb3_torch_threads)
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so every `finally` ends what it started
    sb3_python = args.sb3_python or sys.executable
    sb3 = not args.no_sb3 and sb3_importable(sb3_python)
    load_before = os.getloadavg()
    results = alternate_runs(args, sb3, sb3_python)
    load_after = os.getloadavg()
    print(f"date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; {os.cpu_count()} cores; load average "
          "(1, 5, 15 min) before {:.2f} {:.2f} {:.2f}, after {:.2f} {:.2f} {:.2f}"
          .format(*load_before, *load_after))
    print(f"stepbus python: {sys.executable} (its learner keeps tensorboardX from importing "
          f"torch: trainer/metrics.py); SB3 python: {sb3_python}")
    print_medians(args, sb3, sb3_python, results)
    return 0


def alternate_runs(args: argparse.Namespace, sb3: bool, sb3_python: str) -> dict[str, list[dict]]:
    """Every run, stepbus and SB3 taking turns seed by seed so a change in machine load hits
    both alike; one JSON line printed per run as it ends."""
    results: dict[str, list[dict]] = {"stepbus": [], "sb3": [], "stepbus+evaluator": []}
    for seed in range(args.runs):
        runs = [("stepbus", lambda s=seed: one_run(s, args.workers, args.timeout_s,
                                                    args.deterministic))]
        if args.evaluator_ab:  # A/B/A/B: each seed without, then with the evaluator
            runs.append(("stepbus+evaluator", lambda s=seed: one_run(
                s, args.workers, args.timeout_s, args.deterministic, evaluator=True)))
        elif sb3:
            runs.append(("sb3", lambda s=seed: sb3_run(s, args.timeout_s,
                                                       args.sb3_torch_threads, sb3_python)))
        for system, start in runs:
            if args.wait_load:
                wait_for_quiet(args.wait_load, args.wait_max_s)
            quiet = before_run()
            r = start()
            r.update(quiet)
            results[system].append(r)
            print(json.dumps(r), flush=True)
    return results


def print_medians(args: argparse.Namespace, sb3: bool, sb3_python: str,
                  results: dict[str, list[dict]]) -> None:
    """Each system's median line and their ratio, or why SB3 was not measured."""
    print(median_line(f"stepbus honcho start -> exit ({args.workers} worker(s)"
                      f"{', deterministic' if args.deterministic else ''})", results["stepbus"])
          + f"; all exit 0: {all(r['rc'] == 0 for r in results['stepbus'])}")
    if args.evaluator_ab:
        print_evaluator_ab(results)
    elif args.no_sb3:
        print("SB3 PPO: skipped (--no-sb3)")
    elif not sb3:
        print(f"SB3 PPO: not measured: stable_baselines3 is not importable in {sb3_python} "
              "(pip install stable-baselines3)")
    else:
        print(median_line("SB3 PPO rl-zoo CartPole-v1 (DummyVecEnv x 8), process start -> exit",
                          results["sb3"]))
        ours = statistics.median(r["wall_s"] for r in results["stepbus"])
        theirs = statistics.median(r["wall_s"] for r in results["sb3"])
        print(f"stepbus / SB3 median wall time: {ours / theirs:.2f}")


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
