"""Every Gymnasium space and action masks: described at the worker, carried leaf by leaf,
checked, acted on and learned from, in-process and through real processes."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import gymnasium as gym
import msgpack
import numpy as np
import pytest
import space_envs
from conftest import serial_run

from stepbus import policy, spaces
from stepbus.bus import checks
from stepbus.bus import protocol as p
from stepbus.models.mlp import MLPPolicy, init_params
from stepbus.workers import envs
from stepbus.workers.worker import Config, EnvSet

MATCHES = ("match_discrete", "match_dict", "match_bits")
MASKED = ("masked_info", "masked_obs")


def envset(name: str, k: int = 3) -> EnvSet:
    return EnvSet(Config(env=f"space_envs:{name}", envs_per_worker=k, name="w"),
                  report=lambda error: None, log=logging.getLogger("test"))


def same_space(a: gym.Space, b: gym.Space) -> bool:
    """Equal but for Box bounds, which do not travel."""
    if isinstance(a, gym.spaces.Box):
        return isinstance(b, gym.spaces.Box) and (a.shape, a.dtype) == (b.shape, b.dtype)
    if isinstance(a, gym.spaces.Dict):
        return (isinstance(b, gym.spaces.Dict) and list(a) == list(b)
                and all(same_space(a[k], b[k]) for k in a))
    if isinstance(a, gym.spaces.Tuple):
        return isinstance(b, gym.spaces.Tuple) and len(a) == len(b) and all(
            same_space(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("name", MATCHES + MASKED)
def test_each_leaf_travels_as_its_own_frame_and_the_spaces_come_back_whole(name: str) -> None:
    envs = envset(name)
    spec = p.from_map(p.SpaceSpec, p.to_map(envs.spec))  # as a hello carries it
    assert not checks.spec_problem(spec)
    assert same_space(spaces.observation_space(spec), envs.envs[0].observation_space)
    assert spaces.action_space(spec) == envs.envs[0].action_space
    result = envs.step(np.zeros((3, *policy.action_space(spec).batch_shape),
                                policy.action_space(spec).dtype) if "masked" not in name
                       else np.flatnonzero(envs.envs[0].allowed)[:1].repeat(3), {})
    frames = p.encode(result)
    leaves = [leaf.key for leaf in spec.obs_leaves]
    names = [desc[0] for desc in msgpack.unpackb(frames[0])[3]]
    assert [n for n in names if n.startswith("obs.")] == [f"obs.{k}" for k in leaves]
    back = p.decode(frames)
    assert isinstance(back, p.StepResult) and not checks.result_problem(back, 3, spec)
    for key in leaves:
        assert np.array_equal(back.obs[key], result.obs[key])


def test_structured_observations_nest_as_the_env_gave_them() -> None:
    envs = envset("match_dict", k=2)
    obs = envs.reset({})
    nested = spaces.structured(envs.spec, obs)
    env_obs = envs.envs[1].obs
    assert nested["cell"][1] == env_obs["cell"]
    assert np.array_equal(nested["inner"][1][1], env_obs["inner"][1])
    assert np.array_equal(nested["inner"][2][1], env_obs["inner"][2])
    flat = spaces.flatten(envs.spec, obs)
    assert flat.shape == (2, spaces.flat_dim(envs.spec)) == (2, 5 + 3 + 6 + 4 + 2)
    cell = flat[1, :5]  # Dict keys sort: cell first, one-hot from its start (-2)
    assert cell.tolist() == np.eye(5)[env_obs["cell"] + 2].tolist()


def test_bad_leaves_in_a_hello_are_refused_with_what_is_wrong() -> None:
    good = envset("match_dict").spec
    leaf = good.obs_leaves[0]
    bad_leaves = {
        "unnested": [leaf.__class__(**{**p.to_map(leaf), "containers": ["tuple"]})],
        "twice": [leaf, leaf],
        "categories": [leaf.__class__(**{**p.to_map(leaf), "nvec": [0]})],
    }
    for why, leaves in bad_leaves.items():
        spec = p.from_map(p.SpaceSpec, {**p.to_map(good), "obs_leaves":
                                        [p.to_map(x) for x in leaves]})
        assert checks.spec_problem(spec), why
    wide_mask = p.LeafSpec("action_mask", "mask", [7], np.dtype(bool).str)
    masked = envset("masked_info").spec
    spec = p.SpaceSpec([], "", "discrete", action_n=6,
                       obs_leaves=[masked.obs_leaves[0], wide_mask])
    assert "action mask" in checks.spec_problem(spec)


def test_a_space_stepbus_cannot_carry_is_named_at_worker_start() -> None:
    with pytest.raises(spaces.SpaceError, match="is not Discrete, Box"):
        spaces.describe(gym.spaces.Box(0, 1, (2,)), gym.spaces.Text(5))
    with pytest.raises(spaces.SpaceError, match="masks are for"):
        spaces.describe(gym.spaces.Box(0, 1, (2,)), gym.spaces.Box(0, 1, (2,)),
                        info_mask=True)


@pytest.mark.parametrize("name", MASKED)
def test_the_mlp_never_takes_a_masked_action(name: str) -> None:
    envs = envset(name, k=16)
    spec = envs.spec
    model = MLPPolicy(spec)
    rng = np.random.default_rng(0)
    params = init_params(policy.obs_dim(spec), policy.action_space(spec), (64, 64), rng)
    params["pi.2.w"] *= 300  # a confident policy, which masks must still overrule
    model.load(params, 0)
    obs = envs.reset({})
    for _ in range(50):
        mask = spaces.mask(spec, obs)
        assert mask is not None and mask.sum(axis=1).tolist() == [2] * 16
        actions, logp, _ = model.act(obs, rng)
        assert mask[np.arange(16), actions].all() and np.isfinite(logp).all()
        obs = envs.step(actions, {}).obs
    assert envs.errors == 0, "a masked action reached the env"


def test_multi_discrete_log_probs_sum_over_dimensions_and_masks_zero_them() -> None:
    from stepbus.models import mlp

    action = policy.ActionSpace("multi_discrete", shape=(2,), nvec=(3, 2))
    out = np.array([[0.0, 1.0, 2.0, 0.5, -0.5]])
    logp, entropy = mlp.log_prob_entropy(out, {}, action, np.array([[2, 0]]))
    first, second = mlp.log_softmax(out[:, :3]), mlp.log_softmax(out[:, 3:])
    assert np.allclose(logp, first[:, 2] + second[:, 0])
    h = -(np.exp(first) * first).sum() - (np.exp(second) * second).sum()
    assert np.allclose(entropy, h)
    mask = np.array([[True, False, True, True, True]])
    masked, _ = mlp.log_prob_entropy(out, {}, action, np.array([[1, 0]]), mask)
    assert masked[0] < -1e8, "a masked action has no probability"


@pytest.mark.parametrize("name", MATCHES + MASKED)
def test_each_space_kind_learns_end_to_end(tmp_path: Path, name: str) -> None:
    """Worker, broker (numpy MLP), assembler and learner on each kind (the serial runner): the
    learner reaches a return that only the observation's leaves (and the masks) make
    possible, and stops the run; no env ever raised (a masked action would have: the serial
    runner raises an env's exception)."""
    records = serial_run(tmp_path, "--env", f"space_envs:{name}", "--envs-per-worker", "16",
                         "--target-return", "7.5", "--max-env-steps", "300000",
                         "--batch-steps", "1024", "--n-epochs", "10")
    assert records[-1]["mean_return"] >= 7.5, records[-1]
    assert records[-1]["env_steps"] < 300_000


@pytest.mark.parametrize("name", (*MASKED, "match_dict"))
def test_the_built_in_torch_model_takes_every_space_and_never_a_masked_action(
        name: str) -> None:
    pytest.importorskip("torch")
    from stepbus.models import torch_policy

    envs = envset(name, k=16)
    model = policy.make_policy("torch", envs.spec)
    assert isinstance(model, torch_policy.TorchPolicy)
    weights = torch_policy.state_arrays(model.module)
    weights["head.out.weight"] *= 1000  # confident, and masks must still overrule it
    assert not model.weights_problem(weights)
    model.load(weights, 0)
    obs, rng = envs.reset({}), np.random.default_rng(0)
    for _ in range(30):
        actions, logp, _ = model.act(obs, rng)
        mask = spaces.mask(envs.spec, obs)
        assert mask is None or mask[np.arange(16), actions].all()
        assert np.isfinite(logp).all()
        obs = envs.step(actions, {}).obs
    assert envs.errors == 0, "a masked action reached the env"


@pytest.mark.parametrize("name", ("match_dict", "masked_obs"))
def test_torch_models_learn_other_spaces_and_masks(tmp_path: Path, name: str) -> None:
    """--model torch: the built-in torch MLP on a nested Dict with MultiDiscrete actions, and
    on PettingZoo-style masks inside the observation."""
    pytest.importorskip("torch")
    learns(tmp_path, f"space_envs:{name}", "torch", envs_per_worker=16)


def learns(runs_dir: Path, env: str, model: str, *, envs_per_worker: int) -> None:
    """Controller, broker and learner with `model`, an assembler and one worker on `env` (a
    matching game of space_envs), on the serial runner: the learner reaches 7.5 of 8 and ends
    the run with exit 0, and no env raised (a masked action would have, and the serial
    runner raises an env's exception)."""
    records = serial_run(runs_dir, "--model", model, "--env", env, "--envs-per-worker",
                         str(envs_per_worker), "--target-return", "7.5", "--max-env-steps",
                         "300000", "--batch-steps", "1024", "--n-epochs", "10")
    assert records[-1]["mean_return"] >= 7.5


@pytest.mark.parametrize("name", ("masked_pair_obs", "masked_pair_info"))
def test_pettingzoo_agents_with_dict_observations_and_masks(name: str) -> None:
    envs = envset(name, k=2)
    assert envs.agents == ["left", "right"] and envs.rows == 4
    model = MLPPolicy(envs.spec)
    rng = np.random.default_rng(1)
    params = init_params(policy.obs_dim(envs.spec), policy.action_space(envs.spec), (64, 64),
                         rng)
    params["pi.2.w"] *= 300
    model.load(params, 0)
    obs = envs.reset({})
    for _ in range(3 * space_envs.LENGTH):
        mask = spaces.mask(envs.spec, obs)
        assert mask is not None and mask.sum(axis=1).tolist() == [2] * 4
        actions, _, _ = model.act(obs, rng)
        result = envs.step(actions, {})
        assert not checks.result_problem(result, 4, envs.spec)
        obs = result.obs
    assert envs.errors == 0, "a masked action reached the env"


def test_the_run_digest_sees_every_leaf() -> None:
    from stepbus.trainer.intake import RunDigest

    envs = envset("match_dict", k=1)
    obs = envs.reset({})
    assert isinstance(obs, dict)
    base = dict(agent="a", epoch=0, terminated=False, truncated=True, episode_return=None,
                episode_length=None, actions=np.zeros((1, 2), np.int64),
                logp=np.zeros(1, np.float32), values=np.zeros(1, np.float32),
                rewards=np.zeros(1, np.float32), policy_versions=np.zeros(1, np.int64),
                bootstrap_obs={k: v[0] for k, v in obs.items()}, assembler="x", seq=0)
    digests = []
    for pos in (0.0, 0.5):
        changed = {**obs, "pos": np.full_like(obs["pos"], pos)}
        digest = RunDigest()
        digest.add(p.Trajectory(obs=changed, **base))  # type: ignore[arg-type]
        digests.append(digest.hexdigest())
    assert digests[0] != digests[1]


def hostile_leaves() -> dict[str, list[p.LeafSpec]]:
    """Leaves no worker's `describe` makes, each of which raised in, or got past, the checks."""
    def leaf(key: str, kind: str, shape: list[int], dtype: str, path: list[str] | None = None,
             **fields: list[int]) -> p.LeafSpec:
        path = [key] if path is None else path
        return p.LeafSpec(key, kind, shape, np.dtype(dtype).str, path, ["dict"] * len(path),
                          **fields)

    deep = ["a"] * 1500  # fits a hello's header; rebuilding the space recursed past the limit
    return {
        "deep": [leaf("/".join(deep), "box", [1], "f4", deep)],
        "uint64 start": [leaf("a", "discrete", [], "i8", nvec=[3], start=[2**64 - 1])],
        "start at int64's end": [leaf("a", "discrete", [], "i8", nvec=[3], start=[2**63 - 2])],
        "box with starts": [leaf("a", "box", [2], "f4", start=[1, 2, 3])],
        "discrete of a shape": [leaf("a", "discrete", [4], "i8", nvec=[3], start=[0])],
        "float categories": [leaf("a", "discrete", [], "f4", nvec=[3], start=[0])],
        "mask in a dict": [leaf("a", "box", [1], "f4"),
                           p.LeafSpec(spaces.MASK, "mask", [2], "|b1", ["q"], ["dict"])],
        "float mask": [leaf("a", "box", [1], "f4"),
                       p.LeafSpec(spaces.MASK, "mask", [2], "<f8")],
        "a billion numbers": [leaf("a", "box", [1 << 15, 1 << 15], "u1")],
        "a million categories": [leaf("a", "multi_discrete", [8], "i8", nvec=[1 << 20] * 8,
                                      start=[0] * 8)],
    }


@pytest.mark.parametrize("name", list(hostile_leaves()))
def test_hostile_leaves_in_a_hello_are_refused_and_the_broker_goes_on(name: str) -> None:
    """A hello whose leaves crashed the broker (a RecursionError or OverflowError while
    checking them) or got past the checks, to fail later wherever zeros or one-hots of them
    were made, is refused in one line, and the broker takes the next worker's good hello."""
    from test_broker_state import SPEC, Bench

    spec = p.SpaceSpec([], "", "discrete", action_n=2, obs_leaves=hostile_leaves()[name])
    hello = p.WorkerHello(worker="evil", incarnation="i1", env_id="x", num_envs=1, seed=0,
                          spec=spec, seq=0)
    again = p.decode([bytes(f) for f in p.encode(hello)])
    assert isinstance(again, p.WorkerHello)
    assert checks.spec_problem(again.spec)
    bench = Bench()
    bench.deliver(b"evil", again)
    bench.tick()
    assert bench.broker.figures()["spec_refused"] == 1 and bench.broker.spec is None
    bench.join("w0")
    assert bench.broker.spec == SPEC


def test_the_torch_models_flatten_one_hots_as_the_numpy_mlp_does_out_of_range_too() -> None:
    """A categorical value outside its space (an env's bug) is all zeros to both models, as
    `spaces.flatten` documents, not the nearest category."""
    torch = pytest.importorskip("torch")
    from stepbus.models.torch_agents import Flatten

    envs = envset("match_dict", k=3)
    obs = envs.reset({})
    assert isinstance(obs, dict)
    cell = next(leaf for leaf in envs.spec.obs_leaves if leaf.kind == "discrete")
    obs[cell.key][:] = [cell.start[0] - 1, cell.start[0] + cell.nvec[0], cell.start[0]]
    want = spaces.flatten(envs.spec, obs, np.float32)
    flat = Flatten(spaces.observation_space(envs.spec))
    got = flat(spaces.structured(envs.spec, {k: torch.from_numpy(v) for k, v in obs.items()}))
    assert np.array_equal(got.numpy(), want)
    assert want[:2, :cell.nvec[0]].sum() == 0 and want[2, 0] == 1


def test_a_multi_discrete_mask_nested_as_its_nvec_is_written_flat() -> None:
    """Gymnasium nests a MultiDiscrete mask as the space's nvec: a tuple of tuples of arrays
    for a 2x2 nvec, which the worker's row writer could not flatten (ValueError)."""
    nvec = np.array([[3, 2], [4, 1]])
    spec = spaces.describe(gym.spaces.Box(0, 1, (2,)), gym.spaces.MultiDiscrete(nvec),
                           info_mask=True)
    mask = ((np.array([1, 0, 1], np.int8), np.array([1, 1], np.int8)),
            (np.array([0, 1, 1, 1], np.int8), np.array([1], np.int8)))
    # sample takes the nested mask, though its annotation names only a flat tuple
    sample = gym.spaces.MultiDiscrete(nvec).sample(mask=mask)  # type: ignore[arg-type]
    assert sample.shape == (2, 2)
    batch = spaces.zeros(spec, 2)
    spaces.RowWriter(spec)(batch, 1, np.zeros(2, np.float32), {spaces.MASK: mask})
    assert batch[spaces.MASK][1].tolist() == [True, False, True, True, True,
                                              False, True, True, True, True]
    assert batch[spaces.MASK][0].all(), "row 0 untouched"


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64",
                                   "uint8", "uint16", "uint32", "uint64"])
@pytest.mark.parametrize("n", [2, 200])
def test_an_action_outside_the_space_is_refused_whatever_its_integer_type(dtype: str,
                                                                          n: int) -> None:
    """Actions come off a socket: a negative one, or one at n, is refused at every width
    (with n above a signed type's half, a negative one read as unsigned is still too big)."""
    spec = envs.space_spec(gym.make("CartPole-v1"))
    spec = dataclasses.replace(spec, action_n=n)
    top = min(n - 1, np.iinfo(dtype).max)
    assert spaces.actions_problem(spec, np.array([0, top], dtype), 2) == ""
    bad = [np.iinfo(dtype).min, -1, -100] if np.iinfo(dtype).min < 0 else []
    bad += [n] if n <= np.iinfo(dtype).max else []
    for value in bad:
        assert "outside [0, " in spaces.actions_problem(spec, np.array([0, value], dtype), 2), \
            (dtype, n, value)
    multi = dataclasses.replace(spec, action_kind="multi_discrete", action_shape=[2],
                                action_nvec=[2, n])
    assert spaces.actions_problem(multi, np.array([[1, top]], dtype), 1) == ""
    for value in bad:
        assert "outside [0, nvec)" in spaces.actions_problem(
            multi, np.array([[0, value]], dtype), 1), (dtype, n, value)
