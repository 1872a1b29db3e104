"""docs/cli.md is generated from the CLI's parsers: it must be what the generator makes now."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys

import pytest

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


BAD_NUMBERS = [("assembler", "--horizon", "0", "must be at least 1, not 0"),
               ("learner", "--learning-rate", "-1", "must be above 0, not -1"),
               ("trainer", "--gamma", "1.5", "must be 0 to 1, not 1.5"),
               ("learner", "--batch-steps", "nan", "an integer is needed, not 'nan'"),
               ("learner", "--max-grad-norm", "inf", "a finite number is needed, not 'inf'"),
               ("learner", "--hidden", "64,0", "must be at least 1, not 0"),
               ("broker", "--batch-wait-ms", "-5", "must be at least 0, not -5"),
               ("broker", "--torch-threads", "0", "must be at least 1, not 0"),
               ("controller", "--barrier-timeout-s", "0", "must be above 0, not 0"),
               ("worker", "--seed", "-1", "must be at least 0, not -1"),
               ("status", "--watch", "0", "must be above 0, not 0"),
               ("supervise", "--quick-deaths", "0", "must be at least 1, not 0"),
               ("supervise", "--silence-s", "-1", "must be at least 0, not -1")]


def test_a_number_flag_out_of_its_bounds_is_refused_naming_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before the process connects to anything: argparse's exit 2 and one line naming it."""
    for command, flag, value, why in BAD_NUMBERS:
        with pytest.raises(SystemExit) as exit_info:
            cli.build_parser().parse_args([command, flag, value])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err  # a flag with other names too: "--learning-rate/--lr"
        line = next(ln for ln in err.splitlines() if "error: argument" in ln)
        assert line.split("error: argument ")[1].split(":")[0].split("/")[0] == flag, line
        assert line.endswith(f": {why}"), (command, flag, line)


def test_every_bounded_flag_default_is_within_its_bounds_and_help_says_them() -> None:
    parsers = clidoc.subcommands(cli.build_parser())
    bounded = 0
    for parser in parsers.values():
        for action in parser._actions:
            if callable(action.type) and action.default is not None and "[default:" in str(
                    action.help):
                text = ",".join(map(str, action.default)) if isinstance(
                    action.default, tuple) else str(action.default)
                action.type(text)  # raises if the default itself is out of bounds
                bounded += bool(re.search(r"\((at least|above|at most|-?[\d.]+ to) [^)]*\) "
                                          r"\[default:", str(action.help)))
    assert bounded >= 45, bounded  # 50 are
