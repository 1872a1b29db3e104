"""The shape of the code: modules import one another one way only, and no function is too
long to read at once. Both are read off the source, not the running program, so an import
inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "stepbus"
MAX_FUNCTION_LINES = 60
LONG_FUNCTION_DIRS = ("stepbus", "benchmarks", "tests")


def python_files(root: Path) -> list[Path]:
    """Every .py under `root`, through symlinked folders (which `Path.rglob` does not enter)."""
    return sorted(Path(folder, name) for folder, _, names in os.walk(root, followlinks=True)
                  for name in names if name.endswith(".py"))


def module_files() -> dict[str, Path]:
    """Every stepbus module by its dotted name, through the symlinked folders (stepbus/bus is
    bus/, installed as stepbus.bus)."""
    found: dict[str, Path] = {}
    for path in python_files(PACKAGE):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(tree: ast.Module, name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The stepbus modules `name` imports anywhere in its source, each resolved to a module
    (`from stepbus.bus import node` is stepbus.bus.node, not the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                child = f"{base}.{alias.name}"
                out.add(child if child in modules else base)
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported(ast.parse(path.read_text(), str(path)), name, path, modules)
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as the modules along it, first repeated at the end; [] if none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    for root in sorted(graph):
        if state.get(root):
            continue
        stack: list[Iterator[str]] = [iter(sorted(graph[root]))]
        state[root], path = 1, [root]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                state[path.pop()] = 2
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return []


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_resolves_the_symlinked_folders() -> None:
    graph = import_graph()
    assert "stepbus.bus.node" in graph and "stepbus.trainer.learner" in graph
    assert "stepbus.bus.protocol" in graph["stepbus.trainer.learner"]


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for name in graph.get(todo.pop(), ()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def test_the_algorithm_interface_imports_no_implementation() -> None:
    """A plug-in depends on the contract only, not on the PPO that happens to be the default."""
    found = {m for m in reachable(import_graph(), "stepbus.trainer.algorithm")
             if m.startswith(("stepbus.trainer.", "stepbus.models."))}
    assert not found, f"trainer/algorithm.py imports {sorted(found)}"


def test_the_torch_ppos_do_not_import_each_other() -> None:
    graph = import_graph()
    assert "stepbus.trainer.torch_ppo" not in reachable(graph, "stepbus.trainer.torch_recurrent")
    assert "stepbus.trainer.torch_recurrent" not in reachable(graph, "stepbus.trainer.torch_ppo")


def long_functions(root: Path) -> Iterator[str]:
    for path in python_files(root):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(root.parent)}:{node.lineno}"
                    yield f"{where} {node.name} ({lines} lines)"


def test_a_long_function_is_found(tmp_path: Path) -> None:
    """Def line to last line: 60 fit, 61 do not, a method as well as a function."""
    fits = ["def fits():", *(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))]
    long = ["class C:", "    def long(self):",
            *(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))]
    (tmp_path / "m.py").write_text("\n".join([*fits, "", *long, ""]))
    assert list(long_functions(tmp_path)) == [
        f"{tmp_path.name}/m.py:{len(fits) + 3} long ({MAX_FUNCTION_LINES + 1} lines)"]


def test_no_long_function() -> None:
    """A function is read as a whole; past a screenful it wants splitting."""
    found = [f for folder in LONG_FUNCTION_DIRS for f in long_functions(REPO / folder)]
    assert not found, "\n".join(["functions over 60 lines:", *found])
