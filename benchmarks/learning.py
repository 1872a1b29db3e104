"""Learning beside Stable-Baselines3 on one machine, in one invocation: the same env, the same
wall-clock budget, one env process each, then 10 deterministic evaluation episodes of each
one's final policy, and the curves of training return against wall time and env steps.

    python benchmarks/learning.py --env HalfCheetah-v5 --preset halfcheetah --minutes 15
    python benchmarks/learning.py --env Hopper-v5 --preset hopper --minutes 15
    python benchmarks/learning.py --env Pendulum-v1 --preset pendulum --minutes 3
    python benchmarks/learning.py --env Acrobot-v1 --preset acrobot --minutes 3

stepbus: the repository's Procfile (honcho start, five processes, one worker of one env unless
the preset says more) with `STEPBUS_PRESET` and no goal (`STEPBUS_TARGET_RETURN=0`: the env's
reward_threshold would end the run early), stopped at the budget or at the preset's
max_env_steps (the learner checkpoints every 0.1 s); its checkpoint is played greedily (the
Gaussian's mean, clipped to the bounds) with the observation statistics of its last version.

SB3: PPO in a child interpreter with rl-zoo's hyperparameters for the env (hyperparams/ppo.yml,
as `RL_ZOO` below; VecNormalize of observations and rewards where rl-zoo normalises), one env
in a DummyVecEnv, stopped at the budget by a callback; evaluated with `deterministic=True` on
the training statistics. Both sides count from their own start (imports included).

Prints one JSON line per system and a summary; writes the curves next to `--out`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from solve_time import in_work_dir, run_tagged

EVAL_EPISODES = 10
# rl-baselines3-zoo hyperparams/ppo.yml (the -v4 entries; v5 envs are the same tasks).
_ZOO_MUJOCO = {"normalize": True, "n_envs": 1, "policy_kwargs": {
    "log_std_init": -2, "ortho_init": False, "activation_fn": "relu",
    "net_arch": {"pi": [256, 256], "vf": [256, 256]}}}
RL_ZOO: dict[str, dict[str, Any]] = {
    "HalfCheetah-v5": {**_ZOO_MUJOCO, "batch_size": 64, "n_steps": 512, "gamma": 0.98,
                       "learning_rate": 2.0633e-05, "ent_coef": 0.000401762,
                       "clip_range": 0.1, "n_epochs": 20, "gae_lambda": 0.92,
                       "max_grad_norm": 0.8, "vf_coef": 0.58096},
    "Hopper-v5": {**_ZOO_MUJOCO, "batch_size": 32, "n_steps": 512, "gamma": 0.999,
                  "learning_rate": 9.80828e-05, "ent_coef": 0.00229519, "clip_range": 0.2,
                  "n_epochs": 5, "gae_lambda": 0.99, "max_grad_norm": 0.7,
                  "vf_coef": 0.835671},
    "Acrobot-v1": {"normalize": True, "n_envs": 16, "n_steps": 256, "gae_lambda": 0.94,
                   "gamma": 0.99, "n_epochs": 4, "ent_coef": 0.0},
    "Pendulum-v1": {"normalize": False, "n_envs": 4, "n_steps": 1024, "gae_lambda": 0.95,
                    "gamma": 0.9, "n_epochs": 10, "ent_coef": 0.0, "learning_rate": 1e-3,
                    "clip_range": 0.2, "batch_size": 64},  # rl-zoo's gSDE left out, as ours
}
CURVE_EVERY_S = 5.0


# ----------------------------------------------------------------------------- stepbus

def stepbus_run(env_id: str, preset: str, seconds: float, seed: int) -> dict[str, Any]:
    """The Procfile with the preset for `seconds`; its curve and its evaluation."""
    work = Path(tempfile.mkdtemp(prefix="sb-learn-"))
    try:
        env = in_work_dir(work, seed, {})
        # the budget ends it, as SB3's: not the env's reward_threshold (the default goal)
        env.update({"STEPBUS_PRESET": preset, "STEPBUS_ENV": env_id,
                    "STEPBUS_TARGET_RETURN": "0"})
        honcho = shutil.which("honcho", path=env["PATH"]) or "honcho"
        rc, wall, _, err = run_tagged([honcho, "start"], env, work, seconds)
        runs = [d for d in (work / "runs").glob("*") if d.is_dir() and not d.is_symlink()]
        if not runs:
            return {"system": "stepbus", "error": err.strip()[-500:] or f"exit {rc}"}
        records = [json.loads(line) for line in
                   (runs[0] / "metrics.jsonl").read_text().splitlines() if line]
        curve = [[r["wall_s"], r["env_steps"], r["mean_return"]] for r in records]
        evaluation = evaluate_stepbus(runs[0], env_id, seed)
        return {"system": "stepbus", "preset": preset, "wall_s": round(wall, 1),
                "env_steps": records[-1]["env_steps"] if records else 0,
                "train_return": records[-1]["mean_return"] if records else None,
                **evaluation, "curve": curve}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def evaluate_stepbus(run_dir: Path, env_id: str, seed: int) -> dict[str, Any]:
    """EVAL_EPISODES episodes of the run's policy as `stepbus.load_policy` loads it, acting
    greedily (the Gaussian's mean clipped to the bounds, or the likeliest category) on
    observations normalised with its version's statistics."""
    import stepbus

    policy = stepbus.load_policy(run_dir)
    return play(env_id, seed, functools.partial(_greedy, policy))


def _greedy(policy: Any, obs: np.ndarray) -> Any:
    return policy.predict(obs, deterministic=True)[0]


def play(env_id: str, seed: int, policy: Any) -> dict[str, Any]:
    """EVAL_EPISODES episodes of `policy(observation) -> action` on seeds of their own (the
    same for both systems); the mean return and its spread."""
    import gymnasium as gym

    returns = []
    for episode in range(EVAL_EPISODES):
        env = gym.make(env_id)
        obs, _ = env.reset(seed=10_000 + seed * 100 + episode)
        total, done = 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(policy(obs))
            total, done = total + float(reward), terminated or truncated
        returns.append(total)
    return {"eval_return": round(float(np.mean(returns)), 1),
            "eval_std": round(float(np.std(returns)), 1)}


# ----------------------------------------------------------------------------- SB3

def sb3_run(env_id: str, seconds: float, seed: int, torch_threads: int) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--sb3-child", env_id, "--seed", str(seed),
            "--seconds", str(seconds), "--sb3-torch-threads", str(torch_threads)]
    rc, wall, out, err = run_tagged(argv, dict(os.environ), None, seconds + 600)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        return {"system": "sb3", "error": err.strip()[-500:] or f"exit {rc}"}
    return {"system": "sb3", "wall_s": round(wall, 1), **json.loads(lines[-1])}


def sb3_child(env_id: str, seconds: float, seed: int, torch_threads: int) -> int:
    """Train with rl-zoo's settings until `seconds` after this process started; print the
    curve and the deterministic evaluation as JSON."""
    started = time.monotonic()
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    torch.set_num_threads(torch_threads)
    zoo = dict(RL_ZOO[env_id])
    normalized, n_envs = zoo.pop("normalize"), zoo.pop("n_envs")
    kwargs = zoo.pop("policy_kwargs", None)
    if kwargs is not None:
        kwargs = {**kwargs, "activation_fn": torch.nn.ReLU}
    vec = make_vec_env(env_id, n_envs=n_envs, seed=seed, vec_env_cls=DummyVecEnv)
    if normalized:
        vec = VecNormalize(vec, gamma=zoo["gamma"])

    class Budget(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.returns: list[float] = []
            self.curve: list[list[float]] = []
            self.next_point = 0.0

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.returns = [*self.returns[-19:], float(info["episode"]["r"])]
            now = time.monotonic() - started
            if now >= self.next_point and self.returns:
                self.curve.append([round(now, 1), self.num_timesteps,
                                   round(float(np.mean(self.returns)), 1)])
                self.next_point = now + CURVE_EVERY_S
            return now < seconds

    model = PPO("MlpPolicy", vec, seed=seed, device="cpu", verbose=0, policy_kwargs=kwargs,
                **zoo)
    budget = Budget()
    model.learn(total_timesteps=10**9, callback=budget)
    print(json.dumps({"env_steps": int(model.num_timesteps),
                      "train_return": budget.curve[-1][2] if budget.curve else None,
                      **sb3_evaluate(model, vec, env_id, seed), "curve": budget.curve}),
          flush=True)
    return 0


def sb3_evaluate(model: Any, vec: Any, env_id: str, seed: int) -> dict[str, Any]:
    from stable_baselines3.common.vec_env import VecNormalize

    def greedy(obs: np.ndarray) -> Any:
        seen = vec.normalize_obs(obs) if isinstance(vec, VecNormalize) else obs
        return model.predict(seen, deterministic=True)[0]

    return play(env_id, seed, greedy)


# ----------------------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="Pendulum-v1", choices=sorted(RL_ZOO))
    parser.add_argument("--preset", default="", help="stepbus's preset (default: from --env)")
    parser.add_argument("--minutes", type=float, default=3.0, help="each system's budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--no-sb3", action="store_true", help="stepbus only")
    parser.add_argument("--sb3-torch-threads", type=int, default=1)
    parser.add_argument("--sb3-child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None,
                        help="write both results (curves included) to this JSON file")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.sb3_child:
        return sb3_child(args.sb3_child, args.seconds, args.seed, args.sb3_torch_threads)
    preset = args.preset or args.env.split("-")[0].lower()
    seconds = args.minutes * 60
    results = [stepbus_run(args.env, preset, seconds, args.seed)]
    if not args.no_sb3:
        results.append(sb3_run(args.env, seconds, args.seed, args.sb3_torch_threads))
    for result in results:
        print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"env": args.env, "minutes": args.minutes,
                                        "seed": args.seed, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
