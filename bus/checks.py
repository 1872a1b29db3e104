"""What a well-formed message must also satisfy before a process uses it.

The codec (protocol.py) guarantees types, dtypes and byte lengths; these checks guarantee
consistency: one row per env, shapes that match the declared spaces, values in range. Each
returns why a message cannot be used, or an empty string; the caller refuses and counts it.
"""

from __future__ import annotations

import math

import numpy as np

from stepbus import policy
from stepbus.bus import policies, rows
from stepbus.bus import protocol as p
from stepbus.policy import ActionSpace

MAX_ENVS_PER_WORKER = 65_536
MAX_BATCH_STEPS = 10_000_000
MAX_TRAJECTORY_STEPS = 1_000_000
MAX_CATEGORIES = 1 << 20  # of all categorical action dimensions together
# Numbers in one observation, raw or flattened (categories one-hot): the first hello's spaces
# make the broker and the learner build their model, and a flat input this wide is already a
# 1 GiB first layer for the MLP. One 1024x1024 RGBA frame fits exactly; a hello claiming a
# billion numbers would have made them allocate without bound.
MAX_OBS_NUMBERS = 1 << 22
MAX_GOAL_NOTE = 300  # characters of SpaceSpec.goal_note
# stepbus.spaces (and with it gymnasium, 70 ms at every start) is imported by the checks that
# compare with the declared spaces, which the assembler never runs.


def hello_rows_problem(msg: p.WorkerHello) -> str:
    """Why a hello's rows are unusable (empty if usable): env count in range, agents well
    named. The broker and the relay both take workers by it."""
    if not 1 <= msg.num_envs <= MAX_ENVS_PER_WORKER:
        return f"num_envs {msg.num_envs}"
    problem = split_problem(msg.split_of, msg.first_env)
    return problem or agents_problem(msg.agents, msg.num_envs)


def split_problem(split_of: str, first_env: int) -> str:
    """Why a split's naming is unusable (empty if usable): agent ids are built from it."""
    if len(split_of) > 128 or not 0 <= first_env < MAX_ENVS_PER_WORKER:
        return f"split_of of {len(split_of)} characters, first_env {first_env}"
    if first_env and not split_of:
        return "first_env belongs to a split (split_of names its worker)"
    return ""


def rows_problem(m: p.StepResult | p.Experience, rows: int) -> str:
    """The optional per-row arrays: `alive` and `no_final_obs` (bool; the latter only on
    ended rows), `episode` and `episode_seed` (integers)."""
    if m.alive is not None and (m.alive.shape != (rows,) or m.alive.dtype != bool):
        return f"alive must be one bool per row, got {m.alive.dtype} {m.alive.shape}"
    marks = m.no_final_obs
    if marks is not None and (marks.shape != (rows,) or marks.dtype != bool
                              or (marks & ~(m.terminated | m.truncated)).any()):
        return "no_final_obs must be one bool per row, set only on ended rows"
    for a in (m.episode, m.episode_seed):
        if a is not None and (a.shape != (rows,) or a.dtype.kind not in "iu"):
            return f"episode arrays need one integer per row, got {a.dtype} {a.shape}"
    return ""


def agents_problem(agents: list[str], num_envs: int) -> str:
    """Why a hello's agent list cannot be used (empty if it can)."""
    if len(set(agents)) != len(agents) or any(not a or len(a) > 128 for a in agents):
        return "agents must be distinct names of 1-128 characters"
    if num_envs * max(1, len(agents)) > MAX_ENVS_PER_WORKER:
        return f"{num_envs} envs x {len(agents)} agents is over {MAX_ENVS_PER_WORKER} rows"
    return ""


def result_problem(r: p.StepResult, num_envs: int, spec: p.SpaceSpec | None) -> str:
    """Why a worker's result cannot be used (empty if it can): shapes must match its hello.
    `num_envs` counts rows: envs x agents for multi-agent envs."""
    from stepbus import spaces

    k = num_envs
    if spec is None:
        return "no spaces declared"
    problem = spaces.obs_problem(r.obs, spec, (k,))
    if problem:
        return problem
    if any(a.shape != (k,) for a in (r.reward, r.terminated, r.truncated)):
        return "reward/terminated/truncated must have one entry per env"
    if r.terminated.dtype != bool or r.truncated.dtype != bool:
        return "terminated/truncated must be bool"
    ended = int((r.terminated | r.truncated).sum())
    if spaces.obs_problem(r.final_obs, spec, (ended,)):
        return f"final_obs: {spaces.obs_problem(r.final_obs, spec, (ended,))}, one row per ended"
    if len(r.infos) not in (0, k) or len(r.final_infos) not in (0, ended):
        return "infos need one per row (final_infos one per ended row), or none"
    return rows_problem(r, k)


def weights_problem(params: dict[str, np.ndarray], spec: p.SpaceSpec | None,
                    action_space: ActionSpace | None, model: str = policy.DEFAULT) -> str:
    """Why weights cannot drive inference (empty if they can), as the policy `model` for these
    spaces judges them. A process that holds its Policy asks it directly."""
    if spec is None or action_space is None:
        return ""  # judged when the first worker tells us the spaces
    try:
        return policy.make_policy(model, spec).weights_problem(params)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"[:200]


def spec_problem(spec: p.SpaceSpec) -> str:
    """Why a worker's declared spaces are unusable (empty if usable)."""
    from stepbus import spaces

    try:
        action = policy.action_space(spec)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"[:200]
    # Sizes before anything is built of them: a Box space of a billion numbers allocates its
    # bounds (gigabytes, seconds) before any check of it could refuse it.
    raw = (sum(math.prod(leaf.shape) for leaf in spec.obs_leaves) if spec.obs_leaves
           else math.prod(spec.obs_shape))
    if raw > MAX_OBS_NUMBERS:
        return f"observations of {raw:,} numbers a row, over {MAX_OBS_NUMBERS:,}"
    if spec.obs_leaves:
        problem = spaces.spec_problem(spec)
        if problem or spec.obs_shape or spec.obs_dtype:
            return problem or "obs_shape and obs_dtype go with a Box, not with leaves"
    elif len(spec.obs_shape) >= p.MAX_NDIM or not all(d > 0 for d in spec.obs_shape):
        return f"obs_shape {spec.obs_shape}"[:200]
    elif spec.obs_dtype not in p.ALLOWED_DTYPES:
        return f"obs_dtype {spec.obs_dtype}"[:200]
    numbers = max(raw, spaces.flat_dim(spec))
    if numbers > MAX_OBS_NUMBERS:
        return f"observations of {numbers:,} numbers a row, over {MAX_OBS_NUMBERS:,}"
    if action.kind == "box" and not (
            len(action.shape) < p.MAX_NDIM and all(d > 0 for d in action.shape)
            and len(action.low) == len(action.high) == math.prod(action.shape)):
        return (f"box actions of shape {action.shape} with {len(action.low)} lows and "
                f"{len(action.high)} highs")[:200]
    if action.kind in ("multi_discrete", "multi_binary") and (
            len(action.shape) >= p.MAX_NDIM or not all(d > 0 for d in action.shape)
            or sum(action.nvec) > MAX_CATEGORIES
            or (action.kind == "multi_binary" and set(action.nvec) != {2})):
        return f"{action.kind} actions of shape {action.shape}, {sum(action.nvec)} categories"
    if spec.reward_threshold is not None and not math.isfinite(spec.reward_threshold):
        return f"reward_threshold {spec.reward_threshold}"  # NaN would mismatch every later hello
    if len(spec.goal_note) > MAX_GOAL_NOTE:  # a line of the learner's log
        return f"a goal note of {len(spec.goal_note)} characters, over {MAX_GOAL_NOTE}"
    return ""


def _leaves(obs: p.Obs) -> list[np.ndarray]:
    return list(obs.values()) if isinstance(obs, dict) else [obs]


def experience_problem(m: p.Experience) -> str:
    """Why an EXPERIENCE message cannot be used (empty if it can): consistent rows per env."""
    leaves = _leaves(m.obs)
    if not leaves or any(v.ndim < 1 or not 1 <= v.shape[0] <= 65_536 for v in leaves):
        return f"obs of {rows.layout(m.obs) if leaves else 'no leaves'}"[:200]
    k = rows.count(m.obs)
    if any(v.shape[0] != k for v in leaves):
        return "obs leaves of different row counts"
    if any(a.shape != (k,) for a in (m.reward, m.terminated, m.truncated)):
        return "reward/terminated/truncated need one entry per env"
    if m.terminated.dtype != bool or m.truncated.dtype != bool:
        return "terminated/truncated must be bool"
    ended = int((m.terminated | m.truncated).sum())
    if (rows.layout(m.final_obs) != rows.layout(m.obs) or rows.count(m.final_obs) != ended
            or any(v.shape[0] != ended for v in _leaves(m.final_obs))):
        return "final_obs needs one row per ended episode, shaped like obs"
    if not -1 <= m.policy_version < 2**53:
        return f"policy_version {m.policy_version}"
    problem = split_problem(m.split_of, m.first_env)
    if problem:
        return problem
    outputs = (m.action, m.logp, m.value)
    if any(o is None for o in outputs) != all(o is None for o in outputs):
        return "action, logp and value travel together"
    if m.action is not None and (m.action.ndim < 1 or m.action.shape[0] != k or any(
            o is None or o.shape != (k,) for o in (m.logp, m.value))):
        return "policy outputs need one row per env"
    if m.policy_versions is not None and (
            m.policy_versions.shape != (k,) or m.policy_versions.dtype.kind not in "iu"
            or m.policy_versions.min() < -1 or m.policy_versions.max() >= 2**53):
        return "policy_versions need one integer in [-1, 2**53) per row"
    if state_problem(m.state, (k,)):
        return state_problem(m.state, (k,))
    if m.agent_policies and (len(m.agent_policies) != max(1, len(m.agents))
                             or k % len(m.agent_policies)
                             or not all(policies.NAME.fullmatch(n) for n in m.agent_policies)):
        return "agent_policies need one policy name per agent"
    return rows_problem(m, k)


# Only a cut episode can end without an observation after its last step.
_FROM_LAST_UNTRUNCATED = "bootstrap_from_last on a trajectory that is not truncated"


def trajectory_problem(t: p.Trajectory, spec: p.SpaceSpec, action: ActionSpace) -> str:
    """Why a trajectory cannot be trained on (empty if it can)."""
    n = t.rewards.shape[0]
    if not 1 <= n <= MAX_TRAJECTORY_STEPS or t.rewards.ndim != 1:
        return f"{t.rewards.shape} rewards"
    if t.bootstrap_from_last and not t.truncated:
        return _FROM_LAST_UNTRUNCATED
    return (_episode_problem(t.episode_return, t.episode_length)
            or _steps_problem(t, n, (), spec, action))


def trajectories_problem(b: p.Trajectories, spec: p.SpaceSpec, action: ActionSpace) -> str:
    """Why a batch of trajectories cannot be trained on (empty if it can): checked as a whole,
    so a batch costs a few array operations, not a few per trajectory."""
    count = len(b.seqs)
    if not 1 <= count <= p.MAX_TRAJECTORIES_PER_MESSAGE:
        return f"{count} trajectories in one message"
    lists = (b.agents, b.epochs, b.lengths, b.terminated, b.truncated, b.bootstrap_from_last,
             b.episode_returns, b.episode_lengths, b.episodes, b.episode_seeds, b.episode_steps)
    if any(len(values) != count for values in lists):
        return f"per-trajectory lists of lengths {[len(values) for values in lists]}, not {count}"
    if any(last and not cut for last, cut in zip(b.bootstrap_from_last, b.truncated, strict=True)):
        return _FROM_LAST_UNTRUNCATED
    if not all(1 <= n <= MAX_TRAJECTORY_STEPS for n in b.lengths):
        return f"trajectory lengths outside [1, {MAX_TRAJECTORY_STEPS}]"
    rows = sum(b.lengths)
    if b.rewards.shape != (rows,):
        return f"{b.rewards.shape} rewards for lengths summing to {rows}"
    for ret, length in zip(b.episode_returns, b.episode_lengths, strict=True):
        problem = _episode_problem(ret, length)
        if problem:
            return problem
    if len(set(b.seqs)) != count:
        return "a trajectory number twice in one message"
    if any(v.ndim < 1 or v.shape[0] != count for v in b.states.values()):
        return f"states need one row per trajectory, got {rows_of(b.states)}"
    return _steps_problem(b, rows, (count,), spec, action)


def rows_of(state: dict[str, np.ndarray]) -> str:
    return str({k: v.shape for k, v in list(state.items())[:4]})[:160]


def state_problem(state: dict[str, np.ndarray], lead: tuple[int, ...]) -> str:
    """Why a recurrent state cannot be used ("" if it can): each array leads with `lead`,
    and floats are finite (a NaN memory would poison every later step of the agent)."""
    for key, value in state.items():
        if value.shape[:len(lead)] != lead:
            return f"state {key!r} of shape {value.shape}, expected it to lead with {lead}"
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            return f"non-finite state {key!r}"
    return ""


def _episode_problem(ret: float | None, length: int | None) -> str:
    if ret is not None and not (np.isfinite(ret) and length is not None
                                and 1 <= length <= 2**53):
        return f"episode statistics {ret}, {length}"
    return ""


def _steps_problem(t: p.Trajectory | p.Trajectories, n: int, bootstraps: tuple[int, ...],
                   spec: p.SpaceSpec, action: ActionSpace) -> str:
    """The step arrays: `n` rows each, fitting the spaces; `bootstraps` leads the bootstrap
    observations' shape (one trajectory: none)."""
    from stepbus import spaces

    if any(a.shape != (n,) for a in (t.logp, t.values, t.policy_versions)):
        return "logp, values and policy_versions need one entry per step"
    if t.policy_versions.dtype.kind not in "iu":
        return f"policy_versions of dtype {t.policy_versions.dtype}"
    problem = (spaces.obs_problem(t.obs, spec, (n,))
               or spaces.obs_problem(t.bootstrap_obs, spec, bootstraps))
    if problem:
        return f"{problem} (steps or bootstrap)"
    problem = spaces.actions_problem(spec, t.actions, n)
    if problem:
        return f"actions: {problem}"
    if not (np.isfinite(t.rewards).all() and np.isfinite(t.logp).all()):
        return "non-finite rewards or log-probs"
    if not (rows.all_finite(t.obs) and rows.all_finite(t.bootstrap_obs)):
        return "non-finite observations"
    return ""
