"""The stepbus wire protocol: every message kind, its fields, the codec, and nothing else.

A message is one multipart ZeroMQ message::

    frame 0      msgpack header: [VERSION, kind, {field: value}, [[name, dtype, shape], ...]]
    frame 1..n   the raw bytes of each numpy array named in the header, in order

Arrays never pass through msgpack, so observation bytes are neither copied nor re-encoded between
an environment and the wire, and a broker can forward a worker's array frames untouched. The
decoder trusts nothing: it accepts only declared kinds and fields, numeric and bool dtypes, shapes
that match byte lengths, and sizes under bounds. Every failure becomes one `ProtocolError`.

Who sends what (sender -> receiver, socket pair):

    WORKER_HELLO      worker -> broker          DEALER -> ROUTER   env spec; repeated while idle
    HEARTBEAT         worker -> broker          DEALER -> ROUTER   alive, busy in a long step
    REMOTE_ERROR      worker -> broker          DEALER -> ROUTER   an env raised (reset barriers)
    RESET             broker -> worker          ROUTER -> DEALER   reset every env (or `rows`) with
                                                                   options (and per-env `seeds`)
    STEP              broker -> worker          ROUTER -> DEALER   one action batch
    STEP_RESULT       worker -> broker          DEALER -> ROUTER   one reply per action batch
    VECTOR_HELLO      vector -> broker          DEALER -> ROUTER   a vector env client attaches
    VECTOR_SPEC       broker -> vector          ROUTER -> DEALER   spaces and workers (each change)
    RESET, STEP       vector -> broker -> worker                   `worker` names the one meant
    STEP_RESULT       worker -> broker -> vector                   relayed, `worker` set
    WORKER_LOST       broker -> vector          ROUTER -> DEALER   a worker died or restarted
    HEARTBEAT         broker -> vector          ROUTER -> DEALER   the relay is alive
    ENV_CALL          vector -> broker -> worker                   call/get/set an env attribute
    ENV_CALL_RESULT   worker -> broker -> vector                   each env's value, as data
    EXPERIENCE        broker -> assembler       PUSH   -> PULL     a step result + policy outputs
    TRAJECTORY        assembler -> trainer      PUSH   -> PULL     one agent's contiguous steps
    TRAJECTORIES      assembler -> trainer      PUSH   -> PULL     several of one policy, batched
    TRAINER_HELLO     trainer -> broker         DEALER -> ROUTER   asks for the env spec
    ENV_SPEC          broker -> trainer         ROUTER -> DEALER   spaces the workers declared
    WEIGHTS           trainer -> broker         DEALER -> ROUTER   versioned policy parameters
    HEARTBEAT         any -> controller         DEALER -> ROUTER   registration, liveness, figures
    RUN_STATE         controller -> any         ROUTER -> DEALER   reply to every HEARTBEAT; the
                                                                   run's epoch, endpoints, horizon
    STATUS_REQUEST    cli -> controller         DEALER -> ROUTER
    STATUS_REPLY      controller -> cli         ROUTER -> DEALER
    RESET_REQUEST     cli/trainer -> controller DEALER -> ROUTER   start a reset barrier
    SHUTDOWN_REQUEST  cli/trainer -> controller DEALER -> ROUTER
    REPLY             controller -> cli         ROUTER -> DEALER   outcome of a request
    BARRIER           controller -> broker      PUB    -> SUB      pause, drain, reset, resume
    BARRIER_DONE      broker -> controller      DEALER -> ROUTER   every live env was reset
    SHUTDOWN          controller -> all         PUB    -> SUB      finish duties and exit 0
    REMOTE_ERROR      any -> controller         DEALER -> ROUTER   an error, as data
    WORKER_LOST       broker -> assembler       PUSH   -> PULL     close its open trajectories
    RECEIPT           trainer -> assembler      PUSH   -> PULL     trajectories taken in (acks)
    TRAINER_SWAP      cli -> controller -> slot DEALER -> ROUTER   replace the running learner
    REPLY             slot -> controller        DEALER -> ROUTER   outcome of a swap, relayed
    WEIGHTS           trainer -> evaluator      DEALER -> ROUTER   each new version, if one listens
    EVAL_RESULT       evaluator -> trainer      ROUTER -> DEALER   greedy return of one version
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import operator
import reprlib
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

import msgpack
import numpy as np

from stepbus.bus import rows
from stepbus.bus.rows import Obs

PROTOCOL_VERSION = 13  # 2: RUN_STATE's horizon; 3: SpaceSpec's goal; 4: every Gymnasium space;
# 5: vector envs (RESET's seeds, rows and modes, the relay's kinds); 6: WEIGHTS' checkpointed_steps;
# 7: SpaceSpec's goal_note; 8: EVAL_RESULT; 9: env infos (RESET's infos, STEP_RESULT's);
# 10: WEIGHTS' run; 11: trajectories' bootstrap_from_last, STEP_RESULT's no_final_obs;
# 12: RECEIPT's max_policy_lag; 13: WEIGHTS' policy_lag and max_policy_lag

# Decoding cost grows with the header's bytes and its lists and maps (each one allocated,
# checked, freed), so both are bounded: any header, valid or not, decodes in at most 3 to 4
# times the CPU of unpacking a plain header of 4,000 step records (tests/test_codec.py).
MAX_HEADER_BYTES = 64 << 10
MAX_ERROR_TEXT = 16 << 10  # a REMOTE_ERROR's message and traceback are cut to fit a header
MAX_HEADER_CONTAINERS = 4096
MAX_ARRAYS = 256
MAX_NDIM = 8
MAX_ARRAY_BYTES = 1 << 30
MAX_JSON_DEPTH = 4
MAX_TRAJECTORIES_PER_MESSAGE = 256  # in one TRAJECTORIES message

# Numeric and bool only: no object, string, void or datetime dtypes ever come off the wire.
ALLOWED_DTYPES = frozenset(
    np.dtype(name).str
    for name in (
        "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "float32", "float64",
    )
)
_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}  # built once, not per array


class ProtocolError(ValueError):
    """Raised for any bytes that are not a valid stepbus message; `reason` is a short category."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class RemoteFailure(RuntimeError):
    """A REMOTE_ERROR raised again where it arrives, every field kept: the side that gets it
    can show the remote error as it was (type, message, traceback, where) or act on its type."""

    def __init__(self, origin: str, error_type: str, message: str, traceback: str = "",
                 context: dict[str, Json] | None = None) -> None:
        super().__init__(f"{error_type} in {origin}: {message}")
        self.origin = origin
        self.error_type = error_type
        self.message = message
        self.traceback = traceback
        self.context = context or {}

    @classmethod
    def of(cls, msg: RemoteError) -> RemoteFailure:
        return cls(msg.origin, msg.error_type, msg.message, msg.traceback, msg.context)


class Kind(enum.IntEnum):
    WORKER_HELLO = 1
    RESET = 2
    STEP = 3
    STEP_RESULT = 4
    EXPERIENCE = 5
    TRAJECTORY = 6
    TRAINER_HELLO = 7
    ENV_SPEC = 8
    WEIGHTS = 9
    HEARTBEAT = 11
    RUN_STATE = 12
    STATUS_REQUEST = 13
    STATUS_REPLY = 14
    RESET_REQUEST = 15
    SHUTDOWN_REQUEST = 16
    REPLY = 17
    BARRIER = 18
    BARRIER_DONE = 19
    SHUTDOWN = 20
    REMOTE_ERROR = 21
    WORKER_LOST = 22
    RECEIPT = 23
    TRAINER_SWAP = 24
    TRAJECTORIES = 25
    VECTOR_HELLO = 26
    VECTOR_SPEC = 27
    ENV_CALL = 28
    ENV_CALL_RESULT = 29
    EVAL_RESULT = 30


# A JSON-like value (str keys, scalars, lists, maps) of bounded depth: options, figures, status.
Json = Any
ArrayMap = dict[str, np.ndarray]
# Obs (stepbus.bus.rows): a batch of observations, one array for a Box observation space, else
# a map of leaf key to array (`LeafSpec.key`), each leaf its own frame on the wire.
R = TypeVar("R")


# ---------------------------------------------------------------------------------------------
# What a field may be. In the header: bool, int, float, str, Json, a list or str-keyed map of
# those, a record (a frozen dataclass of such fields, carried as the map of its fields, like
# SpaceSpec), or an optional of any of these. As frames: np.ndarray, an optional one, or an
# ArrayMap. Each field's check is built once, when its message class is defined: an
# annotation the codec cannot carry is a TypeError there, never a refusal of every such
# message at run time.

_ARRAY, _OPT_ARRAY, _ARRAY_MAP, _OBS = "array", "optional array", "array map", "observations"
_PLAIN_ARRAYS = (_ARRAY, _OPT_ARRAY, _OBS)  # kinds of field an array fills by its own name


def _is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType) and type(None) in typing.get_args(
        hint
    )


def _strip_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 else functools.reduce(operator.or_, args)


def _array_how(hint: Any) -> str:
    """How an array field travels (_ARRAY, _OPT_ARRAY, _ARRAY_MAP, _OBS: an array or a map);
    "" for a header field."""
    if hint == Obs:
        return _OBS
    if hint is np.ndarray:
        return _ARRAY
    if _is_optional(hint) and _strip_optional(hint) is np.ndarray:
        return _OPT_ARRAY
    return _ARRAY_MAP if hint == ArrayMap else ""


def _is_record(hint: Any) -> bool:
    return (isinstance(hint, type) and dataclasses.is_dataclass(hint)
            and not issubclass(hint, Message))


_JSON_SCALARS = frozenset({type(None), bool, int, float, str})
_JSON_CONTAINERS = frozenset({list, dict})
_JSON_TYPES = _JSON_SCALARS | _JSON_CONTAINERS
_STR_ONLY = frozenset({str})
# Exact types, as msgpack makes them: bool is not an int here, an int is a float.
_EXACT_TYPES = {bool: frozenset({bool}), int: frozenset({int}), float: frozenset({int, float}),
                str: _STR_ONLY}


def _check_json(value: Any, depth: int = 0) -> bool:
    """Str keys, scalars, lists and maps, nested at most MAX_JSON_DEPTH below `value`.

    Whole containers are type-checked at C speed (`set.issuperset(map(type, ...))`) and only
    nested containers are visited one by one, so a header of 60,000 small values costs well
    under a millisecond. Depth -1 checks the items of a field typed `dict[str, Json]` or
    `list[Json]`, each of which may nest MAX_JSON_DEPTH deep itself.
    """
    kind = type(value)
    if kind is dict:
        if not _STR_ONLY.issuperset(map(type, value)):
            return False
        items: Any = value.values()
    elif kind is list:
        items = value
    else:
        return kind in _JSON_SCALARS and depth <= MAX_JSON_DEPTH
    if depth >= MAX_JSON_DEPTH:
        return not items  # a container at the last level may only be empty
    kinds = set(map(type, items))
    if not kinds <= _JSON_TYPES:
        return False
    if kinds <= _JSON_SCALARS:
        return True
    nested = itertools.compress(items, map(_JSON_CONTAINERS.__contains__, map(type, items)))
    return all(_check_json(v, depth + 1) for v in nested)


F = TypeVar("F", bound=Callable[..., Any])


def _once_per_class(fn: F) -> F:
    """Memoised: a record's checks and conversions are built once per class."""
    return typing.cast(F, functools.cache(fn))


@_once_per_class
def _hints(cls: type) -> dict[str, Any]:
    """A class's annotations, evaluated (each a compile of its text: done once, when a process
    first needs the class, not for every class at import)."""
    return typing.get_type_hints(cls)


def _checker(hint: Any) -> Callable[[Any], bool]:
    """The check of a header value against its annotation, built once per field: inspecting
    the annotation on every message was a third of the decoder's time.

    Raises:
        TypeError: for an annotation the codec cannot carry.
    """
    if hint is Json:
        return _check_json
    if _is_optional(hint):
        inner = _checker(_strip_optional(hint))
        return lambda value: value is None or inner(value)
    exact = _EXACT_TYPES.get(hint)
    if exact is not None:
        return lambda value: type(value) in exact
    if _is_record(hint):
        return _record_checker(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if (origin is list and len(args) == 1) or (origin is dict and args[:1] == (str,)):
        return _container_checker(origin, args[-1])
    raise TypeError(f"the codec cannot carry a field of type {hint!r}: see 'What a field may "
                    "be' in stepbus.bus.protocol")


def _container_checker(origin: Any, item: Any) -> Callable[[Any], bool]:
    """The check of a `list[item]` or `dict[str, item]` value."""
    item_exact = _EXACT_TYPES.get(item)
    check_item = None if item is Json or item_exact is not None else _checker(item)

    def check(value: Any) -> bool:
        if type(value) is not origin:
            return False
        if item is Json:
            return _check_json(value, -1)
        if origin is dict and not _STR_ONLY.issuperset(map(type, value)):
            return False
        items = value.values() if origin is dict else value
        if item_exact is not None:
            return item_exact.issuperset(map(type, items))
        return all(map(check_item, items))  # type: ignore[arg-type]

    return check


@_once_per_class
def _record_checks(cls: type) -> dict[str, Callable[[Any], bool]]:
    """Each field's check of a record class."""
    if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"record {cls.__name__} must be a frozen dataclass")
    hints = _hints(cls)
    checks = {}
    for f in dataclasses.fields(cls):
        if _array_how(hints[f.name]):
            raise TypeError(f"{cls.__name__}.{f.name}: arrays travel only as a message's own "
                            "fields, not inside a record")
        try:
            checks[f.name] = _checker(hints[f.name])
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.{f.name}: {exc}") from None
    return checks


@_once_per_class
def _record_checker(cls: type) -> Callable[[Any], bool]:
    """A record travels as the map of exactly its fields, each of which passes its check."""
    checks = _record_checks(cls)

    def check(value: Any) -> bool:
        return (type(value) is dict and value.keys() == checks.keys()
                and all(ok(value[name]) for name, ok in checks.items()))

    return check


def _record_problem(cls: type, value: Any) -> str:
    """What is wrong with a map that failed `cls`'s check, for the refusal's detail."""
    if type(value) is not dict:
        return f"{cls.__name__}: {_brief(value)}"
    checks = _record_checks(cls)
    missing = [name for name in checks if name not in value]
    unexpected = list(itertools.islice(itertools.filterfalse(checks.__contains__, value), 3))
    if missing or unexpected:
        return f"{cls.__name__}: missing {missing}, unexpected {_brief(unexpected)}"[:160]
    bad = next((name for name, ok in checks.items() if not ok(value[name])), "")
    return f"{cls.__name__}.{bad}: {_brief(value.get(bad))}"[:160]


def _build_record(cls: type[R], value: dict[str, Any]) -> R:
    """A checked map -> its record. A record's own validation failing is a ProtocolError."""
    values = dict(value)
    for name, build in _converters(cls, _builder_of).items():
        values[name] = build(values[name])
    try:
        return cls(**values)
    except Exception as exc:
        raise ProtocolError("bad field", f"{cls.__name__}: {type(exc).__name__}: {exc}"[:160]
                            ) from None


def _builder_of(cls: type) -> Callable[[Any], Any]:
    return functools.partial(_build_record, cls)


def _mapper_of(cls: type) -> Callable[[Any], Any]:
    return to_map


def _convert(hint: Any, on_record: Callable[[type], Callable[[Any], Any]]
             ) -> Callable[[Any], Any] | None:
    """What applies `on_record(cls)` to every record in a value of type `hint`; None if the
    type holds no record (the value is used as it is)."""
    if _is_optional(hint):
        inner = _convert(_strip_optional(hint), on_record)
        return None if inner is None else lambda value: None if value is None else inner(value)
    if _is_record(hint):
        return on_record(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    item = _convert(args[-1], on_record) if origin in (list, dict) and args else None
    if item is None:
        return None
    if origin is list:
        return lambda value: [item(v) for v in value]
    return lambda value: {key: item(v) for key, v in value.items()}


@_once_per_class
def _converters(cls: type, on_record: Callable[[type], Callable[[Any], Any]]
                ) -> dict[str, Callable[[Any], Any]]:
    """The fields of a dataclass that hold records, each with its conversion."""
    hints = _hints(cls)
    found = ((f.name, _convert(hints[f.name], on_record)) for f in dataclasses.fields(cls))
    return {name: convert for name, convert in found if convert is not None}


def to_map(record: Any) -> dict[str, Any]:
    """A record as the map it travels as (records inside it as maps too)."""
    values = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    for name, convert in _converters(type(record), _mapper_of).items():
        values[name] = convert(values[name])
    return values


def from_map(cls: type[R], value: Any) -> R:
    """The record of class `cls` a map holds, checked as a message field of that type is.

    Raises:
        ProtocolError: "bad field", naming what is missing, unexpected or of the wrong type.
    """
    if not _record_checker(cls)(value):
        raise ProtocolError("bad field", _record_problem(cls, value))
    return _build_record(cls, value)


class Message:
    """Base of every message dataclass; `KIND` ties the class to its wire kind."""

    KIND: ClassVar[Kind]


@dataclass(frozen=True)
class LeafSpec:
    """One leaf of an observation that is not a single Box (`stepbus.spaces`): its key in the
    observation map, one row's shape and dtype, what it is, and where it sits in the env's own
    space (the Dict keys and Tuple indices leading to it, and which each container is)."""

    key: str
    kind: str  # "box", "discrete", "multi_discrete", "multi_binary", or "mask" (from info)
    shape: list[int]
    dtype: str
    path: list[str] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)  # "dict" or "tuple", one per path step
    nvec: list[int] = field(default_factory=list)  # categories: [n], or each dimension's, flat
    start: list[int] = field(default_factory=list)  # the lowest value of each, flat


@dataclass(frozen=True)
class SpaceSpec:
    """Observation and action spaces, as workers declare them and learners build policies,
    and the env's own goal, which a learner without --target-return stops at.

    A Box observation is `obs_shape`/`obs_dtype` and travels as one array; any other (Discrete,
    MultiDiscrete, MultiBinary, Tuple, Dict, or a Box with an action mask from `info`) is
    `obs_leaves`, and travels as a map of those leaves (`obs_shape` is then empty).
    """

    obs_shape: list[int]
    obs_dtype: str
    action_kind: str  # "discrete", "box", "multi_discrete" or "multi_binary"
    action_n: int = 0
    action_shape: list[int] = field(default_factory=list)
    action_low: list[float] = field(default_factory=list)
    action_high: list[float] = field(default_factory=list)
    # The env's own `spec.reward_threshold` (None: it has none): the learner's default target.
    reward_threshold: float | None = None
    obs_leaves: list[LeafSpec] = field(default_factory=list)
    action_nvec: list[int] = field(default_factory=list)  # multi_discrete: each dim's count
    # Why the env's reward_threshold is no goal for these episodes ("": it is, or it has none).
    goal_note: str = ""


@dataclass(frozen=True)
class WorkerHello(Message):
    KIND: ClassVar[Kind] = Kind.WORKER_HELLO
    worker: str
    incarnation: str
    env_id: str
    num_envs: int
    seed: int
    spec: SpaceSpec
    seq: int  # the last sequence number it answered; a new broker continues above it
    # Multi-agent envs: each env's possible agents, in row order (rows = num_envs x agents).
    agents: list[str] = field(default_factory=list)
    # --shm-frames: its observation segment (bus/shm.py) and the segment's nonce, in hex.
    shm: str = ""
    shm_nonce: str = ""
    # A split of a double-buffered worker (`stepbus worker --splits N`): the process's name,
    # which agent ids carry, and the index of its first env there ("" and 0: a whole worker).
    split_of: str = ""
    first_env: int = 0


@dataclass(frozen=True)
class Reset(Message):
    """`seq` continues the worker's sequence numbers, so a late reply to an earlier reset or
    step can never be taken for the answer to this one."""

    KIND: ClassVar[Kind] = Kind.RESET
    epoch: int
    seq: int
    options: dict[str, Json]
    # A vector env's reset (`stepbus.vector`). `rows`: the envs to reset (empty: all); `seeds`:
    # one per reset env (-1: reset(seed=None), continuing its generator; empty: per-episode
    # derived seeds, `envs.episode_seed`). `seeding`: how later autoresets are seeded,
    # SEEDING_EPISODE (derived seeds) or SEEDING_GYMNASIUM (seed=None, as Gymnasium's vector
    # envs do, with `options` for this reset only). `autoreset`: an AUTORESET_* mode.
    rows: list[int] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    seeding: str = "episode"
    autoreset: str = "same_step"
    worker: str = ""  # from a vector client: the worker meant (the relay sends it on as "")
    infos: bool = False  # a vector client wants the envs' infos with every STEP_RESULT


@dataclass(frozen=True)
class Step(Message):
    KIND: ClassVar[Kind] = Kind.STEP
    epoch: int
    seq: int
    policy_version: int
    actions: np.ndarray
    worker: str = ""  # from a vector client: the worker meant (the relay sends it on as "")


@dataclass(frozen=True)
class StepResult(Message):
    """One reply per action batch. `first` marks observations straight after a reset (no reward).

    One row per env, or per (env, agent) for multi-agent envs (env-major, agents in the order
    the hello named them). Autoreset is explicit: row i ended its episode on this step iff
    terminated[i] or truncated[i]; then obs[i] is the first observation of the next episode (if
    it has one) and the observation the episode ended on is the matching row of `final_obs`
    (rows in order of the ended rows). `alive` (multi-agent only; None means all) says which
    rows act next: an agent that finished while others go on, or has not appeared yet, is not
    alive; one alive before that is neither alive nor done now has vanished. After a RESET of
    AUTORESET_NEXT_STEP or AUTORESET_DISABLED an ended env is not reset within the step: obs[i]
    is the observation its episode ended on (as is its row of `final_obs`); under NEXT_STEP its
    next STEP resets it instead of stepping it (reward 0, neither flag), as Gymnasium does.
    """

    KIND: ClassVar[Kind] = Kind.STEP_RESULT
    incarnation: str
    epoch: int
    seq: int
    first: bool
    obs: Obs
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_obs: Obs
    alive: np.ndarray | None = None
    # Per row: the episode obs[i] belongs to (counted per env from 0) and the seed its env was
    # reset with, so any episode can be replayed alone from its seed and actions.
    episode: np.ndarray | None = None
    episode_seed: np.ndarray | None = None
    # Per row: it ended with no observation after its last action (its env raised, or its agent
    # left without one), so its row of `final_obs` is the observation it acted on. None: none.
    no_final_obs: np.ndarray | None = None
    # >= 0: obs are in this slot of the worker's shared-memory segment and `obs` holds no rows
    # (its shape after the first dimension and its dtype say how to read them).
    obs_slot: int = -1
    worker: str = ""  # relayed to a vector client: the worker that sent it
    # Only after a RESET with `infos`: each row's env info (None: none, a row not reset) and
    # each ended row's final info (in `final_obs` order), encoded as stepbus.workers.infos says.
    infos: list[Json] = field(default_factory=list)
    final_infos: list[Json] = field(default_factory=list)
    info_arrays: ArrayMap = field(default_factory=dict)


# RESET's `seeding` and `autoreset` values.
SEEDING_EPISODE, SEEDING_GYMNASIUM = "episode", "gymnasium"
AUTORESET_SAME_STEP, AUTORESET_NEXT_STEP, AUTORESET_DISABLED = "same_step", "next_step", "disabled"
SEEDINGS = (SEEDING_EPISODE, SEEDING_GYMNASIUM)
AUTORESETS = (AUTORESET_SAME_STEP, AUTORESET_NEXT_STEP, AUTORESET_DISABLED)


@dataclass(frozen=True)
class VectorHello(Message):
    """A vector env client (`stepbus.vector`) attaches to a relaying broker; it is answered
    with a VECTOR_SPEC, and one more whenever a worker joins, restarts or is lost."""

    KIND: ClassVar[Kind] = Kind.VECTOR_HELLO
    client: str


@dataclass(frozen=True)
class Member:
    """One worker as a vector client sees it: its rows are env ids offset to offset + rows,
    the offset given by the workers before it in name order."""

    name: str
    incarnation: str
    rows: int
    agents: int  # possible agents per env (0: a Gymnasium env; the client refuses others)


@dataclass(frozen=True)
class VectorSpec(Message):
    KIND: ClassVar[Kind] = Kind.VECTOR_SPEC
    env_id: str
    spec: SpaceSpec  # sent once a worker has told them
    workers: list[Member]


@dataclass(frozen=True)
class EnvCall(Message):
    """`op` ("call", "get_attr" or "set_attr") on attribute `name` of each of a worker's envs.
    Values are data only (no pickle): JSON, with numpy arrays in `arrays` and in their place a
    map {"__ndarray__": key}. `values` (set_attr) holds one value per env."""

    KIND: ClassVar[Kind] = Kind.ENV_CALL
    worker: str
    call_id: int
    op: str
    name: str
    args: list[Json]
    kwargs: dict[str, Json]
    values: list[Json]
    arrays: ArrayMap = field(default_factory=dict)


@dataclass(frozen=True)
class EnvCallResult(Message):
    """Each env's result of an ENV_CALL, encoded as its arguments are; `error` set: the call
    raised, or a result is not data (named in it), and `values` is empty."""

    KIND: ClassVar[Kind] = Kind.ENV_CALL_RESULT
    worker: str
    call_id: int
    values: list[Json]
    error: str
    arrays: ArrayMap = field(default_factory=dict)


@dataclass(frozen=True)
class Experience(Message):
    """A worker's step result forwarded with the policy outputs chosen for its observations.

    `policy_version` is -1 and the action arrays are None when no action was taken on `obs`
    (a barrier or shutdown drained it): the assembler then keeps `obs` only as a bootstrap.
    With more than one policy (`--policy-map`), `agent_policies` names each agent's policy (in
    the order of `agents`, or one name for a single-agent env; empty: all "default") and
    `policy_versions` gives each row's version; `policy_version` is then their lowest.
    """

    KIND: ClassVar[Kind] = Kind.EXPERIENCE
    worker: str
    incarnation: str
    epoch: int
    seq: int
    first: bool
    policy_version: int
    obs: Obs
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_obs: Obs
    action: np.ndarray | None = None
    logp: np.ndarray | None = None
    value: np.ndarray | None = None
    alive: np.ndarray | None = None  # as in STEP_RESULT
    agents: list[str] = field(default_factory=list)  # the hello's agents (multi-agent envs)
    episode: np.ndarray | None = None  # as in STEP_RESULT
    episode_seed: np.ndarray | None = None
    no_final_obs: np.ndarray | None = None  # as in STEP_RESULT
    agent_policies: list[str] = field(default_factory=list)
    policy_versions: np.ndarray | None = None  # int64 per row; None: all `policy_version`
    # As in STEP_RESULT; `shm`/`shm_nonce` name the worker's segment whenever the broker maps
    # it (also when the rows travel here), so the assembler can map it too.
    obs_slot: int = -1
    shm: str = ""
    shm_nonce: str = ""
    # A recurrent model's memory each row's action was chosen with (`Policy.initial_state`'s
    # layout, one row per row of obs); empty for a feed-forward model.
    state: ArrayMap = field(default_factory=dict)
    split_of: str = ""  # as in the worker's hello: agent ids are `split_of/(first_env + i)`
    first_env: int = 0


@dataclass(frozen=True)
class Trajectory(Message):
    """One agent's contiguous steps, cut at episode end, the horizon, a barrier or a lost worker.

    terminated: the episode ended in a terminal state (bootstrap value 0).
    truncated: the episode was cut short (time limit, lost worker, barrier, a vanished agent):
    bootstrap from `bootstrap_obs`. Neither: a horizon cut inside a running episode; bootstrap
    from `bootstrap_obs`.
    bootstrap_from_last: no observation follows the last step (an agent that vanished without
    one, an env that raised; STEP_RESULT's `no_final_obs`):
    `bootstrap_obs` is the last step's own observation, and the bootstrap value is the last
    step's (a recurrent learner must not feed that observation a second time).
    `episode_return`/`episode_length` are set when this trajectory ends an episode the env ended.
    """

    KIND: ClassVar[Kind] = Kind.TRAJECTORY
    agent: str
    epoch: int
    terminated: bool
    truncated: bool
    episode_return: float | None
    episode_length: int | None
    obs: Obs
    actions: np.ndarray
    logp: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    policy_versions: np.ndarray
    bootstrap_obs: Obs
    assembler: str  # the assembler incarnation that numbered it
    seq: int  # its number there; a trainer's RECEIPT names it back
    # What produced it: the env's episode index and reset seed, and the index of its first step
    # within that agent's episode (-1: unknown, e.g. joined mid-episode after a restart).
    episode: int = -1
    episode_seed: int = -1
    episode_step: int = -1
    policy: str = "default"  # the policy that acted (and so the learner it is for)
    # A recurrent model's memory before the first step (one agent's row of each array); the
    # learner replays the trajectory from it. Empty for a feed-forward model.
    state: ArrayMap = field(default_factory=dict)
    bootstrap_from_last: bool = False


@dataclass(frozen=True)
class Trajectories(Message):
    """Trajectories of one policy in one message, their steps concatenated in order: at one
    message each, sending and receiving them was the largest cost of small-observation envs.
    Trajectory i is steps `sum(lengths[:i])` to `sum(lengths[:i + 1])` of every step
    array and row i of `bootstrap_obs`; the lists hold each one's fields as in `Trajectory`."""

    KIND: ClassVar[Kind] = Kind.TRAJECTORIES
    assembler: str
    policy: str
    seqs: list[int]
    agents: list[str]
    epochs: list[int]
    lengths: list[int]
    terminated: list[bool]
    truncated: list[bool]
    bootstrap_from_last: list[bool]
    episode_returns: list[float | None]
    episode_lengths: list[int | None]
    episodes: list[int]
    episode_seeds: list[int]
    episode_steps: list[int]
    obs: Obs
    actions: np.ndarray
    logp: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    policy_versions: np.ndarray
    bootstrap_obs: Obs  # one row per trajectory
    states: ArrayMap = field(default_factory=dict)  # one row per trajectory (`state`)

    @classmethod
    def of(cls, trajs: Sequence[Trajectory]) -> Trajectories:
        """One message for trajectories of one assembler and policy. A single trajectory's
        arrays are used as they are (no copy: observation frames stay zero-copy)."""
        first = trajs[0]

        def steps(name: str) -> Any:
            return rows.concat([getattr(t, name) for t in trajs])

        bootstrap = rows.stack([t.bootstrap_obs for t in trajs])
        return cls(
            assembler=first.assembler, policy=first.policy, seqs=[t.seq for t in trajs],
            agents=[t.agent for t in trajs], epochs=[t.epoch for t in trajs],
            lengths=[len(t.rewards) for t in trajs], terminated=[t.terminated for t in trajs],
            truncated=[t.truncated for t in trajs],
            bootstrap_from_last=[t.bootstrap_from_last for t in trajs],
            episode_returns=[t.episode_return for t in trajs],
            episode_lengths=[t.episode_length for t in trajs],
            episodes=[t.episode for t in trajs], episode_seeds=[t.episode_seed for t in trajs],
            episode_steps=[t.episode_step for t in trajs], obs=steps("obs"),
            actions=steps("actions"), logp=steps("logp"), values=steps("values"),
            rewards=steps("rewards"), policy_versions=steps("policy_versions"),
            bootstrap_obs=bootstrap,
            states={k: np.stack([t.state[k] for t in trajs]) for k in first.state})

    def split(self) -> list[Trajectory]:
        """The trajectories, as views of this message's arrays. Only on a message that
        `checks.trajectories_problem` passed: lengths and list sizes are trusted here."""
        out = []
        end = 0
        for i, n in enumerate(self.lengths):
            start, end = end, end + n
            out.append(Trajectory(
                agent=self.agents[i], epoch=self.epochs[i], terminated=self.terminated[i],
                truncated=self.truncated[i], episode_return=self.episode_returns[i],
                episode_length=self.episode_lengths[i], obs=rows.take(self.obs, slice(start, end)),
                actions=self.actions[start:end], logp=self.logp[start:end],
                values=self.values[start:end], rewards=self.rewards[start:end],
                policy_versions=self.policy_versions[start:end],
                bootstrap_obs=rows.take(self.bootstrap_obs, i), assembler=self.assembler,
                seq=self.seqs[i], episode=self.episodes[i], episode_seed=self.episode_seeds[i],
                episode_step=self.episode_steps[i], policy=self.policy,
                state={k: v[i] for k, v in self.states.items()},
                bootstrap_from_last=self.bootstrap_from_last[i]))
        return out


@dataclass(frozen=True)
class Receipt(Message):
    """What a learner did with trajectories since its last receipt. The assembler keeps every
    trajectory until it is learned from, and sends the unlearned ones again when a learner
    disconnects (ZeroMQ drops what was queued toward a dead peer); `taken` frees room in its
    bounded queue, so a learner filling a large batch never stalls the pipeline."""

    KIND: ClassVar[Kind] = Kind.RECEIPT
    trainer: str
    incarnation: str
    assembler: str
    taken: np.ndarray  # int64 trajectory numbers taken in
    learned: np.ndarray  # ... used in an update, or discarded on purpose (stale, after solving)
    policy: str = "default"  # the policy the learner trains: learners are told apart per policy
    # The learner drops trajectories acted this many versions before its own (-1: none): the
    # assembler cuts trajectories that span half of it (processor/buffers.py, AgentBuffer.spans).
    max_policy_lag: int = -1


@dataclass(frozen=True)
class TrainerSwap(Message):
    """Replace the learner in a trainer slot: the CLI asks the controller, which forwards it to
    the slot and relays the slot's REPLY."""

    KIND: ClassVar[Kind] = Kind.TRAINER_SWAP
    slot: str  # empty: the only slot there is
    args: list[str]  # learner flags, added to (and overriding) the slot's own


@dataclass(frozen=True)
class TrainerHello(Message):
    KIND: ClassVar[Kind] = Kind.TRAINER_HELLO
    trainer: str
    policy: str


@dataclass(frozen=True)
class EnvSpec(Message):
    """The spaces a trainer builds its policy for, and the newest policy version the broker
    holds, so a restarted trainer continues above it."""

    KIND: ClassVar[Kind] = Kind.ENV_SPEC
    env_id: str
    spec: SpaceSpec
    policy_version: int


@dataclass(frozen=True)
class Weights(Message):
    """Versioned policy parameters. `consumed_steps` (env steps this trainer incarnation has
    received) is the credit that lets the broker keep stepping: see the broker's flow control.
    `checkpointed_steps` (the count its newest checkpoint holds) and `run` tell the broker
    whether the next trainer resumed that checkpoint or learns for a run of its own."""

    KIND: ClassVar[Kind] = Kind.WEIGHTS
    trainer: str
    incarnation: str
    policy: str
    version: int
    consumed_steps: int
    batch_steps: int
    starving: bool
    params: ArrayMap
    checkpointed_steps: int = 0
    run: str = ""  # the run directory's id: a successor that resumed the checkpoint shares it
    # The median policy lag (versions) of the trajectories taken in since the last version (-1:
    # none), and the bound beyond which the trainer drops them as stale (-1: none said). The
    # broker steps less far ahead while the lag nears the bound.
    policy_lag: int = -1
    max_policy_lag: int = -1


@dataclass(frozen=True)
class Heartbeat(Message):
    """Registration and liveness in one: the first heartbeat registers, `leaving` deregisters."""

    KIND: ClassVar[Kind] = Kind.HEARTBEAT
    role: str
    name: str
    host: str
    pid: int
    leaving: bool
    figures: dict[str, Json]
    binds: dict[str, str] = field(default_factory=dict)  # endpoint name -> address it bound


@dataclass(frozen=True)
class RunState(Message):
    """The reply to every HEARTBEAT. `endpoints` are where the run's sockets are bound (endpoint
    name -> address, as bound: a wildcard host means "the controller's host"), so a process on
    another host needs only the controller's address."""

    KIND: ClassVar[Kind] = Kind.RUN_STATE
    run_id: str
    epoch: int
    options: dict[str, Json]
    shutting_down: bool
    endpoints: dict[str, str] = field(default_factory=dict)
    horizon: int = 0  # the assembler's trajectory horizon in steps (0: no assembler has said)


@dataclass(frozen=True)
class StatusRequest(Message):
    KIND: ClassVar[Kind] = Kind.STATUS_REQUEST


@dataclass(frozen=True)
class StatusReply(Message):
    KIND: ClassVar[Kind] = Kind.STATUS_REPLY
    run_id: str
    epoch: int
    processes: list[Json]


@dataclass(frozen=True)
class ResetRequest(Message):
    KIND: ClassVar[Kind] = Kind.RESET_REQUEST
    options: dict[str, Json]


@dataclass(frozen=True)
class ShutdownRequest(Message):
    KIND: ClassVar[Kind] = Kind.SHUTDOWN_REQUEST
    reason: str


@dataclass(frozen=True)
class Reply(Message):
    KIND: ClassVar[Kind] = Kind.REPLY
    ok: bool
    detail: str


@dataclass(frozen=True)
class Barrier(Message):
    KIND: ClassVar[Kind] = Kind.BARRIER
    epoch: int
    options: dict[str, Json]


@dataclass(frozen=True)
class BarrierDone(Message):
    KIND: ClassVar[Kind] = Kind.BARRIER_DONE
    epoch: int
    workers_reset: int
    workers_lost: int
    errors: list[str]  # environments that raised while resetting with the barrier's options


@dataclass(frozen=True)
class Shutdown(Message):
    KIND: ClassVar[Kind] = Kind.SHUTDOWN
    reason: str


@dataclass(frozen=True)
class RemoteError(Message):
    """An error as data: raised on one side, logged and counted on the other, type name kept."""

    KIND: ClassVar[Kind] = Kind.REMOTE_ERROR
    origin: str
    error_type: str
    message: str
    traceback: str
    context: dict[str, Json]


@dataclass(frozen=True)
class WorkerLost(Message):
    KIND: ClassVar[Kind] = Kind.WORKER_LOST
    worker: str
    incarnation: str
    reason: str


@dataclass(frozen=True)
class EvalResult(Message):
    """What an evaluator's greedy episodes of one policy version returned: their mean, standard
    deviation and mean length, over `episodes` episodes on envs of its own."""

    KIND: ClassVar[Kind] = Kind.EVAL_RESULT
    evaluator: str
    policy: str
    version: int
    episodes: int
    mean_return: float
    std_return: float
    mean_length: float


MESSAGE_TYPES: dict[Kind, type[Message]] = {
    cls.KIND: cls
    for cls in (
        WorkerHello, Reset, Step, StepResult, Experience, Trajectory, TrainerHello, EnvSpec,
        Weights, Heartbeat, RunState, StatusRequest, StatusReply, ResetRequest,
        ShutdownRequest, Reply, Barrier, BarrierDone, Shutdown, RemoteError, WorkerLost,
        Receipt, TrainerSwap, Trajectories, VectorHello, VectorSpec, EnvCall, EnvCallResult,
        EvalResult,
    )
}
assert set(MESSAGE_TYPES) == set(Kind), "every kind needs exactly one message class"


# ---------------------------------------------------------------------------------------------
# Field schemas, derived once from the dataclass annotations.


@dataclass(frozen=True)
class _Schema:
    scalars: dict[str, Any]  # name -> annotation
    arrays: dict[str, str]  # name -> _ARRAY | _OPT_ARRAY | _ARRAY_MAP
    required: frozenset[str]
    checks: dict[str, Callable[[Any], bool]]  # name -> its value's check
    from_header: dict[str, Callable[[Any], Any]]  # fields holding records: map -> record
    to_header: dict[str, Callable[[Any], Any]]  # ... and record -> map
    fields: frozenset[str]  # every field's name
    # filled in without __init__ once checked: not a class with a __post_init__ to run
    direct: bool = True


def _schema(cls: type[Message]) -> _Schema:
    """How a message class travels. Raises TypeError, naming the field, for an annotation the
    codec cannot carry (tests/test_codec.py builds every class's)."""
    try:
        hints = _hints(cls)
    except NameError as exc:
        raise TypeError(f"{cls.__name__}: {exc}") from None
    scalars: dict[str, Any] = {}
    arrays: dict[str, str] = {}
    required = set()
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint = hints[f.name]
        how = _array_how(hint)
        if how:
            arrays[f.name] = how
        else:
            scalars[f.name] = hint
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.add(f.name)
    checks = {}
    for name, hint in scalars.items():
        try:
            checks[name] = _checker(hint)
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.{name}: {exc}") from None
    return _Schema(scalars, arrays, frozenset(required), checks,
                   _converters(cls, _builder_of), _converters(cls, _mapper_of),
                   frozenset([*scalars, *arrays]), not hasattr(cls, "__post_init__"))


@functools.cache
def schema_of(kind: Kind) -> _Schema:
    """A kind's schema, built the first time this process sends or receives one."""
    return _schema(MESSAGE_TYPES[kind])


# ---------------------------------------------------------------------------------------------
# The codec pair.


def _array_buffer(name: str, value: Any, descs: list[list[Any]], frames: list[Any]) -> None:
    arr = np.asarray(value, order="C")  # not ascontiguousarray: it turns 0-d into (1,)
    if arr.dtype.str not in ALLOWED_DTYPES:
        raise ProtocolError("bad dtype", f"{name}: {arr.dtype} is not numeric or bool")
    descs.append([name, arr.dtype.str, list(arr.shape)])
    frames.append(arr.data if arr.nbytes else b"")


def encode(msg: Message) -> list[Any]:
    """Message -> frames for `send_multipart(frames, copy=False)`; arrays are not copied."""
    schema = schema_of(msg.KIND)
    fields: dict[str, Any] = {}
    descs: list[list[Any]] = []
    frames: list[Any] = []
    for name in schema.scalars:
        fields[name] = getattr(msg, name)
    for name, to_header in schema.to_header.items():
        fields[name] = to_header(fields[name])
    for name, how in schema.arrays.items():
        value = getattr(msg, name)
        if how == _ARRAY_MAP or (how == _OBS and isinstance(value, dict)):
            for key, arr in value.items():
                _array_buffer(f"{name}.{key}", arr, descs, frames)
        elif value is not None:
            _array_buffer(name, value, descs, frames)
    header = msgpack.packb([PROTOCOL_VERSION, int(msg.KIND), fields, descs], use_bin_type=True)
    return [header, *frames]


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("ext type", f"msgpack ext type {code} is not allowed")


def _brief(value: Any) -> str:
    """A refused value for an error message, without walking a big container (reprlib sorts
    a map's keys, which costs milliseconds on a hostile 10,000-key map)."""
    if type(value) is dict:
        return f"a map of {len(value)}"
    if type(value) is list and not _JSON_SCALARS.issuperset(map(type, value[:8])):
        return f"a list of {len(value)}"
    return reprlib.repr(value)


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    return memoryview(buf if buf is not None else frame)


def _decode_array(desc: Any, frame: Any) -> tuple[str, np.ndarray]:
    if not (type(desc) is list and len(desc) == 3):
        raise ProtocolError("bad array descriptor", _brief(desc))
    name, dtype, shape = desc
    if type(name) is not str or type(dtype) is not str or type(shape) is not list:
        raise ProtocolError("bad array descriptor", _brief(desc))
    dt = _DTYPES.get(dtype)
    if dt is None:
        raise ProtocolError("bad dtype", f"{name}: {dtype!r}")
    # msgpack gives int or bool: `type is int` refuses bools, as the codec always has.
    if len(shape) > MAX_NDIM or not all(
        type(d) is int and 0 <= d <= MAX_ARRAY_BYTES for d in shape
    ):
        raise ProtocolError("bad shape", f"{name}: {_brief(shape)}"[:120])
    count = bound = 1
    for d in shape:
        count *= d
        bound *= d or 1  # a 0 dim must not hide huge others: numpy refuses those shapes
    if bound * dt.itemsize > MAX_ARRAY_BYTES:
        raise ProtocolError("bad shape", f"{name}: {shape} x {dt} is too large"[:120])
    buf = _buffer(frame)
    if count * dt.itemsize != buf.nbytes:  # bound checked above: nbytes is within it too
        raise ProtocolError("shape mismatch", f"{name}: {shape} x {dt} != {buf.nbytes} bytes")
    arr = np.frombuffer(buf, dtype=dt) if count else np.empty(0, dtype=dt)
    return name, arr if len(shape) == 1 else arr.reshape(shape)


class _ContainerBudget:
    """msgpack's list and map hook: refuses a header once it has built MAX_HEADER_CONTAINERS
    lists and maps, before a bomb of small containers costs milliseconds to build and free."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_HEADER_CONTAINERS

    def take(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError("header too complex",
                                f"more than {MAX_HEADER_CONTAINERS} lists and maps")
        return container


def _unpack_header(head: memoryview, max_bytes: int) -> Any:
    """Frame 0 -> Python values, within the byte and container bounds; no ext types."""
    if head.nbytes > max_bytes:
        raise ProtocolError("header too large", f"{head.nbytes} bytes, at most {max_bytes}")
    try:
        if head.nbytes <= MAX_HEADER_CONTAINERS:  # a container takes a byte at least: no bomb
            return msgpack.unpackb(head, raw=False, strict_map_key=True, ext_hook=_refuse_ext,
                                   use_list=True)
        budget = _ContainerBudget()
        return msgpack.unpackb(head, raw=False, strict_map_key=True, ext_hook=_refuse_ext,
                               use_list=True, list_hook=budget.take, object_hook=budget.take)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types (ValueError, StackError, ...)
        raise ProtocolError("bad msgpack", f"{type(exc).__name__}: {exc}"[:160]) from None


def decode(frames: Sequence[Any], *, max_header_bytes: int = MAX_HEADER_BYTES) -> Message:
    """Frames (bytes, memoryviews or zmq.Frames, routing identity removed) -> a Message.

    max_header_bytes: only a client reading a large STATUS_REPLY needs more than the default.

    Raises:
        ProtocolError: for anything that is not a well-formed message of a declared kind.
    """
    if not frames:
        raise ProtocolError("empty message")
    header = _unpack_header(_buffer(frames[0]), max_header_bytes)
    kind, fields, descs = _parts(header, len(frames) - 1)
    schema = schema_of(kind)
    values = _header_values(kind, schema, fields)
    _add_arrays(kind, schema, descs, frames[1:], values)
    if values.keys() != schema.fields or not schema.direct:
        absent = schema.required - set(values)
        if absent:
            raise ProtocolError("bad fields", f"{kind.name}: missing {sorted(absent)}")
        return MESSAGE_TYPES[kind](**values)
    # Every field is here and checked: filled in directly, without the frozen dataclass's
    # __init__ (an object.__setattr__ per field, 5 us for an EXPERIENCE).
    msg = object.__new__(MESSAGE_TYPES[kind])
    vars(msg).update(values)
    return msg


MessageT = TypeVar("MessageT", bound=Message)


def renumbered(msg: MessageT, **changes: Any) -> MessageT:
    """`dataclasses.replace` for what a process passes on with a few fields set anew (a
    relay's epoch and sequence number, a worker's incarnation), values of their declared types
    already: without the frozen dataclass's __init__, which costs ten times more.

    Raises:
        TypeError: a name that is not a field, or a class with a __post_init__ to run.
    """
    schema = schema_of(msg.KIND)
    if not schema.direct or not schema.fields.issuperset(changes):
        raise TypeError(f"{type(msg).__name__}: cannot renumber {sorted(changes)}")
    out = object.__new__(type(msg))
    vars(out).update(vars(msg))
    vars(out).update(changes)
    return out


def _parts(header: Any, frame_count: int) -> tuple[Kind, dict[str, Any], list[Any]]:
    """The kind, fields and array descriptors of an unpacked header, checked for shape,
    protocol version, a declared kind, and one frame per array."""
    if not (isinstance(header, list) and len(header) == 4):
        raise ProtocolError("bad header", "expected [version, kind, fields, arrays]")
    version, kind_value, fields, descs = header
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            "protocol version", f"got {_brief(version)}, this side speaks {PROTOCOL_VERSION}"
        )
    if not isinstance(kind_value, int) or isinstance(kind_value, bool):
        raise ProtocolError("unknown kind", _brief(kind_value))
    try:
        kind = Kind(kind_value)
    except ValueError:
        raise ProtocolError("unknown kind", _brief(kind_value)) from None
    if not isinstance(fields, dict) or not isinstance(descs, list):
        raise ProtocolError("bad header", "fields must be a map and arrays a list")
    if len(descs) > MAX_ARRAYS or len(descs) != frame_count:
        raise ProtocolError(
            "frame count", f"{kind.name}: {len(descs)} arrays declared, {frame_count} frames"
        )
    return kind, fields, descs


def _header_values(kind: Kind, schema: _Schema, fields: dict[str, Any]) -> dict[str, Any]:
    """The header fields, exactly the kind's, each passing its check; records built."""
    if fields.keys() != schema.scalars.keys():  # set-like views: no copies of a big map
        unexpected = list(itertools.islice(
            itertools.filterfalse(schema.scalars.__contains__, fields), 3))
        missing = [name for name in schema.scalars if name not in fields]
        raise ProtocolError("bad fields", f"{kind.name}: {len(fields)} fields, unexpected "
                            f"{_brief(unexpected)}, missing {_brief(missing)}"[:160])
    for name, check in schema.checks.items():
        if not check(fields[name]):
            hint, value = schema.scalars[name], fields[name]
            why = _record_problem(hint, value) if _is_record(hint) else _brief(value)
            raise ProtocolError("bad field", f"{kind.name}.{name}: {why}"[:160])
    values: dict[str, Any] = dict(fields)
    for name, from_header in schema.from_header.items():
        values[name] = from_header(values[name])
    return values


def _add_arrays(kind: Kind, schema: _Schema, descs: list[Any], frames: Sequence[Any],
                values: dict[str, Any]) -> None:
    """Each declared array into `values` under its field (an ArrayMap's as `field.key`);
    absent optional ones as None or an empty map."""
    for desc, frame in zip(descs, frames, strict=False):
        name, arr = _decode_array(desc, frame)
        if schema.arrays.get(name) in _PLAIN_ARRAYS and name not in values:
            values[name] = arr  # the common case, an array field by its own name
            continue
        top, dot, key = name.partition(".")
        how = schema.arrays.get(top)
        if how in (_ARRAY_MAP, _OBS) and dot and key:
            leaves = values.setdefault(top, {})
            if type(leaves) is not dict or key in leaves:
                raise ProtocolError("bad array name", f"{kind.name}: {name} twice, or as an "
                                    "array and a map")
            leaves[key] = arr
        else:  # a plain array's name was taken above, unless it came twice
            raise ProtocolError("bad array name", f"{kind.name}: {name!r}"[:120])
    for name, how in schema.arrays.items():
        if name not in values:
            if how in (_ARRAY, _OBS):
                raise ProtocolError("missing array", f"{kind.name}.{name}")
            values[name] = {} if how == _ARRAY_MAP else None


def peek_kind(frames: Sequence[Any]) -> Kind | None:
    """Best-effort kind of a message that failed to decode, for per-kind error counts."""
    try:
        return Kind(_unpack_header(_buffer(frames[0]), MAX_HEADER_BYTES)[1])
    except Exception:
        return None
