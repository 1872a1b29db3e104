"""MinAtar Breakout in a fixed wall time: `--model torch` (the built-in small CNN) against
`--model mlp` (the numpy MLP), the same pipeline and PPO settings, one after the other.

    python benchmarks/minatar_breakout.py             # 300 s each, plots into docs/
    python benchmarks/minatar_breakout.py --seconds 60 --plots /tmp/plots
    python benchmarks/minatar_breakout.py --smoke     # ~20 s: proves it still works

Each run is the whole pipeline as real processes (controller, broker, 2 workers x 32 envs of
`stepbus.workers.games:minatar_breakout`, assembler, trainer slot with PPO), started together;
after `--seconds` from the learner's first metrics record, `stepbus shutdown` ends it and the run
directory's metrics.jsonl gives the figures: the mean return of the last 100 episodes at the
end, the env steps learned from, and the updates. `stepbus plot` draws each run's metrics into
PLOTS/minatar-<model>.png. Prints one JSON line per run, then the ratio of the final mean
returns (torch / mlp).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stepbus.bus import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # the load meter

REPO = Path(__file__).resolve().parents[1]
ENV = "stepbus.workers.games:minatar_breakout"
EPISODES_IN_MEAN = 100
# PPO for MinAtar as the usual configurations run it (64 envs x 64 steps a batch, 4 epochs of
# 8 minibatches, gamma 0.99, GAE 0.95, entropy 0.01), the same for both models.
PPO_FLAGS = ["--batch-steps", "4096", "--minibatch-size", "512", "--n-epochs", "4",
             "--lr", "0.0005", "--gamma", "0.99", "--gae-lambda", "0.95", "--ent-coef", "0.01",
             "--clip-range", "0.2", "--vf-coef", "0.5", "--max-grad-norm", "0.5"]


def start_pipeline(group: launch.Group, work: Path, model: str, args: argparse.Namespace
                   ) -> dict[str, str]:
    """The five roles in `work` on ipc endpoints there; returns the environment they got."""
    from stepbus.bus import wiring

    env = launch.environment({name: f"ipc://{work}/{name}" for name in wiring.ENDPOINTS},
                             work / "runs")
    model_flags = ["--model", model]
    roles: list[tuple[str, list[str]]] = [
        ("controller", []), ("broker", model_flags), ("assembler", []),
        *[("worker", ["--name", f"w{i}", "--worker-index", str(i), "--env", ENV,
                      "--envs-per-worker", str(args.envs_per_worker), "--seed", str(args.seed)])
          for i in range(args.workers)],
        ("trainer", [*model_flags, "--target-return", "0", "--target-episodes",
                     str(EPISODES_IN_MEAN), "--seed", str(args.seed), *PPO_FLAGS,
                     *args.trainer_flags])]
    for role, flags in roles:
        name = f"{role}-{len(group.procs)}"
        group.start_role(role, *flags, name=name, log=work / f"{name}.log", env=env)
    return env


def records(work: Path) -> list[dict[str, Any]]:
    """The run's metrics records so far (a last line still being written left out)."""
    found = list(work.glob("runs/*/metrics.jsonl"))
    out = []
    for line in found[0].read_text().splitlines() if found else []:
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def wait_learning(group: launch.Group, work: Path, timeout_s: float) -> None:
    """Until the learner wrote its first record (every process started and stepping)."""
    deadline = time.monotonic() + timeout_s
    while not records(work):
        dead = [proc for proc in group.procs if proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                             for p in sorted(work.glob("*.log")))
            raise RuntimeError(f"no learning within {timeout_s:.0f} s\n{logs}")
        time.sleep(0.5)  # a benchmark waiting for start-up


def shut_down(group: launch.Group, env: dict[str, str]) -> None:
    """`stepbus shutdown`, then the processes' own exit (each checkpoints and writes its last
    record), at most 30 s."""
    subprocess.run([sys.executable, "-m", "stepbus", "shutdown"], env=env,
                   capture_output=True, timeout=30)
    deadline = time.monotonic() + 30
    for proc in group.procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.1, deadline - time.monotonic()))


def shrink(png: Path) -> None:
    """The plot in 32 colours (about 35 KB instead of 130), small enough to commit under docs/;
    Pillow comes with matplotlib, which `stepbus plot` needs."""
    from PIL import Image

    with Image.open(png) as image:
        small = image.convert("RGB").quantize(colors=32)
    small.save(png, optimize=True)


def one_run(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline with this model for `args.seconds` of learning; its figures and plot."""
    work = Path(tempfile.mkdtemp(prefix="sb-minatar-"))
    group = launch.Group(work)
    load = round(os.getloadavg()[0], 2)
    try:
        env = start_pipeline(group, work, model, args)
        t_start = time.monotonic()
        wait_learning(group, work, 120)
        t_learning = time.monotonic()
        meter = throughput.LoadMeter({proc.pid for proc in group.procs})
        time.sleep(args.seconds)
        other = meter.other_percent()
        shut_down(group, env)
        last = records(work)[-1]
        result = {"model": model, "seconds": args.seconds,
                  "start_up_s": round(t_learning - t_start, 1),
                  "mean_return": last["mean_return"], "episodes_in_mean": EPISODES_IN_MEAN,
                  "env_steps": last["env_steps"], "episodes": last["episodes"],
                  "policy_version": last["policy_version"], "learner_wall_s": last["wall_s"],
                  "load_1min_before": load, "other_load_percent": round(other)}
        if args.plots:
            args.plots.mkdir(parents=True, exist_ok=True)
            png = args.plots / f"minatar-{model}.png"
            run_dir = next(work.glob("runs/*/metrics.jsonl")).parent
            subprocess.run([sys.executable, "-m", "stepbus", "plot", str(run_dir), "--output",
                            str(png)], check=True, capture_output=True)
            shrink(png)
            result["plot"] = str(png)
        return result
    finally:
        group.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0,
                        help="wall time of learning per model, from the learner's first record")
    parser.add_argument("--models", default="torch,mlp", help="in this order")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plots", default=str(REPO / "docs" / "img"),
                        help="where the PNGs go ('' for none)")
    parser.add_argument("--trainer-flags", default="",
                        help="more trainer flags for both runs, e.g. '--lr 0.00025'")
    parser.add_argument("--smoke", action="store_true",
                        help="2 s each, 1 worker x 8 envs, small batches, no plots")
    args = parser.parse_args(argv)
    args.trainer_flags = args.trainer_flags.split()
    if args.smoke:
        args.seconds, args.workers, args.envs_per_worker, args.plots = 2.0, 1, 8, None
        args.trainer_flags += ["--batch-steps", "256", "--minibatch-size", "128"]
    args.plots = Path(args.plots) if args.plots else None
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print(f"command: {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}; "
          f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    results = {}
    for model in args.models.split(","):
        results[model] = one_run(model, args)
        print(json.dumps(results[model]), flush=True)
    if {"torch", "mlp"} <= results.keys():
        cnn, mlp = results["torch"]["mean_return"], results["mlp"]["mean_return"]
        ratio = f"{cnn / mlp:.2f}x" if cnn is not None and mlp else "-"
        print(f"final mean return over the last {EPISODES_IN_MEAN} episodes after "
              f"{args.seconds:g} s: torch CNN {cnn}, numpy MLP {mlp}; torch / mlp {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
