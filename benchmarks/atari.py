"""Atari Breakout frames per second with the built-in Nature CNN acting: the stepbus pipeline
next to gymnasium's AsyncVectorEnv stepping the same envs with the same CNN in its loop.

    python benchmarks/atari.py                          # 4 workers x 32 envs, 30 s windows
    python benchmarks/atari.py --workers 2 --envs-per-worker 32
    python benchmarks/atari.py --smoke                  # ~20 s: proves it still works

Env: `stepbus.workers.games:atari_breakout` (ALE/Breakout-v5, frameskip 1, AtariPreprocessing,
FrameStackObservation(4) moved to channels last: 84x84x4 uint8; one step is 4 emulator frames).
The figure is env steps per second; Atari frames per second are 4 times that.

stepbus: the five roles as real processes on ipc endpoints (throughput.py's Pipeline), with
four workers by default. On two cores, two workers often both wait for actions at once, while
the broker runs the CNN on one batch at a time, and a core sits idle (6-14% of the two went
unused); with four, two more step meanwhile (5-8% unused; docs/performance.md). The
broker acts with `--model torch` (the Nature CNN, one torch thread), the learner with
`--model torch --algo atari:TorchConsumeOnly`: it takes every batch in, receipts and
checkpoints it, publishes the CNN's weights and learns nothing, so acting and stepping are what
is measured, not a CPU-bound PPO update. The assembler cuts trajectories at PPO's Atari
horizon, 128 steps (`--horizon`). Its figure is the assembler's step count over the window.

AsyncVectorEnv: as many envs as the pipeline has, in a child process: shared memory, the fork
start method, and each step's observations through the same CNN (`torch_agents.make_agent`,
no grad, `--vec-torch-threads` threads, default 1 as the broker) for the next actions.
Both run in turn, stepbus first; one JSON line each, then the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stepbus.bus import launch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import solve_time  # noqa: E402  (waiting for a quiet machine)
import throughput  # noqa: E402  (the pipeline and load meter)

ENV = "stepbus.workers.games:atari_breakout"
ALGO = "atari:TorchConsumeOnly"  # this file, found through PYTHONPATH
FRAMES_PER_STEP = 4
# PPO's Atari horizon (Schulman et al. 2017; CleanRL's ppo_atari.py --num-steps): trajectories
# of 128 steps, where the assembler's default of 32 suits CartPole's short episodes.
ATARI_HORIZON = 128


class TorchConsumeOnly:
    """`--algo` for a torch model that learns nothing (trainer/consume.py's ConsumeOnly for
    torch): built as TorchPPO is, `(module, action, config, rng)`; the module's weights stay
    its initial ones."""

    def __init__(self, module: Any, action: Any, config: Any, rng: np.random.Generator) -> None:
        self.module = module

    def update(self, batch: Sequence[Any], tick: Callable[[], object] | None = None
               ) -> dict[str, float]:
        return {"consumed_steps": float(sum(len(t) for t in batch))}

    def optimizer_state(self) -> dict[str, Any]:
        return {}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Nothing to restore: there is no optimiser."""


def measure_stepbus(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline's steps/s with the CNN acting and the consume-only torch learner."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH", "")])])
    setup = throughput.Setup(args.workers, args.envs_per_worker, shm_frames=args.shm_frames)
    model = ["--model", "torch", "--torch-threads", str(args.torch_threads)]
    spec = argparse.Namespace(
        transport="ipc", batch_steps=args.batch_steps, warmup=args.warmup, seconds=args.seconds,
        flags={"broker": model, "trainer": [*model, "--algo", ALGO],
               "assembler": ["--horizon", str(args.horizon)]})
    row = throughput.measure_stepbus(ENV, setup, spec)
    if not row.steps_per_s:
        raise SystemExit(f"stepbus failed: {row.note}\n{row.detail.get('logs', '')}")
    return {"system": "stepbus", "config": setup.label(), "envs": row.envs,
            "steps_per_s": round(row.steps_per_s), "note": row.note,
            "learner_steps_per_s": row.detail.get("learner_steps_per_s"),
            "cpu_percent": row.detail.get("cpu_percent"),
            "cpu_us_per_step": row.detail.get("cpu_us_per_step")}


class ActingLoop:
    """AsyncVectorEnv stepped with the CNN's actions on each step's observations."""

    def __init__(self, vec: Any, agent: Any, obs: np.ndarray) -> None:
        self.vec, self.agent, self.obs = vec, agent, obs

    def step(self) -> None:
        import torch

        with torch.no_grad():
            action, _, _, _ = self.agent.get_action_and_value(torch.from_numpy(self.obs))
        self.obs = self.vec.step(action.numpy())[0]


def async_child(spec: dict[str, Any]) -> int:
    """Child side of `measure_async`: step, act with the CNN, print one JSON line."""
    import gymnasium as gym
    import torch

    from stepbus.models import torch_agents
    from stepbus.workers import games

    torch.set_num_threads(spec["torch_threads"])
    torch.manual_seed(0)
    vec = gym.vector.AsyncVectorEnv([games.atari_breakout] * spec["envs"], shared_memory=True,
                                    context="fork")
    try:
        agent = torch_agents.make_agent(vec.single_observation_space, vec.single_action_space)
        loop = ActingLoop(vec, agent, vec.reset(seed=0)[0])
        rate, other = throughput._timed(loop.step, spec["envs"], spec["seconds"],
                                        spec["warmup"])
    finally:
        vec.close(terminate=True)
    print(json.dumps({"steps_per_s": rate, "other_load_percent": round(other)}), flush=True)
    return 0


def measure_async(args: argparse.Namespace) -> dict[str, Any]:
    envs = args.workers * args.envs_per_worker
    spec = {"envs": envs, "seconds": args.seconds, "warmup": args.warmup,
            "torch_threads": args.vec_torch_threads}
    group = launch.Group()
    try:
        proc = group.start([sys.executable, __file__, "--async-child", json.dumps(spec)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.popen.communicate(timeout=args.seconds + args.warmup + 120)
    finally:
        group.stop(grace_s=2.0)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.poll() != 0 or not lines:
        raise SystemExit(f"AsyncVectorEnv failed: {err.strip()[-2000:]}")
    result = json.loads(lines[-1])
    return {"system": "AsyncVectorEnv", "config": f"{envs} envs, fork, shm, CNN with "
            f"{args.vec_torch_threads} torch thread(s)", "envs": envs,
            "steps_per_s": round(result["steps_per_s"]),
            "note": f"other load {result['other_load_percent']}%"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--envs-per-worker", type=int, default=32)
    parser.add_argument("--shm-frames", action=argparse.BooleanOptionalAction, default=None,
                        help="every batch of frames through shared memory (--no-shm-frames: "
                             "none); default: the workers' own choice, by batch size")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=10.0, help="stepping before it")
    parser.add_argument("--batch-steps", type=int, default=2048,
                        help="the consuming learner's batch (sets the broker's credit window)")
    parser.add_argument("--horizon", type=int, default=ATARI_HORIZON,
                        help="the assembler's --horizon (default: PPO's Atari horizon)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads of stepbus's broker and learner (--torch-threads)")
    parser.add_argument("--vec-torch-threads", type=int, default=1,
                        help="torch threads of AsyncVectorEnv's loop (the broker's: "
                             "--torch-threads)")
    solve_time.add_wait_load(parser, "system (15 min at most)")
    parser.add_argument("--smoke", action="store_true",
                        help="1 worker x 4 envs, 2 s windows after 2 s")
    parser.add_argument("--async-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.async_child:
        return async_child(json.loads(args.async_child))
    if args.smoke:
        args.workers, args.envs_per_worker, args.seconds, args.warmup = 1, 4, 2.0, 2.0
        args.batch_steps = 256
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    load = os.getloadavg()
    print(f"command: {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}; {os.cpu_count()} "
          f"cores; {time.strftime('%Y-%m-%d %H:%M')}; load average {load[0]:.2f} "
          f"{load[1]:.2f} {load[2]:.2f}", flush=True)
    figures = {}
    for system, measure in (("stepbus", measure_stepbus), ("AsyncVectorEnv", measure_async)):
        if args.wait_load:
            solve_time.wait_for_quiet(args.wait_load, 900)
        before = round(os.getloadavg()[0], 2)
        figures[system] = {**measure(args), "load_1min_before": before}
        print(json.dumps(figures[system]), flush=True)
    ours, theirs = figures["stepbus"], figures["AsyncVectorEnv"]
    ratio = ours["steps_per_s"] / max(theirs["steps_per_s"], 1)
    print(f"env steps/s (x{FRAMES_PER_STEP} for Atari frames/s): stepbus {ours['steps_per_s']}, "
          f"AsyncVectorEnv {theirs['steps_per_s']}; stepbus / AsyncVectorEnv {ratio:.2f}x; "
          f"load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
