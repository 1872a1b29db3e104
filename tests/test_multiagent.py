"""Multi-agent environments: PettingZoo parallel envs in workers, one row per agent, agents that
appear, finish and vanish, and learning on a real PettingZoo task."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from conftest import Cluster, act_as_trainer, serial_run

from stepbus.bus import protocol as p
from stepbus.workers.worker import Config, EnvSet


def test_a_parallel_env_steps_one_row_per_agent_with_alive_and_done_per_agent():
    envs = EnvSet(Config(env="scripted_envs:relay_team", envs_per_worker=2, name="w"),
                  report=lambda error: None, log=logging.getLogger("test"))
    assert envs.agents == ["a", "b", "c", "d"] and envs.rows == 8
    envs.reset({})
    assert envs.alive.tolist() == [True, True, False, True] * 2, "c has not appeared yet"
    acts = np.zeros(8, np.int64)

    r1 = envs.step(acts, {})  # c appears
    assert r1.alive is not None and isinstance(r1.obs, np.ndarray)
    assert r1.alive.tolist() == [True] * 8
    assert r1.reward.tolist() == [1, 1, 0, 1] * 2, "only agents that acted are rewarded"
    assert r1.obs[2].tolist() == [2, 1], "c's first observation"

    r2 = envs.step(acts, {})  # b terminates, the others go on
    assert r2.alive is not None and isinstance(r2.final_obs, np.ndarray)
    assert r2.terminated.tolist() == [False, True, False, False] * 2
    assert r2.alive.tolist() == [True, False, True, True] * 2
    assert r2.final_obs.tolist() == [[1, 2], [1, 2]], "one final row per ended agent, in order"

    r3 = envs.step(acts, {})  # d vanishes (leaves without a done flag): cut as truncated
    assert r3.alive is not None and isinstance(r3.final_obs, np.ndarray)
    assert r3.alive.tolist() == [True, False, True, False] * 2
    assert r3.truncated.tolist() == [False, False, False, True] * 2
    assert not r3.terminated.any()
    assert r3.final_obs.tolist() == [[3, 3], [3, 3]], "the observation the env gave it last"
    assert envs.agents_vanished == 2

    envs.step(acts, {})
    r5 = envs.step(acts, {})  # a and c reach the time limit: the env resets in the same step
    assert r5.alive is not None
    assert isinstance(r5.obs, np.ndarray) and isinstance(r5.final_obs, np.ndarray)
    assert r5.truncated.tolist() == [True, False, True, False] * 2
    assert r5.final_obs.tolist() == [[0, 5], [2, 5]] * 2
    assert r5.alive.tolist() == [True, True, False, True] * 2, "the next episode's agents"
    assert r5.obs[0].tolist() == [0, 0]


@pytest.fixture
def relay(cluster: Cluster):
    """Controller, broker, assembler and one worker on RelayTeam; the test is the trainer (it
    publishes weights) and the trajectory consumer."""
    for role in ("controller", "broker", "assembler"):
        cluster.start(role)
    cluster.start("worker", "--env", "scripted_envs:relay_team", "--envs-per-worker", "1",
                  "--name", "w")
    trainer, pull = act_as_trainer(cluster, obs_dim=2)
    yield pull
    trainer.close()
    pull.close()


def test_agents_that_appear_finish_and_vanish_get_their_own_trajectories(relay):
    first: dict[str, p.Trajectory] = {}
    while len(first) < 4:
        traj = relay.recv(timeout=30)
        assert isinstance(traj, p.Trajectory)
        first.setdefault(traj.agent, traj)
    a, b, c, d = (first[f"w/0/{name}"] for name in "abcd")
    assert isinstance(a.bootstrap_obs, np.ndarray) and isinstance(c.obs, np.ndarray)
    assert isinstance(d.bootstrap_obs, np.ndarray)
    # a: the whole episode, cut by the time limit; its return is the episode's.
    assert (len(a.rewards), a.truncated, a.terminated, a.episode_return) == (5, True, False, 5)
    assert a.bootstrap_obs.tolist() == [0, 5]
    # b: finished while the others went on.
    assert (len(b.rewards), b.terminated, b.episode_return) == (2, True, 2)
    # c: appeared after step 1, so its trajectory starts at t = 1.
    assert c.obs[:, 1].tolist() == [1, 2, 3, 4] and c.truncated
    # d: vanished after step 3: its episode cut as truncated, bootstrapped from the last
    # observation the env gave it.
    assert (len(d.rewards), d.truncated, d.terminated, d.episode_return) == (3, True, False, 3)
    assert d.bootstrap_obs.tolist() == [3, 3]


def random_return(episodes: int = 100) -> float:
    """Mean per-agent episode return of uniformly random actions on simple_spread."""
    spread = pytest.importorskip("mpe2.simple_spread_v3")
    env = spread.parallel_env()
    returns: list[float] = []
    for episode in range(episodes):
        env.reset(seed=episode)
        total = dict.fromkeys(env.agents, 0.0)
        while env.agents:
            _, rewards, *_ = env.step({a: env.action_space(a).sample() for a in env.agents})
            for agent, reward in rewards.items():
                total[agent] += reward
        returns += total.values()
    return float(np.mean(returns))


def test_ppo_with_parameter_sharing_learns_mpe_simple_spread(tmp_path: Path):
    """On the serial runner (every role on one thread in this process): what is learned is the
    claim, so the learner ends the run itself at the target, and an env's or the model's
    exception fails the test with its own traceback. --max-env-steps bounds a run that does
    not learn, where a wait of 90 s did: about seven times the steps it takes."""
    baseline = random_return()
    # 3 agents x 4 envs = 12 rows per step, one shared policy; random play scores about -26.
    target = baseline + 4.0
    records = serial_run(tmp_path, "--env", "mpe2.simple_spread_v3:parallel_env",
                         "--envs-per-worker", "4", f"--target-return={target}",
                         "--target-episodes", "100", "--max-env-steps", "300000")
    reached = next((r for r in records[::-1]
                    if r["episodes"] >= 300 and r["mean_return"] >= target), None)
    assert reached is not None, (f"a 100-episode mean return of {target:.1f}", records[-1])
    print(f"random {baseline:.1f}; reached {reached['mean_return']:.1f} after "
          f"{reached['env_steps']} agent steps, {reached['wall_s']} s")


def envset(env: str) -> EnvSet:
    return EnvSet(Config(env=env, envs_per_worker=1, name="w"), report=lambda error: None,
                  log=logging.getLogger("test"))


def test_an_agent_that_vanishes_as_the_episode_ends_is_cut_not_carried_into_the_next():
    envs = envset("scripted_envs:vanish_at_end")
    envs.reset({})
    envs.step(np.zeros(2, np.int64), {})
    envs.step(np.zeros(2, np.int64), {})
    last = envs.step(np.zeros(2, np.int64), {})
    assert isinstance(last.obs, np.ndarray) and isinstance(last.final_obs, np.ndarray)
    assert last.alive is not None and last.episode is not None
    assert last.truncated.tolist() == [True, True], "b's episode ends too, as truncated"
    assert last.final_obs.tolist() == [[0, 3], [1, 3]]
    assert last.alive.tolist() == [True, True] and last.obs[:, 1].tolist() == [0, 0]
    assert last.episode.tolist() == [1, 1], "the next episode"


def test_an_env_that_keeps_done_agents_listed_is_reset_anyway():
    envs = envset("scripted_envs:keeps_done_agents")
    envs.reset({})
    for _ in range(3):
        result = envs.step(np.zeros(2, np.int64), {})
    assert isinstance(result.obs, np.ndarray) and result.episode is not None
    assert result.truncated.all() and result.obs[:, 1].tolist() == [0, 0]
    assert result.episode.tolist() == [1, 1]


def test_agents_keyed_by_integers_work():
    envs = envset("scripted_envs:int_keys")
    assert envs.agents == ["0", "1"]
    envs.reset({})
    alive = envs.step(np.zeros(2, np.int64), {}).alive
    assert alive is not None and alive.tolist() == [True, True]


def test_rows_that_end_without_an_observation_after_their_last_action_are_marked():
    """An agent that leaves without an observation, and every agent of an env that raises,
    end truncated with the observation they acted on as final: the step result says which,
    so their trajectories bootstrap from the last step. Ends with an observation are not
    marked."""
    def envset(env: str) -> EnvSet:
        return EnvSet(Config(env=env, envs_per_worker=1, name="w"),
                      report=lambda error: None, log=logging.getLogger("test"))

    leaver = envset("scripted_envs:leaves_unobserved")
    leaver.reset({})
    acts = np.zeros(2, np.int64)
    left = leaver.step(acts, {})  # b leaves, unobserved
    assert left.truncated.tolist() == [False, True] and left.alive is not None
    assert left.no_final_obs is not None and left.no_final_obs.tolist() == [False, True]
    assert isinstance(left.final_obs, np.ndarray) and left.final_obs.tolist() == [[1, 0]]
    crashed = leaver.step(acts, {})  # the env raises: a's episode is cut
    assert crashed.truncated.tolist() == [True, False]
    assert crashed.no_final_obs is not None and crashed.no_final_obs.tolist() == [True, False]
    assert leaver.errors == 1
    again = leaver.step(acts, {})  # the recreated env's b leaves as before; a goes on
    assert again.no_final_obs is not None and again.no_final_obs.tolist() == [False, True]

    relay = envset("scripted_envs:relay_team")
    relay.reset({})
    ends = [relay.step(np.zeros(4, np.int64), {}) for _ in range(5)]
    assert sum(int((r.terminated | r.truncated).sum()) for r in ends) == 4
    assert all(r.no_final_obs is None for r in ends), "each ended with an observation"

    single = envset("scripted_envs:hundredth_step_raises")
    single.reset({})
    results = [single.step(np.zeros(1, np.int64), {}) for _ in range(100)]
    marked = [i for i, r in enumerate(results) if r.no_final_obs is not None]
    assert marked == [99] and results[99].truncated.tolist() == [True]
    assert sum(bool(r.terminated[0]) for r in results) >= 5, "terminal ends are not marked"
