"""`stepbus eval RUN`: the trained policy (`stepbus.load_policy`) played on its run's env for a
number of episodes, and the mean and spread of their returns and lengths.

Episode i is reset with seed SEED + i and acted on greedily (`--stochastic`: sampled), so a
result depends only on the run, the env, the seed and the number of episodes, not on how many
processes played them (`--envs N`: each of N children, `python -m stepbus.evaluate`, plays a
share and prints its episodes as one JSON line; arguments go in as JSON too, nothing is
pickled). A PettingZoo parallel env is played with one policy for every agent, as its workers
played it, and each agent's return is reported. `--record-video DIR` writes an MP4 per episode
through Gymnasium's RecordVideo (the `[video]` extra); `--render human` opens the env's window.

Settings that cannot work (a path that is no run, a missing checkpoint, no env to play, video
without moviepy or from an env that cannot render frames) are one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from stepbus.bus.exits import SettingError

if TYPE_CHECKING:
    from stepbus.trained import TrainedPolicy

HELP = ("play the trained policy of a run on its env (env id and kwargs from the run's "
        "config.toml) and print the mean and spread of the episodes' returns and lengths; "
        "greedy unless --stochastic (docs/checkpoint.md)")
VIDEO_EXTRA = 'pip install -e ".[video]"'
CHILD_TIMEOUT_S = 24 * 3600.0  # a child is waited for this long at most


@dataclass
class EvalConfig:
    """What `stepbus eval` plays: plain values, as they travel to a child as JSON."""

    run: str
    episodes: int = 10
    env: str = ""  # "" for the run's
    env_kwargs: str | None = None  # None for the run's
    seed: int = 0
    deterministic: bool = True
    envs: int = 1
    record_video: str = ""
    render: str = ""
    device: str = "cpu"
    first: int = 0  # a child's share: episodes first .. first + episodes - 1


@dataclass
class Episode:
    """One episode's seed, return and length; for several agents, each one's return (the
    episode's return is then their sum)."""

    seed: int
    ret: float
    length: int
    agents: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seed": self.seed, "return": self.ret, "length": self.length}
        if self.agents:
            out["returns"] = self.agents
        return out


def add_parser(sub: Any) -> None:
    """The `eval` subcommand's flags."""
    cmd = sub.add_parser("eval", help=HELP, description=HELP, allow_abbrev=False)
    cmd.add_argument("run", metavar="RUN", help="a run directory (e.g. runs/latest) or its "
                     "checkpoint file")
    cmd.add_argument("--episodes", type=_positive, default=10, help="episodes to play")
    cmd.add_argument("--env", default="", help="play this env instead of the run's (Gymnasium "
                     "id or module:callable)")
    cmd.add_argument("--env-kwargs", default=None, metavar="JSON", help="keyword arguments for "
                     "the env instead of the run's, as a JSON object")
    cmd.add_argument("--seed", type=int, default=0, help="episode i is reset with SEED + i")
    cmd.add_argument("--stochastic", action="store_true", help="sample actions from the "
                     "policy instead of taking the likeliest (the mean for Box actions)")
    cmd.add_argument("--envs", type=_positive, default=1, metavar="N", help="play the episodes "
                     "in N processes (for slow envs); the result is the same")
    cmd.add_argument("--record-video", default="", metavar="DIR", help="write an MP4 of each "
                     f"episode into DIR (needs the video extra: {VIDEO_EXTRA})")
    cmd.add_argument("--render", default="", choices=["", "human"], help="human: show the env "
                     "in its window while playing")
    cmd.add_argument("--device", default="cpu", help="where a torch model runs (cpu, cuda[:N])")
    cmd.add_argument("--json", action="store_true", help="print one JSON object: mean_return, "
                     "std_return, mean_length, episodes (each one's seed, return, length)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {value}")
    return value


def main(args: argparse.Namespace) -> int:
    """`stepbus eval`: play, print the summary. Raises SettingError."""
    cfg = EvalConfig(run=str(args.run), episodes=args.episodes, env=args.env,
                     env_kwargs=args.env_kwargs, seed=args.seed,
                     deterministic=not args.stochastic, envs=args.envs,
                     record_video=args.record_video, render=args.render, device=args.device)
    policy, env_id, kwargs = _check(cfg)
    episodes = play_all(cfg) if cfg.envs > 1 else play(cfg, policy)
    result = summary(episodes, env_id, policy.policy_version, cfg.deterministic)
    print(json.dumps(result) if args.json else describe(result, kwargs))
    return 0


def _check(cfg: EvalConfig) -> tuple[TrainedPolicy, str, dict[str, Any]]:
    """What can be told before any episode: the run loads (its policy) and names an env.
    Raises SettingError."""
    from stepbus.trained import load_policy

    if cfg.envs > 1 and (cfg.record_video or cfg.render):
        raise SettingError("--record-video and --render play in this process: leave out --envs")
    if cfg.record_video and importlib.util.find_spec("moviepy") is None:
        raise SettingError(f"--record-video needs moviepy, which is not installed: "
                           f"{VIDEO_EXTRA}")
    policy = load_policy(cfg.run, cfg.device)
    if cfg.deterministic and policy.greedy_problem:
        raise SettingError(f"{policy.greedy_problem} (--stochastic)")
    env_id, kwargs = env_of(cfg, policy.config)
    return policy, env_id, kwargs


def env_of(cfg: EvalConfig, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The env to play and its keyword arguments: the flags', else the run's. Raises
    SettingError."""
    from stepbus.workers import envs

    env_id = cfg.env or str(config.get("env") or "")
    if not env_id:
        raise SettingError(f"{cfg.run}: no config.toml names the run's env; give --env")
    text = cfg.env_kwargs if cfg.env_kwargs is not None else config.get("env_kwargs", "")
    if isinstance(text, dict):  # a run configuration may give them as a table
        return env_id, text
    try:
        return env_id, envs.env_kwargs(str(text))
    except ValueError as exc:
        raise SettingError(f"--env-kwargs: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Playing


def play(cfg: EvalConfig, policy: TrainedPolicy | None = None) -> list[Episode]:
    """Episodes first .. first + episodes - 1 of `cfg`, in this process (with `policy` loaded
    already, or loading it)."""
    from stepbus.trained import load_policy

    policy = policy or load_policy(cfg.run, cfg.device)
    env_id, kwargs = env_of(cfg, policy.config)
    env = make(env_id, kwargs, cfg)
    try:
        return [_episode(policy, env, cfg.seed + i, cfg.deterministic)
                for i in range(cfg.first, cfg.first + cfg.episodes)]
    finally:
        env.close()


def make(env_id: str, kwargs: dict[str, Any], cfg: EvalConfig) -> Any:
    """The env, made to render as asked and wrapped to record. Raises SettingError."""
    from stepbus.workers import envs

    mode = "rgb_array" if cfg.record_video else cfg.render
    try:
        env = envs.make_env(env_id, {**kwargs, "render_mode": mode} if mode else kwargs)
    except Exception as exc:  # user code or registry: one line
        raise SettingError(f"cannot make {env_id}{' to render ' + mode if mode else ''}: "
                           f"{type(exc).__name__}: {exc}"[:300]) from None
    if not cfg.record_video:
        return env
    if envs.agents_of(env) or getattr(env, "render_mode", None) != "rgb_array":
        env.close()
        raise SettingError(f"--record-video: {env_id} cannot render rgb_array frames (a "
                           "single-agent Gymnasium env with render_mode='rgb_array' can)")
    from gymnasium.wrappers import RecordVideo

    return RecordVideo(env, cfg.record_video, episode_trigger=_every_episode,
                       name_prefix=f"eval-seed{cfg.seed + cfg.first}", disable_logger=True)


def _every_episode(episode: int) -> bool:
    return True


def _episode(policy: Any, env: Any, seed: int, deterministic: bool) -> Episode:
    """One episode of a single-agent env, or of every agent of a parallel env."""
    from stepbus.workers import envs

    # episode i's draws depend on seed i alone, not on which process played the ones before
    policy.set_random_seed(seed)
    if envs.agents_of(env):
        return _parallel_episode(policy, env, seed, deterministic)
    obs, info = env.reset(seed=seed)
    state, start, total, length, done = None, True, 0.0, 0, False
    while not done:
        action, state = policy.predict(obs, state, [start], deterministic, _mask(policy, info))
        obs, reward, terminated, truncated, info = env.step(action)
        total, length, start = total + float(reward), length + 1, False
        done = bool(terminated or truncated)
    return Episode(seed, total, length)


def _parallel_episode(policy: Any, env: Any, seed: int, deterministic: bool) -> Episode:
    """A PettingZoo parallel env: each live agent acts with the policy (its own memory)."""
    obs, infos = env.reset(seed=seed)
    returns = {str(a): 0.0 for a in env.possible_agents}
    memory: dict[Any, Any] = {}
    length = 0
    while env.agents:
        actions = {}
        for agent in env.agents:
            actions[agent], memory[agent] = policy.predict(
                obs[agent], memory.get(agent), [agent not in memory], deterministic,
                _mask(policy, infos.get(agent, {})))
        obs, rewards, terminated, truncated, infos = env.step(actions)
        for agent, reward in rewards.items():
            returns[str(agent)] += float(reward)
        length += 1
        if all(terminated.get(a, False) or truncated.get(a, False) for a in actions):
            break
    return Episode(seed, float(sum(returns.values())), length, returns)


def _mask(policy: Any, info: Any) -> Any:
    """The action mask an env gives in `info`, when the policy takes one from there."""
    takes = any(leaf.kind == "mask" for leaf in policy.spec.obs_leaves)
    return info.get("action_mask") if takes and isinstance(info, dict) else None


def play_all(cfg: EvalConfig) -> list[Episode]:
    """The episodes shared out over `cfg.envs` children, in order of their seeds."""
    from stepbus.bus import launch

    shares = np.array_split(np.arange(cfg.episodes), min(cfg.envs, cfg.episodes))
    group = launch.Group()
    try:
        children = [group.start([sys.executable, "-m", "stepbus.evaluate", json.dumps(asdict(
            EvalConfig(**{**asdict(cfg), "first": int(share[0]), "episodes": len(share),
                          "envs": 1})))], name=f"eval-{i}", stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL) for i, share in enumerate(shares)]
        episodes: list[Episode] = []
        for child in children:
            out, _ = child.popen.communicate(timeout=CHILD_TIMEOUT_S)
            if child.popen.returncode != 0:
                raise SettingError(f"an evaluation process exited {child.popen.returncode} "
                                   "(its error is above)")
            episodes += [Episode(**e) for e in json.loads(out.decode().splitlines()[-1])]
        return episodes
    finally:
        group.stop()


def summary(episodes: list[Episode], env_id: str, version: int,
            deterministic: bool) -> dict[str, Any]:
    """What `--json` prints."""
    returns = np.array([e.ret for e in episodes])
    lengths = np.array([e.length for e in episodes])
    out: dict[str, Any] = {
        "env": env_id, "policy_version": version, "deterministic": deterministic,
        "mean_return": float(returns.mean()), "std_return": float(returns.std()),
        "mean_length": float(lengths.mean()), "std_length": float(lengths.std()),
        "episodes": [e.as_json() for e in episodes]}
    if episodes and episodes[0].agents:
        out["agents"] = {a: {"mean_return": float(np.mean([e.agents[a] for e in episodes])),
                             "std_return": float(np.std([e.agents[a] for e in episodes]))}
                         for a in episodes[0].agents}
    return out


def describe(result: dict[str, Any], kwargs: dict[str, Any]) -> str:
    """The summary for a person."""
    how = "greedy" if result["deterministic"] else "sampled"
    env = result["env"] + (f" {json.dumps(kwargs)}" if kwargs else "")
    lines = [f"{env}, policy version {result['policy_version']}, "
             f"{len(result['episodes'])} episodes ({how}): return {result['mean_return']:.2f} "
             f"± {result['std_return']:.2f}, length {result['mean_length']:.1f} ± "
             f"{result['std_length']:.1f}"]
    for agent, figures in result.get("agents", {}).items():
        lines.append(f"  {agent}: return {figures['mean_return']:.2f} ± "
                     f"{figures['std_return']:.2f}")
    return "\n".join(lines)


def child(text: str) -> int:
    """A child of `play_all`: its share of the episodes, as one JSON line on stdout."""
    try:
        episodes = play(EvalConfig(**json.loads(text)))
    except SettingError as exc:
        print(f"stepbus eval: {exc}", file=sys.stderr)
        return 2
    print(json.dumps([{**asdict(e)} for e in episodes]))
    return 0


if __name__ == "__main__":
    from stepbus.early_signals import stacks_on_sigusr2

    stacks_on_sigusr2()  # as every stepbus process
    sys.exit(child(sys.argv[1]))
