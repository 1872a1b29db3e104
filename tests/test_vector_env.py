"""stepbus.vector.make is a Gymnasium vector env: for the same seeds and actions it gives what
SyncVectorEnv gives (observations, rewards, terminations, truncations, infos) in all three
autoreset modes, partial resets included; EnvPool's send/recv; call/get_attr/set_attr.

Written after the assertions of Gymnasium's tests/vector/test_autoreset_mode.py and
test_vector_env.py, against real worker and controller processes (the relay in the test's
own process, as make() runs it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import vector_envs
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from vector_envs import Count, Made

import stepbus.vector as sv
from stepbus.bus import forkserver, shm
from stepbus.vector import launch

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Made]:
    yield from vector_envs.closing_make(monkeypatch)


def same(a: Any, b: Any) -> bool:
    """Equal data, as Gymnasium's data_equivalence, with an episode's final observation of a
    Discrete space equal whether the env gave an int or a 0-d array."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(same(a[k], b[k]) for k in a))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if a is None or b is None:
        return a is b
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == object or b.dtype == object:
        return a.shape == b.shape and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


def play(envs: VectorEnv, script: list[tuple[str, Any]]) -> list[Any]:
    """Run a script of ("reset", kwargs), ("step", actions), ("partial", seed) calls; what each
    returned. "partial" resets (with `seed`) the envs the last step ended, or env 0; with
    autoreset DISABLED every step that ends episodes is followed by the reset of those envs."""
    out: list[Any] = []
    ended = np.zeros(envs.num_envs, bool)
    for what, arg in script:
        if what == "reset":
            out.append(envs.reset(**arg))
        elif what == "partial":
            mask = ended.copy() if ended.any() else np.eye(envs.num_envs, dtype=bool)[0]
            out.append(envs.reset(seed=arg, options={"reset_mask": mask}))
        else:
            result = envs.step(arg)
            ended = result[2] | result[3]
            out.append(result)
            if envs.metadata["autoreset_mode"] is AutoresetMode.DISABLED and ended.any():
                out.append(envs.reset(options={"reset_mask": ended.copy()}))  # as it must
    return out


def count_script() -> list[tuple[str, Any]]:
    steps: list[tuple[str, Any]] = [("step", [1, 2, 3])] * 4
    return [("reset", {}), *steps, ("partial", None), *steps, ("partial", 1), *steps]


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_counting_envs_autoreset_as_sync_vector_env_does(make: Made, mode: AutoresetMode
                                                         ) -> None:
    ours = make("vector_envs:count", 3, workers=2, autoreset_mode=mode)
    theirs = SyncVectorEnv([Count] * 3, autoreset_mode=mode)
    assert ours.metadata["autoreset_mode"] == mode
    for envs in (ours, theirs):
        envs.set_attr("max_count", [2, 3, 3])
    assert ours.get_attr("max_count") == (2, 3, 3)
    got, expected = play(ours, count_script()), play(theirs, count_script())
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert same(a, b), f"call {i}: {a} != {b}"
    if mode is AutoresetMode.NEXT_STEP:  # Gymnasium's own expectations, as a sentence
        first = play(theirs, [("reset", {}), *[("step", [1, 2, 3])] * 3])
        assert np.all(first[3][0] == [0, 3, 3]) and np.all(first[3][1] == [0, 2, 3])


def cartpole_script(rng: np.random.Generator, n: int) -> list[tuple[str, Any]]:
    script: list[tuple[str, Any]] = [("reset", {"seed": 11})]
    for t in range(240):
        script.append(("step", rng.integers(0, 2, n)))
        if t % 60 == 59:
            script.append(("partial", int(rng.integers(0, 100)) if t % 120 else None))
    return script


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_cartpole_same_seeds_and_actions_give_sync_vector_env_results(
        make: Made, mode: AutoresetMode) -> None:
    ours = make("CartPole-v1", 5, workers=2, autoreset_mode=mode)
    theirs = gym.make_vec("CartPole-v1", 5, vectorization_mode="sync",
                          vector_kwargs={"autoreset_mode": mode})
    assert ours.single_observation_space == theirs.single_observation_space
    assert ours.observation_space == theirs.observation_space
    assert ours.single_action_space == theirs.single_action_space
    assert ours.action_space == theirs.action_space
    script = cartpole_script(np.random.default_rng(3), 5)
    got, expected = play(ours, script), play(theirs, script)
    ended = 0
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert same(a, b), f"call {i}: {a} != {b}"
        ended += int(np.sum(b[2] | b[3])) if len(b) == 5 else 0
    assert ended >= 10, "episodes ended, and the ones after them matched too"


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "sockets"])
def test_steps_through_lanes_or_the_socket_give_the_same_results(make: Made,
                                                                 lanes: bool) -> None:
    """By default a worker's steps take its lane; without lanes its socket: the same data."""
    mode = AutoresetMode.SAME_STEP  # final observations and infos travel too
    ours = make("CartPole-v1", 5, workers=2, autoreset_mode=mode, lanes=lanes)
    theirs = gym.make_vec("CartPole-v1", 5, vectorization_mode="sync",
                          vector_kwargs={"autoreset_mode": mode})
    script = cartpole_script(np.random.default_rng(5), 5)
    for i, (a, b) in enumerate(zip(play(ours, script), play(theirs, script), strict=True)):
        assert same(a, b), f"call {i}: {a} != {b}"
    assert ours.launched is not None
    carried = [each.received for each in ours.launched.lanes.values()]
    steps = sum(what == "step" for what, _ in script)  # each worker answered all, and resets
    assert len(carried) == (2 if lanes else 0) and all(n > steps for n in carried), carried


def test_autoreset_mode_may_be_given_by_its_value(make: Made) -> None:
    envs = make("CartPole-v1", 2, autoreset_mode=AutoresetMode.SAME_STEP.value)
    assert envs.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
    obs, info = envs.reset(seed=[1, None])
    assert obs.shape == (2, 4) and info == {}
    with pytest.raises(ValueError, match="length must match"):
        envs.reset(seed=[1, 2, 3])
    with pytest.raises(TypeError, match=r"dtype=np\.bool_"):
        envs.reset(options={"reset_mask": np.array([1, 0])})


def test_send_recv_returns_whichever_worker_is_ready_with_its_env_ids(make: Made) -> None:
    """Each env's episode depends on its own actions only, so an async run whose actions are
    a function of (env id, that env's step) gives each env SyncVectorEnv's sequence."""
    ours = make("CartPole-v1", 4, workers=2, batch_size=2)
    theirs = gym.make_vec("CartPole-v1", 4, vectorization_mode="sync")
    obs, _ = ours.reset(seed=5)
    expected_obs, _ = theirs.reset(seed=5)
    assert same(obs, expected_obs)
    actions = np.random.default_rng(0).integers(0, 2, (50, 4))
    seen: dict[int, list[np.ndarray]] = {i: [] for i in range(4)}
    ours.send(actions[0])
    taken = np.zeros(4, int)
    while taken.min() < 49:
        o, r, term, trunc, info = ours.recv()
        ids = info["env_id"]
        assert len(ids) == 2 and set(ids) in ({0, 1}, {2, 3})
        for j, i in enumerate(ids):
            seen[i].append(np.concatenate([o[j], [r[j], term[j], trunc[j]]]))
        taken[ids] += 1
        if taken[ids].max() < 50:
            ours.send(actions[taken[ids], ids], ids)
    for t in range(49):
        o, r, term, trunc, _ = theirs.step(actions[t])
        for i in range(4):
            assert np.array_equal(seen[i][t], np.concatenate([o[i], [r[i], term[i], trunc[i]]]))
    with pytest.raises(ValueError, match="step together"):
        ours.send([0], [0])


def test_call_get_attr_set_attr_carry_data_and_refuse_the_rest(make: Made) -> None:
    envs = make("vector_envs:count", 3, workers=2)
    envs.reset(seed=[1, 2, 3])
    out = envs.call("scale", np.arange(3), factor=2.0)
    assert all(np.array_equal(o, np.arange(3) * 2.0 + c) for o, c in zip(out, [1, 2, 3],
                                                                      strict=True))
    envs.set_attr("max_count", 4)
    assert envs.get_attr("max_count") == (4, 4, 4)
    with pytest.raises(TypeError, match="cannot cross the bus"):
        envs.call("scale", object())
    with pytest.raises(TypeError, match="cannot cross the bus"):
        envs.get_attr("np_random")  # a Generator is not data
    with pytest.raises(sv.RemoteFailure, match="AttributeError"):
        envs.get_attr("no_such_attribute")
    obs, *_ = envs.step([1, 1, 1])  # and the envs step on
    assert list(obs) == [2, 3, 4]


def test_what_a_worker_would_refuse_is_refused_before_it_is_sent(make: Made) -> None:
    """A worker drops a request it cannot do, so the env must never send one: it would wait
    for an answer that never comes."""
    envs = make("CartPole-v1", 2)
    envs.reset(seed=0)
    with pytest.raises(ValueError, match="actions"):
        envs.step([0, 7])
    with pytest.raises(ValueError, match="seeds"):
        envs.reset(seed=-5)
    with pytest.raises(TypeError, match="JSON data"):
        envs.reset(options={"level": object()})
    with pytest.raises(TypeError, match="JSON data"):
        envs.reset(options={"a": [[[[[[[1]]]]]]]})  # deeper than the decoder takes
    obs, *_ = envs.step([0, 1])  # nothing was sent: the envs step on
    assert obs.shape == (2, 4)


@pytest.mark.parametrize("factory", ["match_discrete", "match_dict", "match_bits"])
def test_every_space_is_batched_as_gymnasium_batches_it(make: Made, factory: str) -> None:
    """Discrete, Dict and Tuple observations (of Box, Discrete, MultiDiscrete, MultiBinary
    leaves) and MultiDiscrete and MultiBinary actions: the same batches as SyncVectorEnv's,
    inside the batched space, final observations included."""
    import space_envs

    ours = make(f"space_envs:{factory}", 3, workers=2, autoreset_mode=AutoresetMode.SAME_STEP)
    theirs = SyncVectorEnv([getattr(space_envs, factory)] * 3,
                           autoreset_mode=AutoresetMode.SAME_STEP)
    assert ours.observation_space == theirs.observation_space
    assert ours.action_space == theirs.action_space
    theirs.action_space.seed(0)
    script = [("reset", {"seed": 4}),
              *[("step", theirs.action_space.sample()) for _ in range(space_envs.LENGTH + 2)]]
    got, expected = play(ours, script), play(theirs, script)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert same(a, b), f"call {i}: {a} != {b}"
        assert a[0] in ours.observation_space
    assert "final_obs" in got[space_envs.LENGTH][-1]


@pytest.mark.parametrize("context", [None, "forkserver"])
def test_a_module_env_in_the_callers_working_directory_is_found_by_the_workers(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, context: str | None) -> None:
    """The workers run in a private directory; `make("mine:make", ...)` from the directory
    holding mine.py works as `stepbus worker --env mine:make` does there, whether the workers
    are fresh interpreters or forked from a server started elsewhere."""
    (tmp_path / f"mine_vec_{context}.py").write_text(
        "import gymnasium as gym\n\n\ndef make():\n    return gym.make('CartPole-v1')\n")
    if context == "forkserver":
        forkserver.shared()  # running already, started from another directory
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    envs = sv.make(f"mine_vec_{context}:make", 2, context=context)
    try:
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 4)
    finally:
        envs.close()


def test_an_unknown_start_context_is_refused_naming_it_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="context must be None, \"spawn\" or \"forkserver\", "
                                         "not 'fork'"):
        sv.make("CartPole-v1", 2, context="fork")


def test_worker_options_become_flags_and_false_their_no_form() -> None:
    options: dict[str, object] = {"episode_statistics": False,
                                  "max_env_restarts_per_minute": 3, "shm_frames": True,
                                  "env_kwargs": None}
    assert launch.flags(options) == ["--no-episode-statistics", "--max-env-restarts-per-minute",
                                     "3", "--shm-frames"]


def test_a_vector_envs_workers_make_no_shared_memory_segment(make: Made) -> None:
    """Frames in batches big enough for shared memory: the relay in this process maps no
    segment, so its workers make none (nothing taken from /dev/shm, nothing to leak)."""
    envs = make("stepbus.workers.bench_envs:frames", 4, workers=1)
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (4, 84, 84, 4) and obs.nbytes >= shm.MIN_BATCH_BYTES
    assert envs.launched is not None
    names = [launch.worker_name(0)]
    assert not [f for f in os.listdir(shm.DIR) if any(f"-{n}-" in f for n in names)]
