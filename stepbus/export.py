"""`stepbus export RUN --format onnx -o FILE`: a trained policy's greedy acting path as one ONNX
model, for running where stepbus, numpy's MLP or torch are not (onnxruntime alone).

The graph is what `predict(..., deterministic=True)` does, in the same order: the run's newest
observation normalisation (float Box leaves: (x - mean) / sqrt(var + 1e-8), clipped), the model,
the action mask (masked categories never chosen; a row that rules out every category of a
dimension is taken as no mask for it), then each dimension's most likely category, or a Box's
mean clipped to the action space's bounds. The numpy MLP is rebuilt as a torch module with its
own weights, in float64 as numpy computes it; a torch model's module is traced as it is, through
its `get_action_and_value(..., deterministic=True)`. Both go through torch's TorchScript-based
exporter (no onnxscript needed; its tracing also takes a CleanRL module's Python branches as
they run), with the batch dimension dynamic.

Inputs are named by observation leaf (`obs` for a Box observation, else each leaf's key, as
`stepbus.spaces` names them, `action_mask` among them when the env gives masks), each of the
leaf's own dtype; a recurrent model also takes `episode_start` (bool, one per row: its state is
the initial state there) and its state, `state_0`, `state_1`, ... (batch first), and gives the
next, `next_state_0`, ... The output `action` has the action space's dtype (int64 categories,
int8 MultiBinary, float32 Box) and shape, the batch first. docs/export.md says how to run it.

torch, onnx and onnxruntime are optional (`pip install -e ".[onnx]"`); without them the command
says so in one line and exits 2.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stepbus import spaces
from stepbus.bus import protocol as p
from stepbus.bus.exits import SettingError
from stepbus.models.base import Policy
from stepbus.normalize import SINGLE, Normalizing

FORMATS = ("onnx",)
INSTALL = 'pip install -e ".[onnx]"'
NEEDS = ("torch", "onnx", "onnxruntime")
OPSET = 17
ACTION = "action"
EPISODE_START = "episode_start"
TRIAL_ROWS = 3


@dataclass(frozen=True)
class Exported:
    """What an export wrote: the file, and the names its inputs and outputs go by."""

    path: Path
    inputs: list[str]
    outputs: list[str]


def require() -> None:
    """Raises SettingError, naming the pip command, when an export's libraries are missing."""
    missing = []
    for name in NEEDS:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SettingError(f"ONNX export needs {', '.join(missing)}, not installed: {INSTALL}")


def input_names(spec: p.SpaceSpec, recurrent_parts: int) -> list[str]:
    """The file's inputs: each observation leaf by its key (`obs` for a Box observation),
    then, for a recurrent model, `episode_start` and its state's parts."""
    names = [leaf.key for leaf in spec.obs_leaves] if spec.obs_leaves else [SINGLE]
    if recurrent_parts:
        names += [EPISODE_START, *(f"state_{i}" for i in range(recurrent_parts))]
    return names


def output_names(recurrent_parts: int) -> list[str]:
    return [ACTION, *(f"next_state_{i}" for i in range(recurrent_parts))]


def export_run(run: Path, fmt: str = "onnx", output: Path | None = None) -> Exported:
    """Export the policy of a run directory (or checkpoint file) as `load_policy` loads it,
    to `output` (default: RUN_DIR/policy.onnx).

    Raises:
        SettingError: an unknown format, missing libraries, a path that is no run (one line
            from `load_policy`), or a model that cannot act greedily or be exported.
    """
    if fmt not in FORMATS:
        raise SettingError(f"--format {fmt}: unknown; stepbus exports {', '.join(FORMATS)}")
    require()
    from stepbus.trained import load_policy

    trained = load_policy(run)
    if trained.greedy_problem:
        raise SettingError(f"{trained.checkpoint}: {trained.greedy_problem}")
    target = output or (trained.run_dir or trained.checkpoint.parent) / f"policy.{fmt}"
    return export_onnx(trained.policy, target, {
        "stepbus.model": trained.model, "stepbus.policy_version": str(trained.policy_version),
        "stepbus.env": str(trained.config.get("env", ""))})


def export_onnx(policy: Policy, path: Path, metadata: Mapping[str, str] | None = None
                ) -> Exported:
    """Write `policy`'s greedy acting path (behind its normalisation when it is
    `Normalizing`) to `path` as ONNX, the batch dimension dynamic, then run it once in
    onnxruntime on a trial batch to see it gives actions of the right shape and dtype.

    Raises:
        SettingError: a model that cannot be exported, or a graph that does not act.
    """
    import torch

    from stepbus.models import torch_acting

    stats = policy.stats if isinstance(policy, Normalizing) else None
    inner = policy.inner if isinstance(policy, Normalizing) else policy
    try:
        module = torch_acting.acting_module(inner, stats)
    except ValueError as exc:
        raise SettingError(str(exc)) from None
    parts = len(policy.initial_state(1)) if policy.recurrent else 0
    inputs, outputs = input_names(policy.spec, parts), output_names(parts)
    example = tuple(torch_acting.example_inputs(inner, TRIAL_ROWS))
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation, tracer notes
        # Placeholder input names: the TorchScript exporter refuses some leaf keys ("0").
        traced = [f"input_{i}" for i in range(len(inputs))]
        torch.onnx.export(module, example, str(path), input_names=traced, output_names=outputs,
                          dynamic_axes={name: {0: "batch"} for name in [*traced, *outputs]},
                          opset_version=OPSET, dynamo=False)
    _label(path, dict(zip(traced, inputs, strict=True)),
           {"stepbus.inputs": ",".join(inputs), **(metadata or {})})
    problem = _trial_problem(path, policy, [x.numpy() for x in example])
    if problem:
        raise SettingError(f"the ONNX model written to {path} does not act: {problem}")
    return Exported(path, inputs, outputs)


def _label(path: Path, names: Mapping[str, str], metadata: Mapping[str, str]) -> None:
    """The graph's inputs given their real `names` (from the placeholders they were traced
    with), and its metadata_props: what it was made from, for whoever holds the file."""
    import onnx

    model = onnx.load(str(path))
    graph = model.graph
    for graph_input in graph.input:
        graph_input.name = names.get(graph_input.name, graph_input.name)
    for node in _nodes(graph):
        node.input[:] = [names.get(name, name) for name in node.input]
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def _nodes(graph: Any) -> Iterator[Any]:
    """Every node of an ONNX graph, those of its subgraphs (If, Loop, Scan) too."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in [attribute.g, *attribute.graphs]:
                yield from _nodes(sub)


def _trial_problem(path: Path, policy: Policy, example: Sequence[np.ndarray]) -> str:
    """Why the file does not act on the trial batch in onnxruntime ("" if it does)."""
    import onnxruntime

    try:
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        actions = session.run([ACTION], dict(zip(names, example, strict=True)))[0]
    except Exception as exc:  # onnxruntime's own errors have no common base
        return f"{type(exc).__name__}: {exc}"[:300]
    problem = spaces.actions_problem(policy.spec, actions, len(example[0]))
    if not problem and actions.dtype != policy.action.dtype:
        problem = f"actions of dtype {actions.dtype}, not {np.dtype(policy.action.dtype)}"
    return problem
