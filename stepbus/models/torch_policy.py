"""Any CleanRL-shaped `torch.nn.Module` as a `stepbus.policy.Policy`: what the broker acts with
for `--model torch` or `--model module:factory`.

The module has CleanRL's agent methods: ``get_action_and_value(obs, action=None) -> (action,
logprob, entropy, value)`` and ``get_value(obs)``. Greedy acting (`act(..., deterministic=True)`)
passes ``deterministic=True`` to a ``get_action_and_value`` that takes it (the built-in agents
do: the distribution's mode); for one that does not, categorical actions are the most likely
category of each dimension, found by scoring each one with the module's own log-prob (exact
for CleanRL's heads, whose dimensions are independent), and Box actions cannot be had (a
Gaussian's mean is not among CleanRL's outputs): `greedy_problem` says so.

Its weights travel as they do for the numpy MLP, a flat map of named numpy arrays: the
module's ``state_dict``, one raw frame per tensor. A broker judges weights against its own
module's state_dict (names, shapes, dtypes, finite values) and acts once with them (the module
left as it is) before loading them, so weights of another model, or ones whose outputs are not
finite, are refused, never half-loaded.

Importing this module imports torch: only a process configured with a torch model does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import nn

from stepbus import spaces
from stepbus.bus import protocol as p
from stepbus.bus import rows
from stepbus.models.base import ModelUnavailable, NoWeights, Params, Policy, State

TRIAL_ROWS = 2  # a module acts once on this many zero observations (and as many of the last
# it acted on), to see it fits and, with new weights, that they act


class Agent(Protocol):
    """What a model's module must have: CleanRL's agent methods. `action` given: its
    log-prob; None: one sampled. Values may be ``(B,)`` or ``(B, 1)``."""

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ...

    def get_value(self, x: torch.Tensor) -> torch.Tensor: ...


class RecurrentAgent(Protocol):
    """A recurrent model's module (CleanRL ``ppo_atari_lstm.py``'s methods): `state` as
    `initial_state` makes it, `done` one bool per row."""

    def initial_state(self, batch_size: int) -> Any: ...

    def get_action_and_value(self, x: Any, state: Any, done: torch.Tensor,
                             action: torch.Tensor | None = None, **mask: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        Any]:
        ...

    def get_value(self, x: Any, state: Any, done: torch.Tensor) -> torch.Tensor: ...


def agent(module: nn.Module) -> Agent:
    """The module as the agent `build` checked it is."""
    return cast(Agent, module)


def recurrent_agent(module: nn.Module) -> RecurrentAgent:
    """The module as a recurrent agent (it has `initial_state`)."""
    return cast(RecurrentAgent, module)


class StateLayout:
    """How a recurrent module lays out its state (a tensor, or a tuple or list of them, each
    with its batch on an axis of its own, as an LSTM's ``(layers, B, hidden)``), and the same
    state as stepbus holds it: arrays named "0", "1", ..., the batch first.

    Raises:
        ValueError: `initial_state` fails, or its batch axis cannot be told from its shapes.
    """

    def __init__(self, module: nn.Module) -> None:
        make = recurrent_agent(module).initial_state
        try:
            with torch.no_grad():
                one, two = make(1), make(2)
        except Exception as exc:  # user code: one line
            raise ValueError(f"initial_state failed: {type(exc).__name__}: {exc}") from exc
        self.nested = isinstance(one, tuple | list)
        ones, twos = (list(one), list(two)) if self.nested else ([one], [two])
        if not all(isinstance(t, torch.Tensor) for t in (*ones, *twos)) or len(ones) != len(twos):
            raise ValueError(f"initial_state gave a {type(one).__name__}: it must give a tensor, "
                             "or a tuple or list of tensors, the same number for any batch")
        self.axes = []
        for a, b in zip(ones, twos, strict=True):
            axes = [i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y]
            if len(a.shape) != len(b.shape) or len(axes) != 1 or (a.shape[axes[0]],
                                                                   b.shape[axes[0]]) != (1, 2):
                raise ValueError(f"initial_state(1) and (2) give shapes {tuple(a.shape)} and "
                                 f"{tuple(b.shape)}: one axis must be the batch")
            self.axes.append(axes[0])

    def rows(self, state: Any) -> State:
        """The module's state as stepbus holds it (numpy, batch first)."""
        parts = list(state) if self.nested else [state]
        return {str(i): np.moveaxis(t.detach().cpu().numpy(), axis, 0).copy()
                for i, (t, axis) in enumerate(zip(parts, self.axes, strict=True))}

    def module(self, state: State, device: torch.device) -> Any:
        """Rows of states as the module takes them."""
        parts = [torch.from_numpy(np.ascontiguousarray(np.moveaxis(state[str(i)], 0, axis)))
                 .to(device) for i, axis in enumerate(self.axes)]
        return tuple(parts) if self.nested else parts[0]


def configure(device: str, threads: int) -> None:
    """Process-wide torch settings, checked before the process starts.

    Raises:
        ModelUnavailable: a device that is not cpu or cuda[:N], CUDA asked for but not
            available, or fewer than one thread.
    """
    if threads < 1:
        raise ModelUnavailable(f"--torch-threads {threads}: at least 1")
    dev = torch_device(device)
    torch.set_num_threads(threads)
    if dev.type == "cuda":  # CUDA's start (seconds) now, not inside the loop's first handler
        torch.zeros(1, device=dev)


def torch_device(device: str) -> torch.device:
    """Raises ModelUnavailable for anything but cpu, or cuda when CUDA is available."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ModelUnavailable(f"--device {device!r}: {exc}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ModelUnavailable(f"--device {device!r}: use cpu or cuda[:N]")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelUnavailable(f"--device {device}: CUDA is not available here "
                                   "(torch.cuda.is_available() is False); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelUnavailable(f"--device {device}: only {torch.cuda.device_count()} "
                                   "CUDA devices here")
    return dev


def gym_spaces(spec: p.SpaceSpec) -> tuple[Any, Any]:
    """The Gymnasium (observation_space, action_space) a worker's declared spaces stand for:
    what a model factory is given (`stepbus.spaces`; Box bounds do not travel)."""
    return spaces.observation_space(spec), spaces.action_space(spec)


def as_input(obs: np.ndarray, device: torch.device) -> torch.Tensor:
    """Observations as a module takes them: floats as float32, anything else (uint8 frames)
    as it is, for the module to convert and scale."""
    array = np.asarray(obs)
    if array.dtype.kind == "f" and array.dtype != np.float32:
        array = array.astype(np.float32)
    if not array.flags.writeable:
        array = array.copy()  # torch wants memory it may write; frames off the wire are not
    return torch.from_numpy(array).to(device)


def module_input(spec: p.SpaceSpec, obs: Mapping[str, Any] | np.ndarray | torch.Tensor,
                 device: torch.device) -> Any:
    """A batch as the module takes it: one tensor for a Box observation, else the env's own
    nesting (dicts and tuples) of tensors (`spaces.structured`), the mask from `info` left out.
    Leaves may already be tensors (a learner's minibatch)."""
    def tensor(value: Any) -> torch.Tensor:
        return value if isinstance(value, torch.Tensor) else as_input(value, device)

    if not isinstance(obs, Mapping):
        return tensor(obs)
    return spaces.structured(spec, {key: tensor(value) for key, value in obs.items()})


def mask_input(spec: p.SpaceSpec, obs: p.Obs, device: torch.device) -> dict[str, torch.Tensor]:
    """`action_mask=` for the module when the env gives a mask, else nothing: a module
    without the parameter still acts on an env without masks."""
    mask = spaces.mask(spec, obs)
    return {} if mask is None else {"action_mask": torch.from_numpy(mask).to(device)}


def state_arrays(module: nn.Module) -> Params:
    """The module's state_dict as numpy copies: its weights as WEIGHTS carries them."""
    return {name: tensor.detach().cpu().contiguous().numpy().copy()
            for name, tensor in module.state_dict().items()}


def load_arrays(module: nn.Module, params: Mapping[str, np.ndarray]) -> None:
    """Weights `layout_problem` passed, into the module (strict: every name)."""
    device = next(iter(module.state_dict().values())).device
    module.load_state_dict({name: torch.from_numpy(np.array(value)).to(device)
                            for name, value in params.items()})


def layout_problem(want: Mapping[str, torch.Tensor], params: Mapping[str, np.ndarray]) -> str:
    """Why `params` cannot be a state_dict like `want` ("" if they can): the same names,
    shapes and dtypes, and finite floats."""
    missing = [name for name in want if name not in params]
    unexpected = [name for name in params if name not in want]
    if missing or unexpected:
        return (f"not this model's weights (another --model?): missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}")[:200]
    for name, tensor in want.items():
        value = params[name]
        if not isinstance(value, np.ndarray):
            return f"{name} is not an array"
        if value.shape != tuple(tensor.shape):
            return f"{name} of shape {value.shape}, this model's is {tuple(tensor.shape)}"
        if str(value.dtype) != str(tensor.dtype).removeprefix("torch."):
            return f"{name} of dtype {value.dtype}, this model's is {tensor.dtype}"
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            return f"non-finite values in {name}"
    return ""


class TorchPolicy(Policy):
    """A CleanRL-shaped module acting for the broker: inference under ``torch.no_grad()``,
    sampling seeded from the broker's generator, so a seeded run acts the same way twice."""

    def __init__(self, spec: p.SpaceSpec, module: nn.Module, *, device: str = "cpu") -> None:
        super().__init__(spec)
        self.device = torch_device(device)
        self.module = module.to(self.device)
        self.layout = {name: t.detach() for name, t in self.module.state_dict().items()}
        self.recent: p.Obs | None = None  # the first rows of the last batch it acted on
        self.memory = (StateLayout(self.module) if callable(getattr(self.module, "initial_state",
                                                                     None)) else None)
        self.takes_deterministic = takes_keyword(self.module, "deterministic")

    @property
    def greedy_problem(self) -> str:
        """Why this module cannot act greedily ("" if it can): Box actions from a module whose
        get_action_and_value takes no ``deterministic`` keyword."""
        if self.takes_deterministic or self.action.categorical:
            return ""
        return (f"{type(self.module).__name__}.get_action_and_value takes no deterministic= "
                "keyword, and a Box action's mean is not among CleanRL's outputs: give it "
                "`deterministic: bool = False` (True: return the mean), or act stochastically")

    @classmethod
    def of_factory(cls, factory: Callable[..., Any], spec: p.SpaceSpec, *, name: str,
                   device: str = "cpu") -> TorchPolicy:
        """The module `factory(observation_space, action_space)` makes, once it acted on a
        trial batch with outputs of the right shapes.

        Raises:
            ValueError: the factory fails, makes no such module, or it does not fit the spaces.
        """
        module = build(factory, spec, name)
        made = cls(spec, module, device=device)
        problem = made.trial()
        if problem:
            raise ValueError(f"--model {name} does not fit {spec}: {problem}")
        return made

    def prepare(self, params: Mapping[str, np.ndarray]) -> None:
        load_arrays(self.module, params)

    @property
    def recurrent(self) -> bool:
        return self.memory is not None

    def initial_state(self, n: int) -> State:
        assert self.memory is not None
        with torch.no_grad():
            return self.memory.rows(recurrent_agent(self.module).initial_state(n))

    def act(self, obs: p.Obs, rng: np.random.Generator, deterministic: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.loaded:
            raise NoWeights("the torch policy has no weights yet")
        # A copy: frames off the wire are reused.
        self.recent = rows.copy(rows.take(obs, slice(0, TRIAL_ROWS)))
        return self._act(obs, rng, deterministic)

    def act_recurrent(self, obs: p.Obs, state: State, rng: np.random.Generator,
                      deterministic: bool = False
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, State]:
        if not self.loaded:
            raise NoWeights("the torch policy has no weights yet")
        self.recent = rows.copy(rows.take(obs, slice(0, TRIAL_ROWS)))
        return self._act_recurrent(obs, state, rng, deterministic)

    def _act(self, obs: p.Obs, rng: np.random.Generator, deterministic: bool = False
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A feed-forward module's outputs; a recurrent one's from the initial state."""
        if self.memory is not None:
            return self._act_recurrent(obs, self.initial_state(rows.count(obs)), rng,
                                       deterministic)[:3]
        self.seed(rng)
        call = _Call(self, obs, None)
        action, logp, value, _ = self.greedy(call) if deterministic else call()
        return self.outputs(rows.count(obs), action, logp, value, deterministic)

    def _act_recurrent(self, obs: p.Obs, state: State, rng: np.random.Generator,
                       deterministic: bool = False
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, State]:
        assert self.memory is not None
        self.seed(rng)
        call = _Call(self, obs, self.memory.module(state, self.device))
        action, logp, value, after = self.greedy(call) if deterministic else call()
        return (*self.outputs(rows.count(obs), action, logp, value, deterministic),
                self.memory.rows(after))

    def greedy(self, call: _Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """The mode: the module's own when it takes ``deterministic``, else each categorical
        dimension's category of highest log-prob, the others held at 0 (exact when the
        dimensions are independent, as in CleanRL's heads).

        Raises:
            ModelUnavailable: Box actions from a module that cannot give its mean.
        """
        if self.takes_deterministic:
            return call(deterministic=True)
        if self.greedy_problem:
            raise ModelUnavailable(self.greedy_problem)
        b = call.rows
        base = torch.zeros((b, len(self.action.categories)), dtype=torch.long,
                           device=self.device)
        best = base.clone()
        for j, n in enumerate(self.action.categories):
            scores = []
            for k in range(n):
                candidate = base.clone()
                candidate[:, j] = k
                scores.append(call(candidate.reshape(b, *self.action.batch_shape))[1].reshape(b))
            best[:, j] = torch.stack(scores, 1).argmax(1)
        return call(best.reshape(b, *self.action.batch_shape))

    def outputs(self, b: int, action: torch.Tensor, logp: torch.Tensor, value: torch.Tensor,
                deterministic: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The module's outputs as the broker sends them (a greedy Box action clipped)."""
        actions: np.ndarray = action.reshape(b, *self.action.batch_shape).cpu().numpy().astype(
            self.action.dtype)
        if deterministic:
            actions = self.action.clipped(actions)
        return (actions, logp.reshape(b).to(torch.float32).cpu().numpy(),
                value.reshape(b).to(torch.float32).cpu().numpy())

    def seed(self, rng: np.random.Generator) -> None:
        """Sampling draws from the generator of the module's device, seeded from `rng` at
        every batch (the CPU one alone: `torch.manual_seed` costs 40 times more)."""
        seed = int(rng.integers(2**63))
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)

    def weights_problem(self, params: Mapping[str, np.ndarray]) -> str:
        """The state_dict's layout and finite values, then one trial step with these weights:
        finite weights can still make non-finite logits, which would fail sampling mid-run."""
        try:
            return layout_problem(self.layout, params) or self.trial(params)
        except Exception as exc:  # anything off the wire is judged, never raised
            return f"{type(exc).__name__}: {exc}"[:200]

    def trial(self, params: Mapping[str, np.ndarray] | None = None) -> str:
        """Why the module cannot act on these spaces ("" if it can), with its own weights or
        with `params` (the module is left as it is): one batch of zeros and of the last rows
        it acted on, whose outputs must have one row each, the action's shape, finite values."""
        obs = self.zeros(TRIAL_ROWS)
        if self.recent is not None:
            obs = rows.concat([obs, self.recent])
        try:
            if params is None:
                actions, logp, value, v = self.trial_outputs(obs)
            else:  # the module's forward, with `params` in place of its state for this call
                state = {f"module.{name}": torch.from_numpy(np.array(value)).to(self.device)
                         for name, value in params.items()}
                actions, logp, value, v = torch.func.functional_call(_Trial(self), state,
                                                                     (obs,))
        except Exception as exc:  # user code: one line saying what went wrong
            said = "a trial step with them failed: " if params is not None else ""
            return f"{said}{type(exc).__name__}: {exc}"[:300]
        return self.outputs_problem(rows.count(obs), actions, logp, value, v)

    def trial_outputs(self, obs: p.Obs
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor]:
        """What the module makes of `obs`: `_act`'s outputs, and `get_value`'s."""
        actions, logp, value = self._act(obs, np.random.default_rng(0))
        x = module_input(self.spec, obs, self.device)
        with torch.no_grad():
            if self.memory is None:
                v = agent(self.module).get_value(x)
            else:
                n = rows.count(obs)
                v = recurrent_agent(self.module).get_value(
                    x, self.memory.module(self.initial_state(n), self.device),
                    torch.zeros(n, dtype=torch.bool, device=self.device))
        return actions, logp, value, v

    def outputs_problem(self, n: int, actions: np.ndarray, logp: np.ndarray,
                        value: np.ndarray, v: torch.Tensor) -> str:
        """Why a trial step's outputs are not what acting needs ("" if they are)."""
        problem = spaces.actions_problem(self.spec, actions, n)
        if problem:
            return problem
        if v.numel() != n:
            return f"get_value gave {tuple(v.shape)}, expected one value per row"
        if not (np.isfinite(logp).all() and np.isfinite(value).all()):
            return "non-finite log-prob or value"
        return ""


class _Call:
    """One forward of a policy's module on a batch (and, for a recurrent module, the state it
    starts from), under ``torch.no_grad()``: called with an action for its log-prob, without
    one for a sampled (or, `deterministic`, the module's greedy) action."""

    def __init__(self, policy: TorchPolicy, obs: p.Obs, state: Any) -> None:
        self.module, self.state = policy.module, state
        self.rows = rows.count(obs)
        self.x = module_input(policy.spec, obs, policy.device)
        self.mask = mask_input(policy.spec, obs, policy.device)
        self.done = torch.zeros(self.rows, dtype=torch.bool, device=policy.device)

    def __call__(self, action: torch.Tensor | None = None, deterministic: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """(action, log-prob, value, the state after: None for a feed-forward module)."""
        kwargs: dict[str, Any] = dict(self.mask)
        if action is not None:
            kwargs["action"] = action
        if deterministic:
            kwargs["deterministic"] = True
        with torch.no_grad():
            if self.state is None:
                taken, logp, _, value = agent(self.module).get_action_and_value(self.x, **kwargs)
                return taken, logp, value, None
            taken, logp, _, value, after = recurrent_agent(self.module).get_action_and_value(
                self.x, self.state, self.done, **kwargs)
        return taken, logp, value, after


def takes_keyword(module: nn.Module, name: str) -> bool:
    """Whether the module's get_action_and_value has a parameter `name` (not just **kwargs)."""
    try:
        method = cast(Callable[..., Any], agent(module).get_action_and_value)
        return name in inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin or odd callable: assume not
        return False


class _Trial(nn.Module):
    """A policy's trial step as the forward of a module that holds the policy's module, so
    `torch.func.functional_call` runs it with other weights in place of the module's own."""

    def __init__(self, policy: TorchPolicy) -> None:
        super().__init__()
        self.module, self.policy = policy.module, policy

    def forward(self, obs: p.Obs
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor]:
        return self.policy.trial_outputs(obs)


def build(factory: Callable[..., Any], spec: p.SpaceSpec, name: str) -> nn.Module:
    """`factory(observation_space, action_space)`, checked to be a CleanRL-shaped module.

    Raises:
        ValueError: the factory fails or makes something else.
    """
    observation_space, action_space = gym_spaces(spec)
    try:
        module = factory(observation_space, action_space)
    except Exception as exc:  # user code: one line saying what went wrong
        raise ValueError(f"--model {name} failed to build for {spec}: "
                         f"{type(exc).__name__}: {exc}") from exc
    if isinstance(module, Policy):
        raise ValueError(f"--model {name}: a Policy is built from the spec by its class; "
                         "name the class, not a function that makes one")
    if not isinstance(module, nn.Module):
        raise ValueError(f"model {name!r} made a {type(module).__name__}, not a Policy or a "
                         "torch.nn.Module")
    missing = [m for m in ("get_action_and_value", "get_value")
               if not callable(getattr(module, m, None))]
    if missing:
        raise ValueError(f"--model {name}: the module has no {' or '.join(missing)} "
                         "(CleanRL's agent methods; see docs/models.md)")
    if not module.state_dict():
        raise ValueError(f"--model {name}: the module has no parameters to learn")
    return module
