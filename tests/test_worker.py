"""Environment construction and seeding, as a worker does them."""

from __future__ import annotations

import logging
import time

import gymnasium as gym
import numpy as np
import pytest

from stepbus import cli, clidoc
from stepbus.bus import protocol as p
from stepbus.trainer import learner
from stepbus.workers.envs import episode_seed, make_env, space_spec
from stepbus.workers.worker import Config, EnvFailure, EnvSet


def test_episode_seeds_derive_from_seed_worker_env_and_episode_and_are_reproducible():
    keys = [(w, i, e) for w in range(3) for i in range(4) for e in range(5)]
    seeds = {key: episode_seed(7, *key) for key in keys}
    assert len(set(seeds.values())) == len(seeds), "every (worker, env, episode) its own seed"
    assert seeds == {key: episode_seed(7, *key) for key in keys}
    assert episode_seed(8, 0, 0, 0) != episode_seed(7, 0, 0, 0)


def test_workers_with_the_same_seed_and_index_see_the_same_first_observations():
    log = logging.getLogger("test")
    errors: list = []
    first = EnvSet(Config(seed=3, worker_index=1, envs_per_worker=4), errors.append,
                   log).reset({})
    again = EnvSet(Config(seed=3, worker_index=1, envs_per_worker=4), errors.append,
                   log).reset({})
    other = EnvSet(Config(seed=3, worker_index=2, envs_per_worker=4), errors.append,
                   log).reset({})
    assert errors == []
    assert isinstance(first, np.ndarray) and isinstance(again, np.ndarray)
    assert isinstance(other, np.ndarray)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)
    assert len({row.tobytes() for row in first}) == 4, "envs of one worker differ"


def test_make_env_takes_gymnasium_ids_and_factories():
    assert make_env("CartPole-v1").spec.id == "CartPole-v1"
    assert isinstance(make_env("scripted_envs:recording_cartpole"), gym.Wrapper)
    with pytest.raises(TypeError, match="not an environment"):
        make_env("math:pi.__class__")


def test_stepbus_env_is_every_workers_env_unless_a_flag_says_otherwise(
        monkeypatch: pytest.MonkeyPatch):
    assert Config().env == "CartPole-v1"
    monkeypatch.setenv("STEPBUS_ENV", "Acrobot-v1")  # what honcho's .env does
    assert Config().env == "Acrobot-v1"
    parser = cli.build_parser()
    assert parser.parse_args(["worker"]).env == "Acrobot-v1"
    assert parser.parse_args(["worker", "--env", "Pendulum-v1"]).env == "Pendulum-v1"
    worker = clidoc.subcommands(parser)["worker"]
    help_text = next(a.help for a in worker._actions if "--env" in a.option_strings)
    assert help_text is not None
    assert "(env STEPBUS_ENV)" in help_text and "[default: Acrobot-v1]" in help_text


def test_spaces_are_described_for_the_learner():
    spec = space_spec(make_env("Pendulum-v1"))
    assert spec.action_kind == "box" and spec.action_shape == [1]
    assert spec.action_low == [-2.0] and spec.action_high == [2.0]
    assert spec.reward_threshold is None, "Pendulum-v1 registers no threshold"
    spec = space_spec(make_env("CartPole-v1"))
    assert (spec.action_kind, spec.action_n, spec.obs_shape) == ("discrete", 2, [4])
    assert spec.reward_threshold == 475.0, "the learner's default target return"
    assert space_spec(make_env("Acrobot-v1")).reward_threshold == -100.0
    assert space_spec(make_env("scripted_envs:stamp_frames")).reward_threshold is None, (
        "an env a callable made without a spec has none")


def test_env_kwargs_reach_gym_make_and_a_threshold_the_episodes_cannot_reach_is_no_goal():
    """`--env-kwargs '{"max_episode_steps": 200}'`: CartPole's episodes end at 200 steps, so
    its registered 475 is no goal; the learner says why and sets none (else the run could
    never end, silently). Longer episodes keep it."""
    envs = EnvSet(Config(env_kwargs='{"max_episode_steps": 200}', envs_per_worker=2),
                  lambda error: None, logging.getLogger("test"))
    assert envs.envs[0].spec.max_episode_steps == 200
    spec = space_spec(envs.envs[0])
    assert spec.reward_threshold is None
    assert "475 is for episodes of up to 500 steps, and these end at 200" in spec.goal_note
    longer = space_spec(make_env("CartPole-v1", {"max_episode_steps": 800}))
    assert longer.reward_threshold == 475.0 and not longer.goal_note
    env = p.EnvSpec(env_id="CartPole-v1", spec=spec, policy_version=0)
    target, line = learner.goal(learner.Config(max_env_steps=1000), env)
    assert target is None and "these end at 200" in line and "--max-env-steps 1000" in line


@pytest.mark.parametrize("text, says", [("[1]", "a JSON object of keyword arguments"),
                                        ('{"a": 1', "not JSON"), ("nan", "not JSON")])
def test_bad_env_kwargs_are_refused_naming_the_flag(text: str, says: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["worker", "--env-kwargs", text])
    assert exit_info.value.code == 2
    assert f"argument --env-kwargs: {says}" in capsys.readouterr().err


class Probe(gym.Wrapper):
    """Records whether the EnvSet says env code is running at each call into the env."""

    def __init__(self, env: gym.Env, envs: EnvSet, seen: list[bool], raise_at: int) -> None:
        super().__init__(env)
        self.envs, self.seen, self.raise_at, self.steps = envs, seen, raise_at, 0

    def reset(self, **kwargs):
        self.seen.append(self.envs.in_env)
        return self.env.reset(**kwargs)

    def step(self, action):
        self.seen.append(self.envs.in_env)
        self.steps += 1
        if self.steps == self.raise_at:
            raise RuntimeError("probe")
        return self.env.step(action)


def test_in_env_is_set_exactly_while_env_code_runs_never_while_errors_are_reported():
    """The heartbeat thread sends only while `in_env` is set (the gate open); reporting an
    error sends on the same sockets, so it must happen with the flag down."""
    at_report: list[bool] = []
    envs = EnvSet(Config(envs_per_worker=2), lambda e: at_report.append(envs.in_env),
                  logging.getLogger("test"))
    seen: list[bool] = []
    envs.envs = [Probe(env, envs, seen, raise_at=3 + i) for i, env in enumerate(envs.envs)]
    envs.reset({})
    for _ in range(5):
        envs.step(np.zeros(2, np.int64), {})
        assert not envs.in_env
    assert len(seen) >= 2 + 3 + 4 and all(seen), "every env call ran with the flag up"
    assert at_report == [False, False], "both errors were reported with it down"


def test_more_env_restarts_within_a_minute_than_the_bound_raise_one_clear_failure():
    reports: list = []
    envs = EnvSet(Config(env="scripted_envs:broken_cartpole", envs_per_worker=1,
                         max_env_restarts_per_minute=3), reports.append, logging.getLogger("t"))
    envs.reset({})
    with pytest.raises(EnvFailure) as failure:
        for _ in range(100):
            envs.step(np.zeros(1, np.int64), {})
    assert len(reports) == 4, "each error is reported, the one past the bound too"
    message = str(failure.value)
    assert "scripted_envs:broken_cartpole keeps raising: 4 env restarts within 60 s" in message
    assert "--max-env-restarts-per-minute 3" in message and "fix the environment" in message


def test_restarts_older_than_a_minute_and_rejected_reset_options_do_not_count():
    log = logging.getLogger("t")
    envs = EnvSet(Config(env="scripted_envs:broken_cartpole", envs_per_worker=1,
                         max_env_restarts_per_minute=2), lambda error: None, log)
    envs.reset({})
    envs.restarts.extend([time.monotonic() - 61] * 5)  # an error storm more than a minute ago
    for _ in range(6):  # two errors, each 3 steps apart: within the bound
        envs.step(np.zeros(1, np.int64), {})
    assert envs.errors == 2 and len(envs.restarts) == 2
    picky = EnvSet(Config(env="scripted_envs:picky_cartpole", envs_per_worker=3,
                          max_env_restarts_per_minute=0), lambda error: None, log)
    picky.reset({"level": 9})  # every env rejects the options: reported, not a failure
    assert picky.errors == 3 and picky.without_options == {0, 1, 2}


def test_an_env_that_rejected_the_barrier_options_is_recreated_without_them():
    envs = EnvSet(Config(env="scripted_envs:picky_and_flaky", envs_per_worker=1, name="w"),
                  report=lambda error: None, log=logging.getLogger("test"))
    envs.reset({"level": 5})  # rejected: recreated and reset without the options
    for _ in range(3):  # the env raises once: recreated again, still without them
        envs.step(np.zeros(1, np.int64), {"level": 5})
    assert envs.errors == 2
