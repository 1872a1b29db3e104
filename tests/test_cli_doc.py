"""docs/cli.md is generated from the CLI's parsers: it must be what the generator makes now."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys

from stepbus import cli, clidoc


def test_cli_page_is_what_the_parsers_make_now():
    page = clidoc.PAGE.read_text() if clidoc.PAGE.exists() else ""
    fresh = clidoc.render()
    diff = "".join(difflib.unified_diff(page.splitlines(keepends=True),
                                        fresh.splitlines(keepends=True),
                                        "docs/cli.md", "generated now", n=1))
    assert page == fresh, (f"docs/cli.md is out of date with the CLI's flags; regenerate it with "
                           f"`{clidoc.REGENERATE}` and commit it:\n{diff[:4000]}")


def test_every_flag_of_every_command_is_on_the_page():
    page = clidoc.PAGE.read_text()
    parsers = {f"stepbus {name}": sub
               for name, sub in clidoc.subcommands(cli.build_parser()).items()}
    parsers["stepbus trainer swap"] = cli.swap_parser()
    missing = []
    for title, parser in parsers.items():
        section = page.split(f"## `{title}`\n", 1)[1].split("\n## ", 1)[0]
        missing += [f"{title} {flag}" for action in parser._actions
                    for flag in action.option_strings
                    if flag.startswith("--") and flag not in ("--help", "--version")
                    and f"`{flag}" not in section]
    assert missing == [], f"flags missing from docs/cli.md: {missing}"


def test_the_page_does_not_depend_on_the_machine_or_the_environment():
    env = {**os.environ, "STEPBUS_CONTROLLER": "tcp://10.9.9.9:1", "STEPBUS_KEYS": "elsewhere",
           "STEPBUS_INSECURE": "1", "HONCHO_PROCESS_NAME": "worker.7"}
    made = subprocess.run([sys.executable, "-m", "stepbus.clidoc"], env=env, check=True,
                          capture_output=True, text=True, timeout=60).stdout
    assert made == clidoc.render()
    assert "10.9.9.9" not in made and "worker.7" not in made
    assert "`worker-HOST-PID`" in made
