"""Hostile checkpoints and hostile weights against a torch model: a learner resuming from a run
directory whose checkpoint is broken, forged or not a checkpoint at all refuses it with one line
naming the file and what is wrong (never a traceback, a hang or an unpickling), and a torch
broker refuses weights it cannot act with, counts them and keeps acting with its own."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import zmq
from conftest import Cluster, ManualClock
from safetensors.torch import save as safetensors_save

from stepbus import policy
from stepbus.bus import broker, node
from stepbus.bus import protocol as p
from stepbus.models import torch_agents, torch_policy
from stepbus.trainer import algorithm, checkpoint, learner, ppo
from stepbus.trainer.algorithm import CannotStart
from stepbus.trainer.model import Model
from stepbus.trainer.torch_model import TorchModel
from stepbus.workers import envs

CARTPOLE = p.SpaceSpec([4], "<f4", "discrete", action_n=2)
ENV_SPEC = p.EnvSpec(env_id="CartPole-v1", spec=CARTPOLE, policy_version=0)
TORCH = policy.ModelConfig(model="torch")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Touch:
    """Unpickling this creates a file: proof that someone unpickled our bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


def torch_model(seed: int = 1) -> TorchModel:
    return TorchModel(TORCH, "stepbus.trainer.ppo:PPO", ENV_SPEC, ppo.PPOConfig(),
                                seed=seed)


def trained_tensors() -> dict[str, torch.Tensor]:
    """What `save_torch` writes for the torch MLP after one update (Adam's moments in it)."""
    model = torch_model()
    rng = np.random.default_rng(0)
    model.update([ppo.Trajectory(
        obs=rng.normal(size=(64, 4)).astype(np.float32), actions=rng.integers(0, 2, 64),
        logp=np.full(64, -0.69, np.float32), values=np.zeros(64, np.float32),
        rewards=np.ones(64, np.float32), terminated=True, truncated=False,
        bootstrap_obs=np.zeros(4, np.float32))], tick=lambda: None)
    tensors = {f"model/{k}": v.clone() for k, v in model.module.state_dict().items()}
    tensors |= {f"optimizer/{k}": torch.as_tensor(v).clone()
                for k, v in model.torch_algo.optimizer_state().items()}
    return tensors


@pytest.fixture(scope="module")
def good() -> dict[str, torch.Tensor]:
    return trained_tensors()


def safetensors_bytes(tensors: dict[str, torch.Tensor], progress: str = '{"version": 7}'
                      ) -> bytes:
    return safetensors_save(tensors, metadata={"progress": progress})


def raw_safetensors(header: dict, data: bytes = b"") -> bytes:
    """A safetensors file as its format says: an 8-byte length, a JSON header, the data."""
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def changed(tensors: dict[str, torch.Tensor], name: str, value: torch.Tensor | None
            ) -> dict[str, torch.Tensor]:
    """The tensors with `name` replaced by `value` (None: without it)."""
    out = {k: v for k, v in tensors.items() if k != name}
    if value is not None:
        out[name] = value
    return out


def another_shape(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The first layer for five inputs, its moments with it, as another model's would be."""
    out = {k: v for k, v in tensors.items() if not k.startswith(f"optimizer/{W[6:]}/")}
    out[W] = torch.zeros(64, 5)
    return out


def torch_saved(tensors: dict[str, torch.Tensor], marker: Path) -> bytes:
    """What `torch.save` writes: a zip holding a pickle, here one that touches `marker`."""
    buf = io.BytesIO()
    torch.save({"state": tensors, "evil": Touch(marker)}, buf)
    return buf.getvalue()


W = "model/actor.0.weight"  # (64, 4) float32
MOMENT = "optimizer/actor.0.weight/exp_avg"

# id -> (the file's bytes from the good tensors and a marker path, what the one line says)
CORRUPT: dict[str, tuple[Callable[[dict, Path], bytes], str]] = {
    "truncated": (lambda t, m: safetensors_bytes(t)[:-100],
                  "is not a readable safetensors file (Error while deserializing header: "
                  "incomplete metadata"),
    "cut inside its length": (lambda t, m: safetensors_bytes(t)[:5],
                              "is not a readable safetensors file"),
    "empty": (lambda t, m: b"", "is not a readable safetensors file"),
    "garbage header": (lambda t, m: struct.pack("<Q", 12) + b"not JSON at all",
                       "invalid JSON in header"),
    "header length of 2**40": (lambda t, m: struct.pack("<Q", 2**40) + b"{}",
                               "header too large"),
    "header of 200 MB declared, 100 bytes there": (
        lambda t, m: struct.pack("<Q", 200 << 20) + b"{" + b" " * 100, "header too large"),
    "a tensor of 2**40 floats the file does not hold": (
        lambda t, m: raw_safetensors({W: {"dtype": "F32", "shape": [2**40],
                                          "data_offsets": [0, 2**42]}}, b"\0" * 64),
        "is not a readable safetensors file"),
    "a shape that does not match its bytes": (
        lambda t, m: raw_safetensors({W: {"dtype": "F32", "shape": [2**40],
                                          "data_offsets": [0, 16]}}, b"\0" * 16),
        "invalid shape, data type, or offset"),
    "bfloat16": (lambda t, m: safetensors_bytes(changed(t, W, t[W].to(torch.bfloat16))),
                 f"holds {W} of dtype BF16, which stepbus never writes"),
    "float8": (lambda t, m: safetensors_bytes(changed(t, W, t[W].to(torch.float8_e4m3fn))),
               f"holds {W} of dtype F8_E4M3, which stepbus never writes"),
    "float64 weights": (lambda t, m: safetensors_bytes(changed(t, W, t[W].double())),
                        "does not fit this model (actor.0.weight of dtype float64, this "
                        "model's is torch.float32"),
    "int32 weights": (lambda t, m: safetensors_bytes(changed(t, W, t[W].int())),
                      "actor.0.weight of dtype int32"),
    "a weight of another shape": (
        lambda t, m: safetensors_bytes(another_shape(t)),
        "does not fit this model (actor.0.weight of shape (64, 5), this model's is (64, 4)"),
    "a missing weight": (lambda t, m: safetensors_bytes(changed(t, "model/critic.4.bias", None)),
                         "missing ['critic.4.bias']"),
    "no model at all": (lambda t, m: safetensors_bytes(
        {k: v for k, v in t.items() if not k.startswith("model/")}), "missing ['critic.0"),
    "an extra weight": (lambda t, m: safetensors_bytes(changed(t, "model/actor.9.weight",
                                                               torch.zeros(2, 2))),
                        "unexpected ['actor.9.weight']"),
    "a tensor outside model/ and optimizer/": (
        lambda t, m: safetensors_bytes(changed(t, "payload", torch.zeros(1))),
        "holds 'payload', neither a model/ nor an optimizer/ tensor"),
    "NaN in a weight": (lambda t, m: safetensors_bytes(changed(t, W, t[W] * torch.nan)),
                        f"holds non-finite values in {W}"),
    "inf in Adam's moments": (lambda t, m: safetensors_bytes(changed(t, MOMENT,
                                                                     t[MOMENT] + torch.inf)),
                              f"holds non-finite values in {MOMENT}"),
    "a moment of another shape than its parameter": (
        lambda t, m: safetensors_bytes(changed(t, MOMENT, torch.zeros(4, 64))),
        "holds optimizer/actor.0.weight/exp_avg of shape [4, 64], its parameter's is [64, 4]"),
    "257 model tensors": (lambda t, m: safetensors_bytes(
        {**t, **{f"model/x{i}": torch.zeros(1) for i in range(257)}}),
        "holds a model of more than 256 tensors"),
    "progress that is not JSON": (lambda t, m: safetensors_bytes(t, progress="{version: 7"),
                                  "has a progress record that is not JSON"),
    "progress that is a list": (lambda t, m: safetensors_bytes(t, progress="[7]"),
                                "has a progress record that is a list, not a JSON object"),
    "torch.save output": (torch_saved, "is a zip archive (torch.save writes those; stepbus "
                                       "never unpickles), not a safetensors file"),
    "a pickle": (lambda t, m: pickle.dumps(Touch(m)), "is a pickle (stepbus never unpickles)"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_torch_checkpoint_that_is_broken_or_forged_is_refused_in_one_line_naming_the_file(
        case: str, good: dict[str, torch.Tensor], tmp_path: Path) -> None:
    make, problem = CORRUPT[case]
    marker = tmp_path / "unpickled"
    path = tmp_path / learner.TORCH_CHECKPOINT
    path.write_bytes(make(good, marker))
    with pytest.raises(CannotStart) as refused:
        torch_model(seed=2).resume(path)
    line = str(refused.value)
    assert problem in line and str(path) in line, line
    assert "\n" not in line and len(line) < 600, line
    assert not marker.exists(), "nothing was ever unpickled"


def test_a_good_torch_checkpoint_still_resumes(good: dict[str, torch.Tensor],
                                               tmp_path: Path) -> None:
    """The control for the cases above: the same tensors, unchanged, resume."""
    path = tmp_path / learner.TORCH_CHECKPOINT
    path.write_bytes(safetensors_bytes(good))
    model = torch_model(seed=2)
    assert model.resume(path) == {"version": 7}
    assert all(torch.equal(v, good[f"model/{k}"]) for k, v in model.module.state_dict().items())


def test_a_tensor_over_a_gib_is_refused_from_the_header_before_a_byte_is_read(
        tmp_path: Path) -> None:
    """A sparse file that does hold a 1 GiB tensor: refused from its header, not loaded (a
    weight the bus could not carry cannot be this model's)."""
    n = (1 << 28) + 1  # float32s: 4 bytes over a GiB
    path = tmp_path / learner.TORCH_CHECKPOINT
    path.write_bytes(raw_safetensors({W: {"dtype": "F32", "shape": [n],
                                          "data_offsets": [0, 4 * n]}}))
    os.truncate(path, path.stat().st_size + 4 * n)
    with pytest.raises(CannotStart, match=r"holds model/actor.0.weight of shape \[268435457\], "
                                          r"over 1 GiB"):
        checkpoint.load_torch(path)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_checkpoint_that_is_no_regular_file_is_refused_without_blocking(
        kind: str, tmp_path: Path) -> None:
    path = tmp_path / learner.TORCH_CHECKPOINT
    if kind == "fifo":
        os.mkfifo(path)  # opening it to read would wait for a writer forever
    else:
        path.mkdir()
    with pytest.raises(CannotStart, match="is not a regular file"):
        torch_model().resume(path)


# ---------------------------------------------------------------------------------------------
# The numpy MLP's .npz: the same reader's promises


def numpy_model() -> Model:
    return Model(algorithm.load("stepbus.trainer.ppo:PPO"), ENV_SPEC, ppo.PPOConfig(), seed=0)


def npz_bytes(tmp_path: Path, change: Callable[[dict], None] | None = None) -> bytes:
    model, path = numpy_model(), tmp_path / "good.npz"
    model.save(path, {"version": 3})
    if change is not None:
        with np.load(path) as data:
            arrays = dict(data)
        change(arrays)
        np.savez(path, **arrays)
    return path.read_bytes()


def nan_param(arrays: dict) -> None:
    arrays["param/pi.0.w"] = arrays["param/pi.0.w"] * np.nan


def bad_meta(arrays: dict) -> None:
    arrays["meta"] = np.frombuffer(b"[1, 2", np.uint8)


def no_meta(arrays: dict) -> None:
    del arrays["meta"]


NPZ: dict[str, tuple[Callable[[Path], bytes], str]] = {
    "truncated": (lambda d: npz_bytes(d)[:-200], "is not a readable .npz"),
    "garbage": (lambda d: b"\x00garbage" * 40, "is not a readable .npz"),
    "a pickled object array": (lambda d: pickled_npy(d), "is a bare .npy array, not an .npz"),
    "a pickle": (lambda d: pickle.dumps(Touch(d / "unpickled")), "is a pickle"),
    "torch.save output": (lambda d: torch_saved({}, d / "unpickled"),
                          "is not a stepbus checkpoint (no meta record)"),
    "NaN in a param": (lambda d: npz_bytes(d, nan_param), "holds non-finite values in "
                                                          "param/pi.0.w"),
    "a meta record that is not JSON": (lambda d: npz_bytes(d, bad_meta),
                                       "has a progress record that is not JSON"),
    "no meta record": (lambda d: npz_bytes(d, no_meta), "no meta record"),
}


def pickled_npy(tmp_path: Path) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.array([Touch(tmp_path / "unpickled")], dtype=object), allow_pickle=True)
    return buf.getvalue()


@pytest.mark.parametrize("case", list(NPZ))
def test_a_numpy_checkpoint_that_is_broken_or_forged_is_refused_in_one_line_naming_the_file(
        case: str, tmp_path: Path) -> None:
    make, problem = NPZ[case]
    path = tmp_path / learner.CHECKPOINT
    path.write_bytes(make(tmp_path))
    with pytest.raises(CannotStart) as refused:
        numpy_model().resume(path)
    line = str(refused.value)
    assert problem in line and str(path) in line and "\n" not in line, line
    assert not (tmp_path / "unpickled").exists(), "nothing was ever unpickled"


# ---------------------------------------------------------------------------------------------
# A real learner


def test_a_learner_on_a_run_dir_with_a_corrupt_checkpoint_exits_2_with_one_line(
        cluster: Cluster, good: dict[str, torch.Tensor]) -> None:
    """`stepbus learner --run-dir` as a user runs it (the test plays the broker that gives it
    the spaces): exit code 2 and one ERROR line in its log (stdout, where stepbus logs), nothing
    on stderr, and the checkpoint left as it was."""
    run_dir = cluster.runs_dir / "r1"
    run_dir.mkdir(parents=True)
    ckpt = run_dir / learner.TORCH_CHECKPOINT
    corrupt = safetensors_bytes(good)[:-100]
    ckpt.write_bytes(corrupt)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stepbus", "learner", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cluster.dir,
        env=cluster.env({"STEPBUS_MODEL": "torch"}), start_new_session=True)
    fake_broker = cluster.socket(zmq.ROUTER, cluster.endpoints["policy"], bind=True)
    try:
        assert fake_broker.poll(60_000), "the learner says hello to the broker"
        peer, *frames = fake_broker.recv_multipart()
        assert isinstance(p.decode(frames), p.TrainerHello)
        fake_broker.send_multipart([peer, *p.encode(ENV_SPEC)])
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        fake_broker.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    assert proc.returncode == 2, (stdout, stderr)
    errors = [line for line in stdout.splitlines() if "ERROR" in line]
    assert len(errors) == 1, stdout
    assert f"checkpoint {ckpt} is not a readable safetensors file" in errors[0], errors
    assert "Traceback" not in stdout + stderr and stderr == "", stderr
    assert ckpt.read_bytes() == corrupt, "the checkpoint is left as it was, not overwritten"


# ---------------------------------------------------------------------------------------------
# Hostile weights to a torch broker (another model's: test_torch_models)


def weights(params: dict[str, np.ndarray], version: int) -> p.Weights:
    return p.Weights(trainer="t", incarnation="t1", policy="default", version=version,
                     consumed_steps=0, batch_steps=256, starving=False, params=params)


class ActingBroker:
    """A torch broker in-process with one CartPole worker of two envs, acting with version 1
    of the torch MLP; `step()` answers its last step and returns the next one it sends."""

    def __init__(self) -> None:
        self.clock, self.out = ManualClock(1000.0), node.Outbox()
        self.b = broker.Broker(broker.Config(models=TORCH), self.out,
                               logging.getLogger("test.broker"), rules=[], clock=self.clock)
        self.b.deliver(b"", p.RunState(run_id="r", epoch=0, options={}, shutting_down=False),
                       now=self.clock.t)
        spec = envs.space_spec(gym.make("CartPole-v1"))
        self.b.deliver(b"w0", p.WorkerHello(worker="w0", incarnation="i1", env_id="CartPole-v1",
                                            num_envs=2, seed=0, spec=spec, seq=0),
                       now=self.clock.t)
        [reset] = self.out.take_sent(p.Reset)
        assert isinstance(reset.msg, p.Reset)
        self.seq, self.first = reset.msg.seq, True
        self.own = torch_policy.state_arrays(
            torch_agents.make_agent(*torch_policy.gym_spaces(spec)))
        self.send(self.own, 1)
        assert self.step().policy_version == 1

    def send(self, params: dict[str, np.ndarray], version: int) -> None:
        self.b.deliver(b"t", p.decode(p.encode(weights(params, version))), now=self.clock.t)

    def step(self) -> p.Step:
        rng = np.random.default_rng(self.seq)
        self.b.deliver(b"w0", p.StepResult(
            incarnation="i1", epoch=0, seq=self.seq, first=self.first,
            obs=rng.normal(size=(2, 4)).astype(np.float32), reward=np.ones(2, np.float32),
            terminated=np.zeros(2, bool), truncated=np.zeros(2, bool),
            final_obs=np.zeros((0, 4), np.float32)), now=self.clock.t)
        self.b.tick(self.clock.t)
        [step] = self.out.take_sent(p.Step)
        assert isinstance(step.msg, p.Step)
        self.seq, self.first = step.msg.seq, False
        return step.msg


def overflowing(own: dict[str, np.ndarray], biases: bool) -> dict[str, np.ndarray]:
    """Finite weights near float32's largest: logits overflow to inf and NaN. Without
    `biases` they are zero, so only observations that are not zero show it."""
    big = np.float32(3e38)
    return {k: (np.sign(v) * big if biases or k.endswith("weight") else v * 0).astype(v.dtype)
            for k, v in own.items()}


HOSTILE: dict[str, tuple[Callable[[dict], dict], str]] = {
    "NaN": (lambda w: {**w, "actor.0.weight": w["actor.0.weight"] * np.nan},
            "non-finite values in actor.0.weight"),
    "inf": (lambda w: {**w, "critic.4.bias": w["critic.4.bias"] + np.inf},
            "non-finite values in critic.4.bias"),
    "-inf": (lambda w: {**w, "head.out.bias": w["head.out.bias"] - np.inf},
             "non-finite values in head.out.bias"),
    "float64": (lambda w: {k: v.astype(np.float64) for k, v in w.items()},
                "of dtype float64, this model's is torch.float32"),
    "float16": (lambda w: {**w, "head.out.weight": w["head.out.weight"].astype(np.float16)},
                "head.out.weight of dtype float16"),
    "int32": (lambda w: {**w, "actor.0.bias": w["actor.0.bias"].astype(np.int32)},
              "actor.0.bias of dtype int32"),
    "bool": (lambda w: {**w, "actor.0.bias": w["actor.0.bias"] > 0},
             "actor.0.bias of dtype bool"),
    "oversized": (lambda w: {**w, "actor.2.weight": np.zeros((64, 64 * 1024), np.float32)},
                  "actor.2.weight of shape (64, 65536), this model's is (64, 64)"),
    "a scalar for a vector": (lambda w: {**w, "critic.4.bias": np.float32(0.5)},
                              "critic.4.bias of shape ()"),
    "an extra name": (lambda w: {**w, "actor.9.weight": np.zeros((2, 2), np.float32)},
                      "unexpected ['actor.9.weight']"),
    "a missing name": (lambda w: {k: v for k, v in w.items() if k != "critic.0.weight"},
                       "missing ['critic.0.weight']"),
    "no names": (lambda w: {}, "missing ['critic.0.weight'"),
    "finite but overflowing": (lambda w: overflowing(w, biases=True),
                               "a trial step with them failed"),
    "overflowing only on what the envs show": (lambda w: overflowing(w, biases=False),
                                               "a trial step with them failed"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_torch_broker_refuses_hostile_weights_counts_them_and_keeps_acting_with_its_own(
        case: str, caplog: pytest.LogCaptureFixture) -> None:
    make, problem = HOSTILE[case]
    acting = ActingBroker()
    with caplog.at_level(logging.WARNING):
        acting.send(make(acting.own), 5)
    [line] = [r.getMessage() for r in caplog.records if "bad weights" in r.getMessage()]
    assert problem in line and "this broker serves --model torch" in line, line
    assert acting.b.figures()["weights_refused"] == 1
    for _ in range(3):
        assert acting.step().policy_version == 1, "it acts with the weights it had"
    acting.send(acting.own, 2)  # a version below the refused one is still taken
    assert acting.step().policy_version == 2
    assert acting.b.figures()["weights_refused"] == 1


# ---------------------------------------------------------------------------------------------
# Weights that pass every check yet fail to act, and progress records a learner cannot use


class Fragile(policy.Policy):
    """Acts 0 everywhere, unless its weights say `explode`: then it raises, as a model whose
    forged weights passed the trial step may on other observations."""

    def __init__(self, spec: p.SpaceSpec) -> None:
        super().__init__(spec)
        self.explode = False

    def prepare(self, params: dict[str, np.ndarray]) -> None:  # type: ignore[override]
        self.explode = bool(params["explode"][0])

    def act(self, obs: p.Obs, rng: np.random.Generator, deterministic: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.explode:
            raise FloatingPointError("probability tensor contains inf")
        n = len(obs)
        return np.zeros(n, np.int64), np.zeros(n, np.float32), np.zeros(n, np.float32)

    def weights_problem(self, params: dict[str, np.ndarray]) -> str:  # type: ignore[override]
        return ""


def test_weights_that_fail_to_act_are_put_aside_and_the_broker_goes_on() -> None:
    from test_broker_state import Bench

    bench = Bench(models=policy.ModelConfig(model="test_hostile_checkpoints:Fragile"))
    w = bench.join("w0")

    def weights(version: int, explode: bool) -> p.Weights:
        return p.Weights(trainer="t", incarnation="t1", policy="default", version=version,
                         consumed_steps=0, batch_steps=256, starving=False,
                         params={"explode": np.array([explode])})

    bench.deliver(b"t", weights(1, explode=False))
    bench.answer(w)
    bench.tick()
    assert [s.policy_version for s in bench.steps_to(w)] == [1]
    bench.deliver(b"t", weights(2, explode=True))
    bench.answer(w)
    bench.tick()  # version 2 raises: put aside, back to version 1, the batch tried again
    bench.tick()
    assert [s.policy_version for s in bench.steps_to(w)] == [1]
    figures = bench.broker.figures()
    assert figures["act_failures"] == 1 and figures["policy_version"] == 1
    bench.deliver(b"t", weights(3, explode=True))
    bench.answer(w)
    bench.tick()  # and again: nothing before it now but version 1, which it falls back to
    bench.tick()
    assert [s.policy_version for s in bench.steps_to(w)] == [1]


def test_a_progress_record_of_unknown_or_mistyped_fields_is_refused_in_one_line(
        tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint.npz"
    assert learner.progress_of({"version": 3, "recent_returns": [1, 2.5]}, ckpt).version == 3
    for bad in ({"bogus": 1}, {"version": "3"}, {"version": True}, {"learned": 5}):
        with pytest.raises(CannotStart, match="progress record this learner cannot use"):
            learner.progress_of(bad, ckpt)
