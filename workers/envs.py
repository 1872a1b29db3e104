"""Making environments from a user's string, describing their spaces, and deriving seeds.

An environment is a Gymnasium env (one agent, one row) or a PettingZoo `ParallelEnv` (one row
per possible agent). PettingZoo is not imported: a parallel env is recognised by its
`possible_agents`, so the base install stays light.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym

from stepbus import imports, spaces
from stepbus.bus import protocol as p
from stepbus.bus import wiring


def make_env(env: str, kwargs: Mapping[str, Any] | None = None) -> Any:
    """A Gymnasium id (`CartPole-v1`, `module:Env-v0`) or a `module:factory` callable returning
    a Gymnasium env or a PettingZoo ParallelEnv; `kwargs` go to `gym.make` or the callable."""
    _, colon, attr = env.partition(":")
    if colon and all(part.isidentifier() for part in attr.split(".")):
        made = imports.load_object(env)(**(kwargs or {}))
        if not hasattr(made, "step") or not hasattr(made, "reset"):
            raise TypeError(f"{env} returned {type(made).__name__}, not an environment")
        return made
    return gym.make(env, **(kwargs or {}))


def env_field() -> Any:
    """The `--env` setting, one for every process that makes envs (workers, the evaluator), so
    STEPBUS_ENV or one line of stepbus.toml sets them all alike."""
    return wiring.from_env(
        "STEPBUS_ENV", "CartPole-v1", "Gymnasium id, or module:callable returning a Gymnasium "
        "env or a PettingZoo ParallelEnv (e.g. mpe2.simple_spread_v3:parallel_env)")


def env_kwargs_field() -> Any:
    """The `--env-kwargs` setting, shared as `env_field` is."""
    return wiring.from_env(
        "STEPBUS_ENV_KWARGS", "", "keyword arguments for gym.make or the --env callable, as a "
        """JSON object, e.g. '{"max_episode_steps": 200}' or '{"frameskip": 1}'""",
        check=env_kwargs)


def env_kwargs(text: str) -> dict[str, Any]:
    """`--env-kwargs`: a JSON object ("" for none); ValueError saying what is wrong."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at character {exc.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON object of keyword arguments is needed, e.g. "
                         f'\'{{"max_episode_steps": 200}}\', not {text!r}')
    return value


def agents_of(env: Any) -> list[str]:
    """A parallel env's possible agents (its rows); [] for a single-agent env."""
    if not hasattr(env, "possible_agents"):
        return []
    agents = [str(a) for a in env.possible_agents]
    if not agents or len(set(agents)) != len(agents):
        raise TypeError(f"possible_agents must be distinct and non-empty, got {agents}")
    return agents


def seed_spaces(env: Any, seed: int) -> None:
    """Spaces sample with their own generators (an env may use them): seeded per episode too,
    so an episode replays from its seed alone."""
    keys = list(env.possible_agents) if agents_of(env) else [None]
    for key in keys:
        for space in ((env.action_space, env.observation_space) if key is None
                      else (env.action_space(key), env.observation_space(key))):
            space.seed(seed)


def reward_threshold(env: Any) -> float | None:
    """The return the env's registration calls solved (`spec.reward_threshold`: CartPole-v1
    475, Acrobot-v1 -100); None for an env without one, or without a spec (an env a callable
    built itself, a PettingZoo env), or whose episodes were cut shorter than those the
    threshold was set for (`goal_note` says why)."""
    threshold = getattr(getattr(env, "spec", None), "reward_threshold", None)
    if isinstance(threshold, (int, float)) and not isinstance(threshold, bool) \
            and math.isfinite(threshold) and not goal_note(env):
        return float(threshold)
    return None


def goal_note(env: Any) -> str:
    """Why the env's reward_threshold is not a goal it can reach ("" when it may be): its
    episodes end sooner than those of its registration (`gym.make(id, max_episode_steps=200)`
    leaves CartPole-v1's 475, set for 500 steps, out of reach)."""
    spec = getattr(env, "spec", None)
    threshold = getattr(spec, "reward_threshold", None)
    steps = getattr(spec, "max_episode_steps", None)
    if spec is None or threshold is None or not steps:
        return ""
    try:
        registered = gym.spec(spec.id).max_episode_steps
    except gym.error.Error:  # made by a callable, registered under no id
        return ""
    if not registered or steps >= registered:
        return ""
    return (f"{spec.id}'s reward_threshold {threshold:g} is for episodes of up to {registered} "
            f"steps, and these end at {steps} (max_episode_steps), so it is no goal")


def space_spec(env: Any, probe: Callable[[], Any] | None = None) -> p.SpaceSpec:
    """The env's spaces and goal, as its worker declares them. For categorical actions, an env
    is reset once to see whether its `info` carries an action mask (Gymnasium's convention):
    one that `probe` makes for the purpose and closes after (a worker's own envs then see only
    the resets they always did), else `env` itself.

    Raises:
        TypeError: spaces stepbus cannot carry (`spaces.SpaceError`), or agents that differ.
    """
    agents = list(env.possible_agents) if agents_of(env) else []  # the env's own keys
    if agents:  # parameter sharing: one policy for every agent, so one set of spaces
        obs, act = env.observation_space(agents[0]), env.action_space(agents[0])
        for agent in agents[1:]:
            if env.observation_space(agent) != obs or env.action_space(agent) != act:
                raise TypeError(f"agent {agent} has other spaces than {agents[0]}; agents "
                                "sharing a policy need the same spaces (pad or wrap them)")
    else:
        obs, act = env.observation_space, env.action_space
    info_mask = False
    if not isinstance(act, gym.spaces.Box):
        looked_at = probe() if probe is not None else env
        try:
            _, info = looked_at.reset(seed=0)
        finally:
            if looked_at is not env:
                looked_at.close()
        infos = list(info.values()) if agents else [info]
        info_mask = any(isinstance(i, dict) and spaces.MASK in i for i in infos)
    return spaces.describe(obs, act, info_mask=info_mask, reward_threshold=reward_threshold(env),
                           goal_note=goal_note(env))


def episode_seed(seed: int, worker_index: int, env_index: int, episode: int) -> int:
    """The seed episode `episode` of env i of worker w is reset with: any episode can be
    replayed alone (`stepbus.workers.replay`), whatever came before it. A hash of the four
    numbers (32 bits, as SeedSequence would give): an env resets every few dozen steps, and a
    SeedSequence cost 14 us of each reset."""
    key = f"{seed},{worker_index},{env_index},{episode}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
