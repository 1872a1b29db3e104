"""docs/cli.md, rendered from the `stepbus` command's own argparse parsers.

The page is generated, never edited by hand, so it cannot drift from `--help`; a test fails
when it is not what this module makes now. Regenerate it after changing a flag:

    python -m stepbus.clidoc --write        (or: python -m stepbus.clidoc > docs/cli.md)

Flag defaults that come from the environment (`STEPBUS_*`, honcho's process name, the host
name and pid) are rendered as they are on a machine with none of them set, so the page is the
same wherever it is generated.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
REGENERATE = "python -m stepbus.clidoc --write"
_ENV_PREFIXES = ("STEPBUS_", "HONCHO_")
_DEFAULT_IN_HELP = re.compile(r"\s*\[default: (?P<value>[^\]]*)\]$")
_CODE_SPAN = re.compile(r"(`[^`]*`)")

HEADER = f"""\
# CLI reference

Generated from the parsers in `stepbus/cli.py` by `{REGENERATE}`; do not edit by hand
(`tests/test_cli_doc.py` fails when this page is out of date). `stepbus COMMAND --help` prints
the same flags. Defaults are those of a shell with no `STEPBUS_*` variable set: where a flag
names an environment variable, that variable's value is the default when it is set (honcho reads
`.env`; see [operations](operations.md#configuration)). A number flag's bounds are in
parentheses after its meaning: a value outside them, or a float that is not finite, is refused
naming the flag, with exit 2, before the process connects to anything.
"""


@contextlib.contextmanager
def neutral_environment() -> Iterator[None]:
    """Build the parsers without the variables that change their defaults (restored after)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _machine_neutral(text: str) -> str:
    """A default naming this host and process (a worker's name) as the placeholder it is."""
    return text.replace(f"{socket.gethostname()}-{os.getpid()}", "HOST-PID")


def _escape(text: str) -> str:
    """Markdown-safe table cell text; code spans are left as they are."""
    parts = _CODE_SPAN.split(text)
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = (parts[i].replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;"))
    return "".join(parts)


def _invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    metavar = action.metavar if isinstance(action.metavar, str) else None
    if metavar and action.nargs == "?":
        metavar = f"[{metavar}]"
    return ", ".join(f"`{flag} {metavar}`" if metavar else f"`{flag}`"
                     for flag in action.option_strings)


def _default(action: argparse.Action) -> str:
    value = action.default
    if isinstance(action, argparse.BooleanOptionalAction) or isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == "" or value == []:
        return ""
    if isinstance(value, tuple):
        value = ",".join(map(str, value))
    return f"`{_machine_neutral(str(value))}`"


def _row(action: argparse.Action) -> str:
    meaning = " ".join((action.help or "").split())
    default = _default(action)
    found = _DEFAULT_IN_HELP.search(meaning)
    if found:
        meaning = meaning[:found.start()]
        if action.default is None:  # the help names what is used instead (plot's --output)
            default = f"`{_machine_neutral(found['value'])}`"
    if not action.option_strings:
        default = "(required)"
    return f"| {_invocation(action)} | {default} | {_escape(meaning)} |"


def _documented(action: argparse.Action) -> bool:
    return not isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                                   argparse._SubParsersAction))


def flag_table(parser: argparse.ArgumentParser) -> list[str]:
    """One table of every argument `parser` takes, `--help` and `--version` aside."""
    rows = [_row(a) for a in parser._actions if _documented(a)]
    return ["| flag | default | meaning |", "|---|---|---|", *rows] if rows else []


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _section(title: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## `{title}`", ""]
    if parser.description:
        text = " ".join(parser.description.split())
        lines += [_escape(text[:1].upper() + text[1:]) + ".", ""]
    table = flag_table(parser)
    return lines + ([*table, ""] if table else [])


def render() -> str:
    """The whole page, as `--write` writes it."""
    from stepbus import cli

    with neutral_environment():
        parser = cli.build_parser(settings={})
        swap = cli.swap_parser()
    commands = subcommands(parser)
    lines = [HEADER, "| command | what |", "|---|---|"]
    lines += [f"| [`stepbus {name}`](#stepbus-{name}) | "
              f"{_escape(' '.join((sub.description or '').split()))} |"
              for name, sub in commands.items()]
    lines += ["| [`stepbus trainer swap`](#stepbus-trainer-swap) | "
              f"{_escape(' '.join((swap.description or '').split()))} |", ""]
    for name, sub in commands.items():
        lines += _section(f"stepbus {name}", sub)
        if name == "trainer":
            lines += _section("stepbus trainer swap", swap)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stepbus.clidoc",
        description="print docs/cli.md as the CLI's parsers make it now")
    parser.add_argument("--write", action="store_true", help=f"write it to {PAGE}")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        PAGE.parent.mkdir(exist_ok=True)
        PAGE.write_text(text)
        print(PAGE)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
