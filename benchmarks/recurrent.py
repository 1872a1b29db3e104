"""A task that needs memory, from `honcho start`: CartPole-v1 without its two velocities
(`stepbus.workers.tasks:cartpole_no_velocity`), learned with `--model torch-lstm`, then with the
feed-forward `--model torch` for the same wall time.

    python benchmarks/recurrent.py [--runs 1] [--target 400] [--budget-s 600] [--wait-load 1.5]

Each run is the repository's Procfile in a fresh temp dir, with `STEPBUS_MODEL` and
`STEPBUS_ENV` in the environment (as a `.env` next to the Procfile would set them) and
`--target-return` on the trainer's line; endpoints on free TCP ports, seed i for every process.
The LSTM run ends when the last 20 episodes' mean return reaches the target (or at the
budget); the feed-forward run is given the same wall time and stopped there. Prints one JSON
line per run (wall time, env steps, the last mean return) and the LSTM's time to the target.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from solve_time import add_wait_load, before_run, in_work_dir, run_tagged, wait_for_quiet

TASK = "stepbus.workers.tasks:cartpole_no_velocity"


def one_run(model: str, seed: int, target: float, budget_s: float) -> dict[str, Any]:
    """`honcho start` with this model on the memory task, to its exit or `budget_s`."""
    work = Path(tempfile.mkdtemp(prefix="sb-recurrent-"))
    try:
        env = in_work_dir(work, seed, {"trainer": f"--target-return {target:g}"})
        env.update(STEPBUS_MODEL=model, STEPBUS_ENV=TASK)
        honcho = shutil.which("honcho", path=env["PATH"]) or "honcho"
        result: dict[str, Any] = {"model": model, "seed": seed, **before_run()}
        rc, wall, _, _ = run_tagged([honcho, "start"], env, work, budget_s)
        result.update({"rc": rc, "wall_s": round(wall, 1)})
        metrics = list(work.glob("runs/*/metrics.jsonl"))
        lines = metrics[0].read_text().splitlines() if metrics else []
        records = [json.loads(line) for line in lines if line.strip()]
        if records:
            last = records[-1]
            result.update({"env_steps": last["env_steps"], "mean_return": last["mean_return"],
                           "best_mean_return": max(r["mean_return"] or 0 for r in records),
                           "trainer_wall_s": last["wall_s"]})
        result["reached_target"] = rc == 0 and (result.get("mean_return") or 0) >= target
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--runs", type=int, default=1, help="seeds 0..runs-1 [default: 1]")
    parser.add_argument("--target", type=float, default=400.0,
                        help="last-20 mean return the LSTM run stops at [default: 400]")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="the longest an LSTM run may take [default: 600]")
    add_wait_load(parser, "run")
    args = parser.parse_args()
    for seed in range(args.runs):
        if args.wait_load:
            wait_for_quiet(args.wait_load, 600)
        lstm = one_run("torch-lstm", seed, args.target, args.budget_s)
        print(json.dumps(lstm), flush=True)
        if args.wait_load:
            wait_for_quiet(args.wait_load, 600)
        same_time = float(lstm["wall_s"])
        mlp = one_run("torch", seed, args.target, same_time)
        print(json.dumps(mlp), flush=True)
        print(f"# seed {seed}: torch-lstm {'reached' if lstm['reached_target'] else 'missed'} "
              f"{args.target:g} in {lstm['wall_s']} s ({lstm.get('env_steps')} env steps); "
              f"torch (feed-forward) in the same time: mean return "
              f"{mlp.get('mean_return')}, best {mlp.get('best_mean_return')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
