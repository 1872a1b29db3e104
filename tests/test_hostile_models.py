"""Hostile or mistaken input around models: recurrent states of another dtype, a worker whose
observations are leaves pointing the broker at a shared-memory slot, a module whose
initial_state is not tensors, action spaces of no size. Each is refused in one line; none
crashes a process."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from test_broker_state import SPEC, Bench
from test_spaces import envset

from stepbus import policy
from stepbus.bus import checks, shm
from stepbus.bus import protocol as p

pytest.importorskip("torch")
import torch

from stepbus.models import torch_policy
from stepbus.trainer import ppo

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_recurrent_states_of_another_dtype_are_refused_before_they_reach_the_model(
        dtype: type) -> None:
    """States shaped as the LSTM's but of another dtype passed the learner's checks, and its
    update died in the LSTM (RuntimeError: unsupported data type)."""
    from test_recurrent import TASK, lstm_on, rollout

    envs, model, acting = lstm_on(TASK, 2, ppo.PPOConfig(n_epochs=1, minibatch_size=32), 1)
    trajs = [dataclasses.replace(t, seq=i, assembler="a")
             for i, t in enumerate(rollout(acting, envs, 12, 6))]
    assert not model.problem(trajs[0]) and not model.problem(p.Trajectories.of(trajs))
    bad = [dataclasses.replace(t, state={k: v.astype(dtype) for k, v in t.state.items()})
           for t in trajs]
    assert "recurrent states" in model.problem(bad[0])
    assert "recurrent states" in model.problem(p.Trajectories.of(bad))


def test_a_worker_of_leaves_naming_a_shared_memory_slot_is_refused_not_a_crash() -> None:
    """A worker whose observations are leaves names a slot laid out as a Box: the broker
    once read it as a Box of dtype '' and died (TypeError); the spec's checks refuse it."""
    writer = shm.Writer(shm.segment_name("evil", "i1"), np.zeros((1, 4), np.float32))
    try:
        bench = Bench()
        bench.deliver(b"evil", p.WorkerHello(
            worker="evil", incarnation="i1", env_id="x", num_envs=1, seed=0,
            spec=envset("match_dict").spec, seq=0, shm=writer.name,
            shm_nonce=writer.nonce.hex()))
        reset = bench.commands_to(b"evil")[-1]
        assert isinstance(reset, p.Reset)
        bench.deliver(b"evil", p.StepResult(
            incarnation="i1", epoch=reset.epoch, seq=reset.seq, first=True,
            obs=np.zeros((0, 4), np.float32), reward=np.zeros(1, np.float32),
            terminated=np.zeros(1, bool), truncated=np.zeros(1, bool),
            final_obs=np.zeros((0, 4), np.float32), obs_slot=0))
        assert bench.broker.figures()["rejected_bad_step_result"] == 1
    finally:
        writer.close()


class DictState(torch.nn.Module):
    """A recurrent module whose state is a dict: not a layout stepbus can hold."""

    def __init__(self, *_: Any) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 2)

    def initial_state(self, batch_size: int) -> Any:
        return {"h": torch.zeros(batch_size, 3)}

    def get_action_and_value(self, *_: Any) -> Any:
        raise AssertionError("never built")

    def get_value(self, *_: Any) -> Any:
        raise AssertionError("never built")


class NestedState(DictState):
    def initial_state(self, batch_size: int) -> Any:
        z = torch.zeros(1, batch_size, 3)
        return (z, z), (z, z)


@pytest.mark.parametrize("name", ["DictState", "NestedState"])
def test_an_initial_state_that_is_not_tensors_is_refused_in_one_line(name: str) -> None:
    """It raised AttributeError, which neither the broker (refusing a model that does not fit
    the spaces) nor the learner (CannotStart) catches: a traceback instead of one line."""
    with pytest.raises(ValueError, match="initial_state gave"):
        policy.make_policy(f"test_hostile_models:{name}", SPEC)
    with pytest.raises(ValueError, match="initial_state gave"):
        torch_policy.StateLayout(globals()[name]())


@pytest.mark.parametrize("fields", [
    {"action_kind": "multi_discrete", "action_shape": [0, 5], "action_nvec": []},
    {"action_kind": "multi_discrete", "action_shape": [-1, -2], "action_nvec": [2, 2]},
    {"action_kind": "multi_binary", "action_shape": [2], "action_nvec": [3, 3]},
], ids=["no dimensions", "negative", "three-valued bits"])
def test_multi_actions_of_no_size_or_wrong_counts_are_refused(fields: dict[str, Any]) -> None:
    """A head of zero logits (the torch model then built a Gaussian one), a shape no array
    has, or bits of three values were accepted."""
    assert checks.spec_problem(p.SpaceSpec(SPEC.obs_shape, SPEC.obs_dtype, **fields))
