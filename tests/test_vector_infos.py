"""Env infos travel through stepbus.vector as SyncVectorEnv lays them out: per key an array
over the envs and a `_key` mask, nested dicts nested, numpy scalars with their dtype, and in
SAME_STEP `final_obs`/`final_info`; Gymnasium's vector RecordEpisodeStatistics on top, and
per-env RecordEpisodeStatistics inside the workers, give SyncVectorEnv's episode statistics.
A key that cannot travel is named once in the worker's log; the others still arrive."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import vector_envs
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorWrapper
from gymnasium.wrappers.vector import RecordEpisodeStatistics
from test_vector_env import count_script, play, same
from vector_envs import Made

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Made]:
    yield from vector_envs.closing_make(monkeypatch)


def timeless(value: Any) -> Any:
    """`value` without episode times ("t" and "_t"), which no two runs share."""
    if isinstance(value, dict):
        return {k: timeless(v) for k, v in value.items() if k not in ("t", "_t")}
    if isinstance(value, (tuple, list)):
        return type(value)(timeless(v) for v in value)
    if isinstance(value, np.ndarray) and value.dtype == object:
        out = np.empty_like(value)
        out[:] = [timeless(v) for v in value]
        return out
    return value


class Snapshot(VectorWrapper):
    """Each result copied as it is returned: the wrapper below changes its `_episode` array
    in place on a later partial reset."""

    def step(self, actions: Any) -> Any:
        return copy.deepcopy(self.env.step(actions))

    def reset(self, **kwargs: Any) -> Any:
        return copy.deepcopy(self.env.reset(**kwargs))


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_infos_of_every_kind_arrive_as_sync_vector_env_lays_them_out(
        make: Made, mode: AutoresetMode) -> None:
    ours = make("vector_envs:chatty", 3, workers=2, autoreset_mode=mode)
    theirs = SyncVectorEnv([vector_envs.chatty] * 3, autoreset_mode=mode)
    got, expected = play(ours, count_script()), play(theirs, count_script())
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert same(a, b), f"call {i}: {a[-1]} != {b[-1]}"
    step = got[1][-1]
    assert step["f32"].dtype == np.float32 and step["grid"].shape == (3, 2, 3)
    assert step["nested"]["deeper"]["b"].dtype == np.float64 and step["name"][0] == "step 1"
    # Gymnasium's vector RecordEpisodeStatistics on top. Every env ends on the same steps
    # here: SyncVectorEnv takes reset_mask out of the caller's options, so the wrapper
    # forgets every env's episode on a partial reset (stepbus's env leaves options alone).
    ours_stats, theirs_stats = (Snapshot(RecordEpisodeStatistics(e)) for e in (ours, theirs))
    script: list[tuple[str, Any]] = [("reset", {}), *[("step", [1, 2, 3])] * 7]
    got, expected = play(ours_stats, script), play(theirs_stats, script)
    episodes = 0
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert same(timeless(a), timeless(b)), f"call {i}: {a[-1]} != {b[-1]}"
        episodes += int(b[-1].get("_episode", np.zeros(1)).sum())
    assert episodes >= 6, "RecordEpisodeStatistics saw episodes end"


@pytest.mark.parametrize("mode", MODES[:2], ids=[m.value for m in MODES[:2]])
def test_record_episode_statistics_in_the_workers_gives_each_episode(
        make: Made, mode: AutoresetMode) -> None:
    ours = make("CartPole-v1", 4, workers=2, autoreset_mode=mode, episode_statistics=True)
    theirs = SyncVectorEnv([lambda: gym.wrappers.RecordEpisodeStatistics(
        gym.make("CartPole-v1"))] * 4, autoreset_mode=mode)
    rng = np.random.default_rng(7)
    script = [("reset", {"seed": 3}), *[("step", rng.integers(0, 2, 4)) for _ in range(80)]]
    got, expected = play(ours, script), play(theirs, script)
    ended = 0
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert same(timeless(a), timeless(b)), f"call {i}: {a[-1]} != {b[-1]}"
        ended += int(np.sum(b[2] | b[3])) if len(b) == 5 else 0
    assert ended >= 4
    where = "final_info" if mode is AutoresetMode.SAME_STEP else None
    last = next(r[-1] for r in reversed(got) if len(r) == 5 and (r[2] | r[3]).any())
    episode = (last[where] if where else last)["episode"]
    assert episode["l"].dtype == np.int64 and (episode["t"][episode["_l"]] >= 0).all()


def test_a_key_that_cannot_travel_is_named_once_and_the_rest_arrive(make: Made) -> None:
    envs = make("vector_envs:chatty_unsendable", 2)
    envs.reset(seed=0)
    for _ in range(4):
        *_, info = envs.step([1, 1])
        assert "handle" not in info and "count" in info
    assert envs.launched is not None
    logs = envs.launched.logs()
    assert logs.count("info key 'handle' cannot travel") == 1, logs[-3000:]


def test_recv_lays_out_the_infos_of_the_envs_it_returns(make: Made) -> None:
    envs = make("vector_envs:chatty", 4, workers=2, batch_size=2)
    _, info = envs.reset(seed=[1, 2, 3, 4])
    assert list(info["start"]) == [1, 2, 3, 4] and info["seeded"].all()
    envs.send(np.ones(4, np.int64))
    for _ in range(2):
        _, _, _, _, info = envs.recv()
        ids = info["env_id"]
        assert info["count"].shape == (2,) and list(info["count"]) == list(ids + 2)


def test_without_infos_the_workers_send_none(make: Made) -> None:
    envs = make("vector_envs:chatty", 2, infos=False, autoreset_mode=AutoresetMode.SAME_STEP)
    assert envs.reset(seed=0)[1] == {}
    *_, info = envs.step([1, 1])
    assert info == {} and envs.last_infos.rows == [None, None]
    *_, info = envs.step([1, 1])  # seed 0: the count reaches 3, both end
    assert set(info) == {"final_obs", "_final_obs", "final_info", "_final_info"}
    assert info["final_info"] == {}
