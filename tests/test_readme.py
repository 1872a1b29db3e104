"""The README is the manual: every flag and environment variable the code has is in it."""

from __future__ import annotations

import argparse
from pathlib import Path

from stepbus.bus import wiring

from stepbus import cli

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def section(command: str) -> str:
    """The README text that documents `stepbus COMMAND`: the section under the heading that
    names it, or its row in the client commands table."""
    headings = [line for line in README.splitlines()
                if line.startswith("#### ") and f"`stepbus {command}`" in line]
    if headings:
        return README.split(headings[0], 1)[1].split("####", 1)[0]
    rows = [line for line in README.splitlines() if line.startswith(f"| `stepbus {command}`")]
    assert rows, f"stepbus {command} is not documented"
    return rows[0]


def test_every_cli_flag_is_documented_in_its_command_section():
    missing = [
        f"stepbus {name} {flag}"
        for name, parser in subcommand_parsers().items()
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help" and f"`{flag}`" not in section(name)
    ]
    assert not missing, f"undocumented flags: {missing}"


def test_every_environment_variable_is_documented_in_the_readme():
    names = [spec.env_var for spec in wiring.ENDPOINTS.values()]
    names += ["STEPBUS_RUNS_DIR", "STEPBUS_LOG_LEVEL", wiring.KEYS_ENV, wiring.INSECURE_ENV]
    assert [n for n in names if f"`{n}`" not in README] == []


def test_every_trainer_swap_flag_is_documented_in_its_section():
    flags = [flag for action in cli.swap_parser()._actions for flag in action.option_strings
             if flag.startswith("--") and flag != "--help"]
    assert [f for f in flags if f"`{f}`" not in section("trainer swap")] == []
