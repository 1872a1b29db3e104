"""Recurrent models end to end: the state's layout, replaying trajectories from their first
state, first states across horizon cuts and resends through real processes, masks and agents
with an LSTM, and reproducible runs."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import EVERY_UPDATE, Cluster, TrajectoryInbox, send_message, serial_run, wait_for
from test_memory import START
from test_spaces import learns

from stepbus import policy
from stepbus.bus import protocol as p
from stepbus.bus import rows
from stepbus.bus.memory import Memory
from stepbus.processor.buffers import WorkerTrack
from stepbus.workers.worker import Config, EnvSet

pytest.importorskip("torch")
import torch

from stepbus.models import torch_policy
from stepbus.trainer import ppo, torch_model, torch_recurrent

TASK = "stepbus.workers.tasks:cartpole_no_velocity"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class BatchFirst(torch.nn.Module):
    """A recurrent module whose one state tensor has its batch first and starts at 0.5."""

    def __init__(self, *_: object) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 2)

    def initial_state(self, batch_size: int) -> torch.Tensor:
        return torch.full((batch_size, 3), 0.5)


class NoBatch(BatchFirst):
    def initial_state(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(3)


def test_the_state_layout_is_told_from_initial_state_whatever_the_batch_axis() -> None:
    made = policy.make_policy("torch-lstm", envset(TASK).spec)
    assert isinstance(made, torch_policy.TorchPolicy)
    lstm = torch_policy.StateLayout(made.module)
    assert lstm.nested and lstm.axes == [1, 1], "an LSTM's (layers, B, hidden), twice"
    first = torch_policy.StateLayout(BatchFirst())
    rows = first.rows(BatchFirst().initial_state(4))
    assert not first.nested and rows["0"].shape == (4, 3) and (rows["0"] == 0.5).all()
    assert torch.equal(first.module(rows, torch.device("cpu")), torch.full((4, 3), 0.5))
    with pytest.raises(ValueError, match="one axis must be the batch"):
        torch_policy.StateLayout(NoBatch())


def envset(env: str, k: int = 4) -> EnvSet:
    return EnvSet(Config(env=env, envs_per_worker=k, name="w"), report=lambda e: None,
                  log=logging.getLogger("test"))


def lstm_on(env: str, k: int, config: ppo.PPOConfig, seed: int
            ) -> tuple[EnvSet, torch_model.TorchModel, policy.Policy]:
    """k envs of `env`, a torch-lstm learner's model for them, and a broker's policy acting
    with its first weights."""
    envs = envset(env, k=k)
    model = torch_model.TorchModel(policy.ModelConfig(model="torch-lstm"),
                                 "stepbus.trainer.ppo:PPO",
                                 p.EnvSpec(env_id=env, spec=envs.spec, policy_version=0),
                                 config, seed=seed)
    acting = policy.make_policy("torch-lstm", envs.spec)
    acting.load(model.weights(), 0)
    return envs, model, acting


def rollout(acting: policy.Policy, envs: EnvSet, steps: int, horizon: int
            ) -> list[p.Trajectory]:
    """What the broker and the assembler make of `steps` steps: each row acting from its
    held state, trajectories cut at `horizon` keeping their first step's state."""
    memory = Memory(acting.initial_state)
    obs = envs.reset({})
    result = p.StepResult(incarnation="i", epoch=0, seq=0, first=True, obs=obs,
                          reward=np.zeros(envs.rows, np.float32),
                          terminated=np.zeros(envs.rows, bool),
                          truncated=np.zeros(envs.rows, bool),
                          final_obs=rows.take(obs, slice(0, 0)))
    rng, track, trajs = np.random.default_rng(0), None, []
    for seq in range(steps):
        state = memory.before_step("w", "i", dataclasses.replace(result, seq=seq), envs.rows)
        actions, logp, value, after = acting.act_recurrent(result.obs, state, rng)
        memory.after_step("w", after)
        m = p.Experience(worker="w", incarnation="i", epoch=0, seq=seq, first=result.first,
                         policy_version=0, obs=result.obs, reward=result.reward,
                         terminated=result.terminated, truncated=result.truncated,
                         final_obs=result.final_obs, action=actions, logp=logp, value=value,
                         state=state)
        track = track or WorkerTrack.start(m, horizon)
        trajs += track.complete(m, horizon).trajectories
        track.last_obs, track.seq = m.obs, m.seq
        track.choose(m)
        result = envs.step(actions, {})
    return trajs


def test_replaying_trajectories_from_their_first_states_gives_the_log_probs_acted_with(
        ) -> None:
    """Cut at a horizon of 5 and at episode ends, each trajectory replayed through time from
    the state the assembler kept gives back the behaviour log-probs: the state is the right
    one, in the right layout, at every cut."""
    envs, model, acting = lstm_on(TASK, 4, ppo.PPOConfig(), seed=1)
    trajs = rollout(acting, envs, steps=60, horizon=5)
    assert len({float(t.state["0"].sum()) for t in trajs}) > 10, "states differ by trajectory"
    assert any(t.episode_step > 0 for t in trajs), "some start mid-episode"
    records = [model.record(t) for t in trajs]
    assert not any(model.problem(t) for t in trajs)
    algo = model.torch_algo
    assert isinstance(algo, torch_recurrent.RecurrentPPO)
    seq = torch_recurrent.Sequences.of(records, [r.obs for r in records], algo.replay)
    actions = torch.from_numpy(torch_recurrent.padded([r.actions for r in records],
                                                      seq.length))
    with torch.no_grad():
        _, logp_t, _, _, _ = torch_policy.recurrent_agent(model.module).get_action_and_value(
            seq.obs, seq.state, seq.done, actions)
    logp = logp_t.reshape(seq.length, -1).numpy()
    for j, r in enumerate(records):
        assert np.allclose(logp[:len(r), j], r.logp, atol=1e-5), j


def test_a_recurrent_learner_trains_and_changes_its_weights() -> None:
    envs, model, acting = lstm_on(TASK, 4, ppo.PPOConfig(n_epochs=2, minibatch_size=32), 1)
    before = model.weights()
    stats = model.update([model.record(t) for t in rollout(acting, envs, 40, 8)], lambda: None)
    assert stats["n_samples"] >= 120 and stats["n_grad_steps"] >= 2
    assert np.isfinite(list(stats.values())).all()
    after = model.weights()
    assert any(not np.array_equal(before[k], after[k]) for k in before)


def test_first_states_survive_horizon_cuts_and_resends_through_real_processes(
        cluster: Cluster) -> None:
    """The broker acts with a counting recurrent policy (state 100 at an episode's start, one
    more each step): every trajectory's first state must be 100 plus its first step's index
    in the episode, also for the trajectories the assembler sends again to a new learner."""
    model = {"STEPBUS_MODEL": "test_memory:Counter"}
    for role in ("controller", "assembler"):
        cluster.start(role, *(("--horizon", "7") if role == "assembler" else ()))
    cluster.start("broker", env=model)
    cluster.start("worker", "--name", "w0", "--envs-per-worker", "3")
    trainer = cluster.socket(zmq.DEALER, cluster.endpoints["policy"])
    send_message(trainer, p.Weights(trainer="t", incarnation="t1", policy="default", version=1,
                                    consumed_steps=0, batch_steps=256, starving=False,
                                    params={"w": np.zeros(1)}))
    inbox = TrajectoryInbox(cluster.socket(zmq.PULL, cluster.endpoints["trajectories"]))
    first = [inbox.recv(timeout=30) for _ in range(12)]
    for t in first:
        assert t.state["count"].tolist() == [START + t.episode_step], t.seq
    assert any(t.episode_step > 0 for t in first), "horizon cuts within episodes"
    inbox.close()  # the learner goes away without a receipt: the assembler sends them again
    again = TrajectoryInbox(cluster.socket(zmq.PULL, cluster.endpoints["trajectories"]))
    seen = {t.seq: t.state["count"].tolist() for t in first}
    resent: dict[int, list[float]] = {}

    def all_resent() -> bool:
        while again.poll(100):
            t = again.recv()
            resent[t.seq] = t.state["count"].tolist()
        return set(seen) <= set(resent)

    wait_for(all_resent, 30, "the first trajectories sent again")
    assert {s: resent[s] for s in seen} == seen
    trainer.close()
    again.close()


@pytest.mark.parametrize("env", ("space_envs:masked_pair_obs",))
def test_an_lstm_learns_with_agents_and_masks(tmp_path: Path, env: str) -> None:
    """torch-lstm on a PettingZoo env whose agents' Dict observations carry action masks."""
    learns(tmp_path, env, "torch-lstm", envs_per_worker=8)


def deterministic_digests(runs_dir: Path, seed: int) -> list[str]:
    """A --deterministic run of torch-lstm on the memory task, 4 updates (the serial runner);
    each one's digest."""
    s = str(seed)
    records = serial_run(runs_dir / s, "--model", "torch-lstm", "--seed", s, "--deterministic",
                         "--env", TASK, "--target-return", "0", "--max-updates", "4",
                         *EVERY_UPDATE)
    return [record["digest"] for record in records]


def test_deterministic_runs_of_an_lstm_are_identical_also_when_an_update_is_slow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin's second update takes 1.5 s more (a loaded machine): every other role waits
    through it on the serial runner's thread, and what is stepped and learned must not change."""
    first = deterministic_digests(tmp_path / "first", 5)
    update = torch_recurrent.RecurrentPPO.update
    updates = iter(range(100))

    def slow_second(self: torch_recurrent.RecurrentPPO, *args: Any, **kwargs: Any) -> Any:
        if next(updates) == 1:
            time.sleep(1.5)
        return update(self, *args, **kwargs)

    monkeypatch.setattr(torch_recurrent.RecurrentPPO, "update", slow_second)
    second = deterministic_digests(tmp_path / "second", 5)
    monkeypatch.undo()
    other = deterministic_digests(tmp_path / "other", 6)
    assert next(updates) > 2, "the slow update ran"
    assert len(first) == 4 and first == second
    assert all(a != b for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize("env", ("space_envs:masked_info", "space_envs:masked_obs"))
def test_a_recurrent_update_on_fresh_masked_trajectories_starts_at_ratio_one(env: str) -> None:
    """Trajectories of 5 and 3 steps (a horizon of 5 in episodes of 8), padded, time-major,
    masked (two actions of six allowed): with a learning rate of 0, every minibatch sees
    the behaviour log-probs again, so padding, layout and masks line up with the steps."""
    envs, model, acting = lstm_on(env, 3, ppo.PPOConfig(n_epochs=2, minibatch_size=16, lr=0.0),
                                  seed=2)
    trajs = rollout(acting, envs, steps=24, horizon=5)
    assert sorted({len(t.rewards) for t in trajs}) == [3, 5] and envs.errors == 0
    assert not any(model.problem(t) for t in trajs)
    stats = model.update([model.record(t) for t in trajs], lambda: None)
    assert stats["n_grad_steps"] >= 4
    assert abs(stats["approx_kl"]) < 1e-6 and stats["clip_fraction"] == 0.0


def test_gae_values_replayed_through_time_are_the_ones_acted_with() -> None:
    """The critic's values of every step, replayed from each trajectory's first state, are
    the broker's; a horizon cut's bootstrap value is the next trajectory's first one (the
    replay goes one step further, through the bootstrap observation, from the right state)."""
    import itertools

    env = "space_envs:masked_obs"
    envs, model, acting = lstm_on(env, 3, ppo.PPOConfig(), seed=2)
    trajs = rollout(acting, envs, steps=24, horizon=5)
    algo = model.torch_algo
    assert isinstance(algo, torch_recurrent.RecurrentPPO)
    values = algo.values([model.record(t) for t in trajs])
    n = sum(len(t.rewards) for t in trajs)
    assert np.allclose(values[:n], np.concatenate([t.values for t in trajs]), atol=1e-5)
    by_agent: dict[str, list[int]] = {}
    for i, t in enumerate(trajs):
        by_agent.setdefault(t.agent, []).append(i)
    cuts = [(i, j) for seq in by_agent.values() for i, j in itertools.pairwise(seq)
            if not (trajs[i].terminated or trajs[i].truncated)]  # j goes on from i
    assert len(cuts) >= 3
    for i, j in cuts:
        assert values[n + i] == pytest.approx(trajs[j].values[0], abs=1e-5)


def test_a_trajectory_without_a_next_observation_bootstraps_from_its_last_replayed_step(
        ) -> None:
    """A vanished agent's trajectory carries its last step's observation as `bootstrap_obs`:
    its bootstrap value is the replay's value at that last step (the broker's, as acted), not
    that of the memory fed the observation a second time. The other trajectories keep
    bootstrapping one step further, in the same groups."""
    envs, model, acting = lstm_on(TASK, 3, ppo.PPOConfig(), seed=3)
    trajs = rollout(acting, envs, steps=24, horizon=5)
    vanished = [dataclasses.replace(t, terminated=False, truncated=True,
                                    bootstrap_obs=rows.take(t.obs, len(t.rewards) - 1),
                                    bootstrap_from_last=True) if i % 2 else t
                for i, t in enumerate(trajs)]
    assert not any(model.problem(t) for t in vanished)
    algo = model.torch_algo
    assert isinstance(algo, torch_recurrent.RecurrentPPO)
    values = algo.values([model.record(t) for t in vanished])
    fed_twice = algo.values([model.record(dataclasses.replace(t, bootstrap_from_last=False))
                             for t in vanished])
    before = algo.values([model.record(t) for t in trajs])
    n = sum(len(t.rewards) for t in trajs)
    assert np.array_equal(values[:n], before[:n]), "the steps' values are the same replay"
    for i, t in enumerate(vanished):
        if t.bootstrap_from_last:
            assert values[n + i] == pytest.approx(t.values[-1], abs=1e-5), i
            assert values[n + i] == values[:n][sum(len(u.rewards) for u in trajs[:i + 1]) - 1]
            assert abs(fed_twice[n + i] - values[n + i]) > 1e-4, "feeding it twice differs"
        else:
            assert values[n + i] == pytest.approx(before[n + i], abs=1e-6), i
