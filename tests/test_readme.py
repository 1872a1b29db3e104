"""The README is a short manual and docs/ the rest: both stay true to the code and to CI.

What is checked: the README's length; that its install and test commands are the ones `.ci/run`
runs; that every flag the pages name exists (on the command it is given to); that every
environment variable is documented; that links and the "where things live" paths resolve; and
that no development history creeps in. Every flag's own documentation is docs/cli.md, which
tests/test_cli_doc.py keeps current.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from stepbus import cli, clidoc
from stepbus.bus import wiring

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
WRITTEN = [page for page in PAGES if page.name != "cli.md"]  # cli.md is generated
MAX_README_LINES = 250
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Flags of other commands the pages show: pip, tensorboard, `python -m stepbus.clidoc`, and
# operations.md's apt-get, sbatch and kubectl.
OTHER_TOOLS_FLAGS = {"--no-deps", "--logdir", "--write", "--no-install-recommends", "--nodes",
                     "--ntasks-per-node", "--wait", "--from-file", "--replicas"}
HISTORY = re.compile(r"\bissues?\s*#?\d|(?<![\w&])#\d+\b|\bin progress\b|beyond the (design )?brief"
                     r"|\bwhat moved\b|\bthis stop\b|\d\d:\d\d( UTC)?\b|\bUTC\b", re.IGNORECASE)


def text(page: Path) -> str:
    return page.read_text()


def prose_and_code(page: Path) -> tuple[list[str], list[str]]:
    """The page's lines outside fenced code blocks, and those inside."""
    prose, code, fenced = [], [], False
    for line in text(page).splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            code.append(line)
        else:
            prose.append(line)
    return prose, code


def command_flags() -> dict[str, set[str]]:
    """Every `stepbus` command's flags, by command ("trainer swap" takes learner flags too)."""
    commands = {name: {f for a in sub._actions for f in a.option_strings}
                for name, sub in clidoc.subcommands(cli.build_parser()).items()}
    swap = {f for a in cli.swap_parser()._actions for f in a.option_strings}
    commands["trainer swap"] = swap | commands["learner"]
    return commands


def benchmark_flags() -> set[str]:
    sources = "".join(path.read_text() for path in (ROOT / "benchmarks").glob("*.py"))
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", sources))


def snippets(page: Path) -> list[str]:
    """Inline code spans and lines of code blocks: where commands are written out."""
    prose, code = prose_and_code(page)
    return [*re.findall(r"`([^`]+)`", "\n".join(prose)), *code]


def test_the_readme_is_a_manual_of_at_most_250_lines():
    lines = len(text(README).splitlines())
    assert lines <= MAX_README_LINES, (f"README.md has {lines} lines, over {MAX_README_LINES}: "
                                       "move detail to docs/")


def _ci_commands(marker: str) -> list[str]:
    """The commands .ci/run runs under its `# README: <marker>` comments (a marker may come
    again, for the commands after a step of CI's own)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(f"# README: {marker}")]
    commands = []
    for start in starts:
        for line in lines[start + 1:]:
            if not line.strip() or line.startswith("#"):
                break
            commands.append(line)
    return commands


def _normal(command: str) -> str:
    """A command as a reader types it: `python -m pip` is pip, `--quiet` changes nothing."""
    command = re.sub(r"\bpython3? -m (pip|pytest)\b", r"\1", command).replace("--quiet", "")
    return " ".join(command.split())


def test_the_readme_installs_and_tests_exactly_as_ci_does():
    quickstart = text(README).split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = quickstart.split("```sh", 1)[1].split("```", 1)[0]
    readme_commands = {_normal(part) for line in block.splitlines()
                       if line.strip() and not line.startswith("#") for part in line.split("&&")}
    for marker in ("install", "test"):
        ci = _ci_commands(marker)
        assert ci, f".ci/run has no command under '# README: {marker}'"
        missing = [c for c in ci if _normal(c) not in readme_commands]
        assert missing == [], (f"the README's Quickstart must run what .ci/run runs under "
                               f"'# README: {marker}'; add {missing} to it")
    # and the other way: every install and test step of the second command is marked in CI
    ci_commands = {_normal(c) for marker in ("install", "test") for c in _ci_commands(marker)}
    second = next(line for line in block.splitlines() if "pytest" in line)
    steps = [_normal(part) for part in second.split("&&")
             if not part.strip().startswith(("python3 -m venv", "."))]
    unmarked = [s for s in steps if s not in ci_commands and s != "mypy"]
    assert unmarked == [], (f"{unmarked} from the README's test command run in .ci/run under no "
                            "'# README:' marker (or not at all)")


def config_env_vars(cls: type) -> set[str]:
    """The variables a process's Config fields take their defaults from (`wiring.from_env`)."""
    names = set()
    for f in dataclasses.fields(cls):
        if wiring.ENV_VAR in f.metadata:
            names.add(f.metadata[wiring.ENV_VAR])
        elif isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            names |= config_env_vars(f.default_factory)
    return names


def test_every_environment_variable_is_documented_in_operations():
    names = sorted(set().union(*(config_env_vars(command.config_class())
                                 for command in cli.PROCESSES.values())))
    assert {"STEPBUS_ENV", "STEPBUS_RUNS_DIR", "STEPBUS_CONTROLLER"} <= set(names)
    names += ["STEPBUS_LOG_LEVEL", wiring.KEYS_ENV, wiring.INSECURE_ENV]
    operations = text(ROOT / "docs" / "operations.md")
    assert [n for n in names if f"| `{n}` |" not in operations] == []


def test_every_flag_the_pages_name_exists():
    commands = command_flags()
    known = set().union(*commands.values()) | OTHER_TOOLS_FLAGS
    unknown = {f"{page.name}: {flag}" for page in WRITTEN for flag in FLAG.findall(text(page))
               if flag not in known | (benchmark_flags() if page.name == "performance.md"
                                       else set())}
    assert unknown == set(), f"flags no command has: {sorted(unknown)}"


def test_every_flag_given_to_a_stepbus_command_is_one_of_its_own():
    commands = command_flags()
    wrong = []
    for page in WRITTEN:
        for snippet in snippets(page):
            for used in re.finditer(r"stepbus (trainer swap|[a-z]+)\b([^`|;&#]*)", snippet):
                name, rest = used[1], used[2]
                if name in commands:
                    wrong += [f"{page.name}: stepbus {name} {flag}"
                              for flag in FLAG.findall(rest) if flag not in commands[name]]
    assert wrong == [], f"flags the command does not take: {wrong}"


def benchmark_source(name: str) -> str:
    """A benchmark script's source with that of the benchmark modules it imports, which may
    add flags to its parser (`solve_time.add_wait_load`)."""
    source = (ROOT / "benchmarks" / f"{name}.py").read_text()
    imported = re.findall(r"^(?:import|from) (\w+)", source, re.MULTILINE)
    return source + "".join((ROOT / "benchmarks" / f"{module}.py").read_text()
                            for module in imported
                            if (ROOT / "benchmarks" / f"{module}.py").exists())


def test_every_benchmark_command_uses_flags_its_script_has():
    wrong = []
    for page in WRITTEN:
        for snippet in snippets(page):
            for used in re.finditer(r"benchmarks/(\w+)\.py([^`|;&#]*)", snippet):
                source = benchmark_source(used[1])
                wrong += [f"{page.name}: benchmarks/{used[1]}.py {flag}"
                          for flag in FLAG.findall(used[2]) if f'"{flag}"' not in source]
    assert wrong == [], f"flags the benchmark does not take: {wrong}"


def test_no_development_history_in_the_readme_or_docs():
    found = [f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r}" for page in PAGES
             for n, line in enumerate(text(page).splitlines(), 1)
             for m in HISTORY.finditer(line)]
    assert found == [], f"history belongs in commit messages, not the manual: {found}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose, _ = prose_and_code(page)
    seen: dict[str, int] = {}
    found = set()
    for line in prose:
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def test_every_link_between_the_pages_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", text(page)):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and anchor not in anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == [], f"broken links: {broken}"


def test_every_path_in_where_things_live_exists():
    table = text(README).split("## Where things live", 1)[1].split("\n## ", 1)[0]
    cells = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `")]
    paths = [p for cell in cells for p in re.findall(r"`([^`]+)`", cell)]
    assert len(paths) >= 9
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_the_cli_reference_is_linked_from_the_readme():
    assert "(docs/cli.md)" in text(README)
