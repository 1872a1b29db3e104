"""stepbus as a vector env: env steps per second against gymnasium's AsyncVectorEnv, and SB3's
PPO solving CartPole-v1 on `stepbus.vector.sb3.VecEnv`.

    python benchmarks/vector.py [--num-envs 8 32] [--seconds 5] [--env ID ...] [--workers 2 4]
                                [--sb3]

Throughput: each `--env` (default CartPole-v1, and stepbus.workers.bench_envs:heavy_tailed,
whose steps cost 1 ms of CPU, 10 ms one time in ten) with random actions drawn beforehand (no
policy), for each num_envs: gymnasium's SyncVectorEnv (one process), AsyncVectorEnv (one
process per env, observations in shared memory), and `stepbus.vector.make(..., workers=W)` for
each `--workers` W (default 2) stepped in lockstep (`step`) and asynchronously (`send`/`recv`
with batch_size num_envs / 2: whichever envs are ready); where `envpool` is installed and has
the env, EnvPool the same two ways (its C++ thread pool). Each
figure is env steps (batch rows) per second of wall time over `--seconds`, after a warm-up; all
run in one invocation, one after the other, so load changes hit them alike.

--sb3: SB3 PPO with rl-zoo3's CartPole-v1 settings (8 envs, n_steps 32, batch 256, gae_lambda
0.8, gamma 0.98, 20 epochs, linear lr 1e-3 and clip 0.2 over 1e5 steps) on
VecMonitor(VecEnv(stepbus.vector.make("CartPole-v1", 8, workers=2, autoreset_mode="SameStep")))
and, for reference, on SB3's DummyVecEnv, same seed; stops when the last 20 episodes average
>= 475 (or at 1e5 steps). Prints JSON lines and a summary.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

import stepbus.vector as sv
from stepbus.workers.envs import make_env

TARGET_RETURN, TARGET_EPISODES = 475.0, 20
WARMUP_STEPS = 50
RL_ZOO_CARTPOLE: dict[str, Any] = {
    "n_envs": 8, "n_timesteps": 100_000, "n_steps": 32, "batch_size": 256, "gae_lambda": 0.8,
    "gamma": 0.98, "n_epochs": 20, "ent_coef": 0.0, "learning_rate": 0.001, "clip_range": 0.2}


def lockstep(envs: gym.vector.VectorEnv, actions: np.ndarray, seconds: float) -> float:
    """Env steps per second of `step` in a loop."""
    envs.reset(seed=0)
    return stepped_rows(envs.step, actions, seconds)


def stepped_rows(step: Callable[[np.ndarray], object], actions: np.ndarray,
                 seconds: float) -> float:
    """Rows per second of `step` over every env in a loop, after WARMUP_STEPS steps."""
    for t in range(WARMUP_STEPS):
        step(actions[t % len(actions)])
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        step(actions[steps % len(actions)])
        steps += 1
    return steps * len(actions[0]) / (time.perf_counter() - started)


def async_steps(envs: sv.BusVectorEnv, actions: np.ndarray, seconds: float) -> float:
    """Env steps per second of recv/send: whichever workers are ready step again at once."""
    envs.reset(seed=0)
    envs.send(actions[0])
    rate = ready_rows(lambda: envs.recv()[-1]["env_id"], envs.send, actions, seconds)
    envs.recv()
    return rate


def ready_rows(recv: Callable[[], np.ndarray], send: Callable[[np.ndarray, np.ndarray], None],
               actions: np.ndarray, seconds: float) -> float:
    """Rows per second of a recv/send loop (`recv` gives the ids of the envs that are
    ready; `send` their actions), after WARMUP_STEPS rounds."""
    rows, started, t, warm = 0, time.perf_counter(), 0, -WARMUP_STEPS
    while time.perf_counter() - started < seconds or warm < 0:
        ids = recv()
        t += 1
        send(actions[t % len(actions)][ids], ids)
        warm += 1
        if warm == 0:
            rows, started = 0, time.perf_counter()
        elif warm > 0:
            rows += len(ids)
    return rows / (time.perf_counter() - started)


def envpool_lockstep(pool: Any, actions: np.ndarray, seconds: float) -> float:
    """EnvPool's `step` (every env, batch_size num_envs) in a loop."""
    pool.reset()
    return stepped_rows(pool.step, actions, seconds)


def envpool_async(pool: Any, actions: np.ndarray, seconds: float) -> float:
    """EnvPool's `recv`/`send` with batch_size num_envs / 2: whichever envs finished first."""
    pool.async_reset()
    return ready_rows(lambda: pool.recv()[-1]["env_id"], pool.send, actions, seconds)


def envpool_makers(env: str, num_envs: int) -> list[tuple[str, Callable[[], Any],
                                                          Callable[..., float]]]:
    """EnvPool's C++ threads on the same env, where it is installed and has the env."""
    try:
        import envpool
    except ImportError:
        return []
    if env not in envpool.list_all_envs():
        return []
    return [("EnvPool lockstep", lambda: envpool.make_gymnasium(env, num_envs=num_envs),
             envpool_lockstep),
            ("EnvPool recv/send", lambda: envpool.make_gymnasium(
                env, num_envs=num_envs, batch_size=num_envs // 2), envpool_async)]


def stepbus_makers(env: str, num_envs: int, workers: list[int], sockets: bool = False
                   ) -> list[tuple[str, Callable[[], Any], Callable[..., float]]]:
    """stepbus's vector env with each worker count, in lockstep and by send/recv; with
    `sockets`, lockstep without lanes too (`make(lanes=False)`)."""
    makers: list[tuple[str, Callable[[], Any], Callable[..., float]]] = []
    for w in workers:
        makers += [(f"stepbus.vector lockstep, {w} workers",
                    functools.partial(sv.make, env, num_envs, workers=w), lockstep),
                   (f"stepbus.vector send/recv, {w} workers",
                    functools.partial(sv.make, env, num_envs, workers=w,
                                      batch_size=num_envs // 2), async_steps)]
        if sockets:
            makers.append((f"stepbus.vector lockstep, {w} workers, no lanes",
                           functools.partial(sv.make, env, num_envs, workers=w, lanes=False),
                           lockstep))
    return makers


def throughput(env: str, num_envs: int, seconds: float,
               workers: list[int], sockets: bool = False) -> list[dict[str, Any]]:
    probe = make_env(env)
    probe.action_space.seed(0)
    actions = np.array([[probe.action_space.sample() for _ in range(num_envs)]
                        for _ in range(1000)])
    probe.close()
    fns = [functools.partial(make_env, env)] * num_envs
    makers: list[tuple[str, Callable[[], Any], Callable[..., float]]] = [
        ("SyncVectorEnv", lambda: gym.vector.SyncVectorEnv(fns), lockstep),
        ("AsyncVectorEnv", lambda: gym.vector.AsyncVectorEnv(fns, shared_memory=True), lockstep),
        *stepbus_makers(env, num_envs, [w for w in workers if w <= num_envs], sockets),
        *envpool_makers(env, num_envs),
    ]
    out = []
    for name, make, measure in makers:
        envs = make()
        try:
            rate = measure(envs, actions, seconds)
        finally:
            envs.close()
        row = {"env": env, "num_envs": num_envs, "system": name,
               "env_steps_per_s": round(rate)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def sb3_solve(venv: Any, seed: int) -> dict[str, Any]:
    """SB3 PPO with rl-zoo's settings on `venv` until solved or 1e5 steps."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback

    class Solved(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.returns: list[float] = []

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.returns = [*self.returns[1 - TARGET_EPISODES:], info["episode"]["r"]]
            return not (len(self.returns) == TARGET_EPISODES
                        and float(np.mean(self.returns)) >= TARGET_RETURN)

    zoo = RL_ZOO_CARTPOLE
    model = PPO("MlpPolicy", venv, n_steps=zoo["n_steps"], batch_size=zoo["batch_size"],
                gae_lambda=zoo["gae_lambda"], gamma=zoo["gamma"], n_epochs=zoo["n_epochs"],
                ent_coef=zoo["ent_coef"], learning_rate=lambda left: left * zoo["learning_rate"],
                clip_range=lambda left: left * zoo["clip_range"], seed=seed, device="cpu")
    callback = Solved()
    started = time.perf_counter()
    model.learn(total_timesteps=zoo["n_timesteps"], callback=callback)
    mean = float(np.mean(callback.returns)) if callback.returns else None
    return {"solved": mean is not None and len(callback.returns) == TARGET_EPISODES
            and mean >= TARGET_RETURN, "last20_mean": mean and round(mean, 1),
            "env_steps": int(model.num_timesteps),
            "train_s": round(time.perf_counter() - started, 1)}


def sb3(seed: int) -> list[dict[str, Any]]:
    import torch
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, VecMonitor

    from stepbus.vector.sb3 import VecEnv

    torch.set_num_threads(1)
    rows = []
    for name in ("stepbus.vector.sb3.VecEnv, 2 workers", "DummyVecEnv"):
        if name == "DummyVecEnv":
            venv = make_vec_env("CartPole-v1", n_envs=8, seed=seed, vec_env_cls=DummyVecEnv)
        else:
            venv = VecMonitor(VecEnv(sv.make("CartPole-v1", 8, workers=2,
                                             autoreset_mode="SameStep")))
        try:
            row = {"system": f"SB3 PPO on {name}", "seed": seed, **sb3_solve(venv, seed)}
        finally:
            venv.close()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-envs", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--env", nargs="+",
                        default=["CartPole-v1", "stepbus.workers.bench_envs:heavy_tailed"])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[2],
                        help="stepbus's worker counts (each at most num_envs)")
    parser.add_argument("--sockets", action="store_true",
                        help="also stepbus in lockstep without lanes (make(lanes=False))")
    parser.add_argument("--sb3", action="store_true", help="also SB3 PPO to a solve")
    parser.add_argument("--sb3-only", action="store_true", help="only SB3 PPO to a solve")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.sb3_only:
        rows = [r for env in args.env for n in args.num_envs
                for r in throughput(env, n, args.seconds, args.workers, args.sockets)]
        for r in rows:
            base = next(q["env_steps_per_s"] for q in rows if q["system"] == "AsyncVectorEnv"
                        and q["env"] == r["env"] and q["num_envs"] == r["num_envs"])
            print(f"{r['env'][-12:]:12s} num_envs {r['num_envs']:3d}  {r['system']:36s} "
                  f"{r['env_steps_per_s']:8d} env steps/s  "
                  f"{r['env_steps_per_s'] / base:5.2f}x AsyncVectorEnv")
    if args.sb3 or args.sb3_only:
        for r in sb3(args.seed):
            print(f"{r['system']:50s} solved={r['solved']} last20={r['last20_mean']} "
                  f"in {r['env_steps']} env steps, {r['train_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
