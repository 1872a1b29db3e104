"""Wall time from `honcho start` to exit on the default job (CartPole-v1 to a mean return of 475).

    python benchmarks/solve_time.py --runs 3 [--workers 1] [--deterministic]

Each run uses the repository's Procfile in a fresh temp dir, endpoints on free TCP ports, and a
different --seed for workers, broker and trainer. Prints one line per run and the median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stepbus.bus import wiring

REPO = Path(__file__).resolve().parents[1]
def one_run(seed: int, workers: int, timeout_s: float, deterministic: bool = False) -> dict:
    work = Path(tempfile.mkdtemp(prefix="sb-bench-"))
    try:
        procfile = (REPO / "Procfile").read_text()
        for role in ("worker", "broker", "trainer"):
            procfile = procfile.replace(f"exec stepbus {role}",
                                        f"exec stepbus {role} --seed {seed}")
        if deterministic:
            procfile = procfile.replace("exec stepbus broker",
                                        "exec stepbus broker --deterministic")
        (work / "Procfile").write_text(procfile)
        env = dict(os.environ)
        ports = wiring.free_tcp_ports(len(wiring.ENDPOINTS))
        env.update({spec.env_var: f"tcp://127.0.0.1:{port}"
                    for spec, port in zip(wiring.ENDPOINTS.values(), ports, strict=True)})
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        honcho = shutil.which("honcho", path=env["PATH"]) or "honcho"
        t0 = time.monotonic()
        proc = subprocess.run([honcho, "start", "-c", f"worker={workers}"], cwd=work, env=env,
                              capture_output=True, timeout=timeout_s)
        wall = time.monotonic() - t0
        metrics = [json.loads(line) for line in
                   next(work.glob("runs/*/metrics.jsonl")).read_text().splitlines()]
        last = metrics[-1]
        return {"seed": seed, "rc": proc.returncode, "wall_s": round(wall, 2),
                "trainer_wall_s": last["wall_s"], "env_steps": last["env_steps"],
                "mean_return": last["mean_return"], "policy_version": last["policy_version"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=120)
    parser.add_argument("--deterministic", action="store_true",
                        help="run the broker with --deterministic")
    args = parser.parse_args()
    results = []
    for seed in range(args.runs):
        r = one_run(seed, args.workers, args.timeout_s, args.deterministic)
        results.append(r)
        print(json.dumps(r), flush=True)
    print(f"median wall time honcho start -> exit: "
          f"{statistics.median(r['wall_s'] for r in results):.1f} s; median env steps: "
          f"{statistics.median(r['env_steps'] for r in results):.0f}; "
          f"all exit 0: {all(r['rc'] == 0 for r in results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
