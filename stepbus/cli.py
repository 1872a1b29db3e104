"""The `stepbus` command: one subcommand per process, plus the controller's client commands.

Flags are generated from each process's Config dataclass (field name -> --field-name, the field's
help as help, its default as default), so `--help` cannot drift from the code. A number field's
metadata may bound it ("min", "max": inclusive; "above": exclusive): a value outside, or a float
that is not finite, is refused by the parser, naming the flag (exit 2), before anything starts.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import itertools
import json
import math
import os
import re
import sys
import textwrap
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from stepbus import __version__, single_thread_blas  # noqa: F401  (before numpy loads)

# isort: split
from stepbus import evaluate, runconfig
from stepbus import status as status_view
from stepbus.bus import node, topology, wiring
from stepbus.bus import protocol as p
from stepbus.bus.exits import Exit, SettingError
from stepbus.bus.topology import PortName, Role

if typing.TYPE_CHECKING:
    from stepbus import serial


class Command(typing.NamedTuple):
    """A process subcommand. Its module is imported only when the command is the one run (or
    its flags are wanted): a worker never loads the learner, which keeps a process's start to
    what it needs."""

    config: str  # module:Config, the dataclass its flags come from
    run: str  # module:function that runs it with that Config
    doc: str

    def config_class(self) -> type:
        return typing.cast(type, _own(self.config))

    def runner(self) -> Callable[..., int]:
        return typing.cast(Callable[..., int], _own(self.run))


def _own(path: str) -> Any:
    """One of stepbus's own objects by `module:name` (user code goes through `load_object`)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


PROCESSES: dict[str, Command] = {
    "controller": Command("stepbus.bus.controller:Config", "stepbus.bus.controller:run",
                          "registration, heartbeats, status, reset barriers, shutdown broadcast"),
    "broker": Command("stepbus.bus.broker:Config", "stepbus.bus.broker:run",
                      "step broker: serves ready workers, batched policy inference"),
    "worker": Command("stepbus.workers.worker:Config", "stepbus.workers.worker:run",
                      "environment worker hosting K environments"),
    "assembler": Command("stepbus.processor.assembler:Config", "stepbus.processor.assembler:run",
                         "trajectory assembler: per-agent trajectories cut at a horizon"),
    "trainer": Command("stepbus.trainer.learner:Config", "stepbus.trainer.slot:run",
                       "trainer slot: runs `stepbus learner` with these flags, restarts it when "
                       "it dies, replaces it on `stepbus trainer swap [LEARNER FLAGS]`"),
    "learner": Command("stepbus.trainer.learner:Config", "stepbus.trainer.learner:run",
                       "the learner alone, unsupervised: PPO on trajectories, versioned weights, "
                       "checkpoints"),
    "evaluator": Command("stepbus.processor.evaluator:Config", "stepbus.processor.evaluator:run",
                         "greedy episodes of each new policy version on envs of its own, their "
                         "mean return sent to the learner (eval_return in its metrics); beside "
                         "the training path, which never waits for it"),
}
STATUS_REPLY_MAX_BYTES = 64 << 20
KEYS_HELP = ("create CURVE keys: a server keypair (for the processes that bind: controller, "
             "broker, assembler), a client keypair, and KEYS/authorized/ holding the client "
             "public keys allowed in; then run every process with --keys DIR (or "
             "STEPBUS_KEYS=DIR). Never overwrites")
PLOT_HELP = ("draw RUN_DIR's metrics.jsonl into one PNG: mean return vs env steps and vs wall "
             "time, env steps/s, policy lag p50/p99 (one line per policy); exits 1 if RUN_DIR "
             "has no metrics")
RUN_HELP = (
    "the whole pipeline in this one process, for debugging your env, model or algorithm and "
    "for fast tests: every role on one thread over inproc:// sockets, trained until the goal "
    "as `honcho start` would. An exception raises here with its own traceback (try `python -m "
    "pdb -m stepbus run ...`); nothing is restarted or supervised")
SUPERVISE_HELP = (
    "run `stepbus ROLE FLAGS` as a child and restart it whenever it dies (what each Procfile "
    "line does), or hangs (3 s without its heartbeat, 1.5-1.75 s if it is not running at all: "
    "SIGKILL; one stopped by a signal is continued instead): at once if it had run 30 s, "
    "else after 0.5, 1, 2, 5, 10, 30 s; after "
    "--quick-deaths quick deaths in a row it gives up, with the child's last error in `stepbus "
    "status` and the log. A child that exits 0 (a shutdown) ends the supervisor with 0; "
    "SIGINT/SIGTERM are passed on, SIGKILL after 4 s")
EXPORT_HELP = ("write the trained policy's greedy acting path (observation normalisation, "
               "model, masks, recurrent state) to an ONNX file that onnxruntime runs alone "
               "(docs/export.md); needs pip install -e \".[onnx]\"")
SWAP_HELP = ("replace the learner in the running trainer slot: the current learner "
             "checkpoints and exits, a new one resumes the checkpoint with the slot's flags, "
             "these in place of any value they set again (any `stepbus learner` flag, e.g. "
             "--lr 3e-4 or --algo module:Class); a new learner that exits before it has run 3 s "
             "and taken its settings, model and checkpoint (a slow start is waited for up to "
             "20 s) is replaced by one with the previous flags")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string right under a field, CleanRL style) by field name.
    Read only for a class with a field lacking a "help": finding a class's source parses its
    whole module, which cost every process (and every supervisor, twice) 0.1 s of start-up."""
    hints = typing.get_type_hints(cls)
    if all(f.metadata.get("help") or dataclasses.is_dataclass(hints[f.name])
           for f in dataclasses.fields(cls)):
        return {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for stmt, after in itertools.pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _add_config_flags(parser: argparse.ArgumentParser, cls: type,
                      settings: dict[str, runconfig.Setting],
                      skip: set[str] | None = None) -> None:
    """One flag per field; a field whose default comes from a variable (`wiring.from_env`)
    names it, and one whose default is decided later (None) says how ("default_help").
    `settings`: the run configuration's, which set defaults (`runconfig`). `skip`: fields not
    to add, to which the added ones are added (several Configs' flags on one command: a field
    two share is one flag)."""
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        if skip is not None:
            if f.name in skip:
                continue
            skip.add(f.name)
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            group = parser.add_argument_group(f"{f.name} settings")
            _add_config_flags(group, hint, settings, skip)  # type: ignore[arg-type]
            continue
        default: Any = (f.default if not callable(f.default_factory)  # every field has one
                        else f.default_factory())
        kwargs = _flag_kwargs(f, hint, docs.get(f.name, ""), default)
        kwargs["default"], source = _default(f, hint, kwargs, settings, default)
        if source:  # --help tells the default this command will use, and why
            shown = ",".join(map(str, kwargs["default"])) if isinstance(
                kwargs["default"], tuple) else kwargs["default"]
            kwargs["help"] = re.sub(r"\[default: [^\]]*\]$",
                                    f"[default: {shown}, from {source}]", kwargs["help"])
        parser.add_argument(*(_flag(name) for name in _names(f)), **kwargs)


def _names(f: dataclasses.Field) -> list[str]:
    """A field's flag names, the first its own (as SB3 and CleanRL name it, where they have
    the setting), then the names it also answers to."""
    return [f.metadata.get("flag", f.name), *f.metadata.get("aliases", ())]  # underscores


def _default(f: dataclasses.Field, hint: Any, kwargs: dict[str, Any],
             settings: dict[str, runconfig.Setting], default: Any) -> tuple[Any, str]:
    """A flag's default, and where it came from when not the code ("" then): STEPBUS_<FLAG>
    (the field's own variable, where it names one), else the run configuration, else the
    field's default. Raises SettingError naming the file and line, or the variable, of a
    value the flag would refuse. `default`: the field's own."""
    names = _names(f)
    var = f.metadata.get(wiring.ENV_VAR) or runconfig.env_var(names[0])
    if os.environ.get(var):  # a field's own variable: its help names it already
        if wiring.ENV_VAR in f.metadata:
            return default, ""
        return _converted(os.environ[var], hint, kwargs, var), var
    found = next((settings[n] for n in (*names, f.name) if n in settings), None)
    if found is None:
        return default, ""
    return _converted(found.value, hint, kwargs, f"{found.source}: {names[0]}"), found.source


def _converted(value: Any, hint: Any, kwargs: dict[str, Any], source: str) -> Any:
    """A value from a file or a variable as the flag would take it; SettingError naming
    `source` if the flag would refuse it."""
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
            return text in ("1", "true", "yes", "on")
        raise SettingError(f"{source}: true or false is needed, not {value!r}")
    if value is None or (isinstance(value, str) and not value and kwargs.get("type") is None):
        return value
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    convert = kwargs.get("type") or str
    try:
        return convert(str(value))
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise SettingError(f"{source}: {exc}") from None


def _flag_kwargs(f: dataclasses.Field, hint: Any, doc: str, default: Any) -> dict[str, Any]:
    """argparse's keywords for a field's flag, its default aside (`_default`); `default`, the
    field's own, for its help."""
    doc = f.metadata.get("help") or doc
    if wiring.ENV_VAR in f.metadata:
        doc += f" (env {f.metadata[wiring.ENV_VAR]})"
    shown = f.metadata.get("default_help", default)
    if typing.get_origin(hint) is tuple:
        shown = ",".join(map(str, default))
    bounds = _bounds_text(f.metadata)
    kwargs: dict[str, Any] = {"dest": f.name, "help": (
        f"{doc}{f' ({bounds})' if bounds else ''} [default: {shown}]").strip()}
    if hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(hint) is tuple:
        item = _number(int, f.metadata)
        kwargs["type"] = lambda s, item=item: tuple(item(x) for x in s.split(",") if x)
        kwargs["metavar"] = "N,N"
    elif wiring.CHECK in f.metadata:
        kwargs["type"] = _checked(f.metadata[wiring.CHECK], f.metadata.get(wiring.ENV_VAR))
    elif wiring.ENDPOINT in f.metadata:
        kwargs["type"] = _endpoint(f.metadata[wiring.ENV_VAR],
                                   f.metadata[wiring.ENDPOINT] == wiring.DISCOVERABLE)
    else:  # `float | None`: a float when given
        kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        kwargs["type"] = _number(kind, f.metadata) if kind in (int, float) else kind
    return kwargs


def _bounds_text(bounds: typing.Mapping[str, Any]) -> str:
    """A field's bounds as its --help says them: "0 to 1", "at least 1", "above 0" or ""."""
    low, high, above = bounds.get("min"), bounds.get("max"), bounds.get("above")
    if low is not None and high is not None:
        return f"{low} to {high}"
    parts = [f"at least {low}" if low is not None else "",
             f"above {above}" if above is not None else "",
             f"at most {high}" if high is not None else ""]
    return ", ".join(part for part in parts if part)


def _number(kind: type, bounds: typing.Mapping[str, Any]) -> Callable[[str], Any]:
    """An argparse type for an int or float flag within the field's bounds (module docstring)."""
    low, high, above = bounds.get("min"), bounds.get("max"), bounds.get("above")

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{'an integer' if kind is int else 'a number'} is needed, not {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"a finite number is needed, not {text!r}")
        if ((low is not None and value < low) or (high is not None and value > high)
                or (above is not None and value <= above)):
            raise argparse.ArgumentTypeError(f"must be {_bounds_text(bounds)}, not {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _checked(check: Callable[[str], object], env_var: str | None) -> Callable[[str], str]:
    """An argparse type for a text flag whose field says how to check it (wiring.CHECK)."""

    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            source = f" (from {env_var})" if env_var and os.environ.get(env_var) == text else ""
            raise argparse.ArgumentTypeError(f"{exc}{source}") from None
        return text

    parse.__name__ = "text"
    return parse


def _endpoint(env_var: str, allow_empty: bool = False) -> Callable[[str], str]:
    """An argparse type for an endpoint flag (`topology.parse_endpoint`). argparse parses a
    string default too, so a bad STEPBUS_* variable is refused as well, naming it."""

    def parse(text: str) -> str:
        try:
            return topology.parse_endpoint(text, allow_empty=allow_empty)
        except ValueError as exc:
            source = f" (from {env_var})" if os.environ.get(env_var) == text else ""
            raise argparse.ArgumentTypeError(f"{exc}{source}") from None

    parse.__name__ = "endpoint"
    return parse


def _build_config(cls: type, args: argparse.Namespace) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = _build_config(hints[f.name], args)
        elif hasattr(args, f.name):  # else a field the command has no flag for: its default
            values[f.name] = getattr(args, f.name)
    return cls(**values)


M = TypeVar("M", bound=p.Message)


def _ask(endpoint: str, request: p.Message, timeout_s: float, keys: str = "") -> p.Message:
    """One request to the controller, and its answer.

    Raises:
        status.Unreachable: nobody answered within the timeout, or not readably (names the
            address).
        protocol.RemoteFailure: the answer was a REMOTE_ERROR, raised again with its fields.
    """
    import zmq  # as topology does; the CLI's other commands need none at start-up

    ctx = wiring.context(wiring.Security(keys=keys))
    try:
        sock = topology.open_role(ctx, Role.CLIENT, {"controller": endpoint})[PortName.CONTROLLER]
        deadline = time.monotonic() + timeout_s
        while not node.send(sock, request):  # no room yet (a refused handshake): try again
            if time.monotonic() >= deadline:
                raise status_view.Unreachable(f"controller unreachable at {endpoint} "
                                              f"(could not send within {timeout_s:g}s)")
            sock.poll(100, zmq.POLLOUT)  # room to queue
        while time.monotonic() < deadline:
            if sock.poll(100):
                frames = sock.recv_multipart(copy=False)
                try:
                    # a status reply grows with the processes in it
                    msg = p.decode(frames, max_header_bytes=STATUS_REPLY_MAX_BYTES)
                except p.ProtocolError as exc:
                    raise status_view.Unreachable(f"unreadable reply from the controller at "
                                                  f"{endpoint}: {exc}") from None
                if isinstance(msg, p.RemoteError):
                    raise p.RemoteFailure.of(msg)
                if not isinstance(msg, p.RunState):
                    return msg
        raise status_view.Unreachable(f"controller unreachable at {endpoint} "
                                      f"(no reply within {timeout_s:g}s)")
    finally:
        wiring.destroy(ctx)


def _expect(reply: p.Message, kind: type[M]) -> M:
    if not isinstance(reply, kind):
        raise status_view.Unreachable(f"the controller answered {reply.KIND.name}, not "
                                      f"{kind.KIND.name}")
    return reply


def _answer(reply: p.Message) -> int:
    """Print a REPLY's detail: exit 0 if the controller said yes, 1 if no."""
    done = _expect(reply, p.Reply)
    print(done.detail)
    return 0 if done.ok else 1


def _client(command: str, call: Callable[[], int]) -> int:
    """Run a client command; a controller that does not answer exits 2 (a setting: the address
    or the keys), a remote error 1, both with one message on stderr (a remote error with its
    traceback)."""
    try:
        return call()
    except status_view.Unreachable as exc:
        print(f"stepbus {command}: {exc}", file=sys.stderr)
        return Exit.SETTING
    except p.RemoteFailure as exc:
        context = f" {exc.context}" if exc.context else ""
        print(f"stepbus {command}: {exc}{context}", file=sys.stderr)
        if exc.traceback:
            print(f"remote traceback ({exc.origin}):\n{exc.traceback.rstrip()}", file=sys.stderr)
        return 1


def _parse_option(text: str) -> tuple[str, Any]:
    key, eq, raw = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _status(args: argparse.Namespace) -> int:
    def fetch() -> dict:
        reply = _expect(_ask(args.controller, p.StatusRequest(), args.timeout, args.keys),
                        p.StatusReply)
        return {"run_id": reply.run_id, "epoch": reply.epoch, "processes": reply.processes}

    if args.watch is not None:
        return status_view.watch(fetch, max(args.watch, 0.1), json_lines=args.json)
    status = fetch()
    print(status_view.as_json(status) if args.json else status_view.table(status))
    return 0


@functools.cache
def config_keys() -> frozenset[str]:
    """Every key a run configuration may set: each process's flags by their names (and the
    names they also answer to), `stepbus run`'s too. Worked out once per process."""
    from stepbus import serial

    keys: set[str] = set()
    classes = [command.config_class() for command in PROCESSES.values()] + [serial.Config]
    while classes:
        cls = classes.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                classes.append(hints[f.name])
            else:
                keys |= {f.name, *(n.replace("-", "_") for n in _names(f))}
    return frozenset(keys)


class _AllKeys:
    """`config_keys()`, computed (which imports every process's module) only once a run
    configuration file or preset is there to be checked."""

    def __iter__(self) -> typing.Iterator[str]:
        return iter(config_keys())


def build_parser(settings: dict[str, runconfig.Setting] | None = None, only: str | None = None
                 ) -> argparse.ArgumentParser:
    """`settings`: the run configuration's (default: `runconfig.load`, which may raise
    SettingError naming its file and line). `only`: the one process command given its flags
    (the others are listed, with their help, but not built), so that a process imports its
    own module and no other's; None builds them all (the docs, the tests), as does a run
    configuration, whose every value each process checks so that all refuse a bad file alike."""
    if settings is None:
        settings = runconfig.load(_AllKeys())
    only = None if settings else only
    parser = argparse.ArgumentParser(
        prog="stepbus", allow_abbrev=False,
        description="RL experience pipeline on a ZeroMQ bus. Start the five processes with "
        "`honcho start` (see Procfile) or one subcommand each.")
    parser.add_argument("--version", action="version", version=f"stepbus {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_process_parsers(sub, settings, only)
    plot = sub.add_parser("plot", help=PLOT_HELP, description=PLOT_HELP)
    plot.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                      help="a run directory, e.g. runs/latest")
    plot.add_argument("--output", "-o", type=Path, default=None, metavar="PNG",
                      help="where to write the PNG [default: RUN_DIR/progress.png]")
    _add_client_parsers(sub)
    evaluate.add_parser(sub)
    keys = sub.add_parser("keys", help=KEYS_HELP, description=KEYS_HELP)
    keys.add_argument("--dir", default="keys", help="directory to create the keys in")
    keys.add_argument("--client-of", default="", metavar="KEYS_DIR",
                      help="make a client-only directory for another host instead: a new client "
                           "keypair and the server's public key from KEYS_DIR, whose "
                           "authorized/ gets the new public key")
    export = sub.add_parser("export", help=EXPORT_HELP, description=EXPORT_HELP)
    export.add_argument("run", metavar="RUN", type=Path,
                        help="a run directory (e.g. runs/latest) or its checkpoint file")
    export.add_argument("--format", default="onnx", help="what to write: onnx (the one format)")
    export.add_argument("--output", "-o", type=Path, default=None, metavar="FILE",
                        help="where to write it [default: RUN_DIR/policy.onnx]")
    return parser


def _add_process_parsers(sub: Any, settings: dict[str, runconfig.Setting],
                         only: str | None) -> None:
    """The commands that run processes, each with its flags if it is `only` (or `only` is
    None), else with its help alone."""
    for name, command in PROCESSES.items():
        cmd = sub.add_parser(name, help=command.doc, description=command.doc,
                             allow_abbrev=False)
        if only in (None, name):
            _add_config_flags(cmd, command.config_class(), settings)
            _add_preset_flag(cmd)
    if only in (None, "run"):
        _add_run_parser(sub, settings)
    else:
        sub.add_parser("run", help=RUN_HELP, description=RUN_HELP, allow_abbrev=False)
    if only in (None, "supervise"):
        _add_supervise_parser(sub)
    else:
        sub.add_parser("supervise", help=SUPERVISE_HELP, description=SUPERVISE_HELP,
                       allow_abbrev=False)


def _add_client_parsers(sub: Any) -> None:
    """status, reset and shutdown: requests to the controller."""
    for name, doc in (("status", "one table of every live process, from the controller: role, "
                                 "name, host, pid, uptime, heartbeat age, steps/s, queues, "
                                 "dropped, rejected, policy version and lag, training and "
                                 "eval return; exits 2 naming "
                                 "the address when the controller does not answer"),
                      ("reset", "reset barrier: pause, drain, reset every env, resume"),
                      ("shutdown", "stop the whole pipeline through the controller")):
        cmd = sub.add_parser(name, help=doc, description=doc, allow_abbrev=False)
        cmd.add_argument("--controller", default=wiring.ENDPOINTS["controller"].resolve(),
                         type=_endpoint(wiring.ENDPOINTS["controller"].env_var),
                         help="controller endpoint (env STEPBUS_CONTROLLER)")
        cmd.add_argument("--timeout", type=_number(float, {"above": 0}),
                         default=15.0 if name == "reset" else 5.0,
                         help="seconds to wait for the controller's answer")
        _add_keys_flag(cmd)
        if name == "status":
            cmd.add_argument("--json", action="store_true",
                             help="print JSON for scripts: every figure of every process")
            cmd.add_argument("--watch", nargs="?", type=_number(float, {"above": 0}), const=2.0,
                             default=None,
                             metavar="SECONDS",
                             help="refresh in place every SECONDS (default 2) until Ctrl-C; "
                                  "with --json, one JSON document per line")
        if name == "reset":
            cmd.add_argument("--option", action="append", type=_parse_option, default=[],
                             metavar="KEY=VALUE",
                             help="passed to env.reset(options=...); VALUE parsed as JSON "
                                  "when it is JSON, else a string; repeatable")


def _add_run_parser(sub: Any, settings: dict[str, runconfig.Setting]) -> None:
    """`stepbus run` takes the flags of the five processes (one flag for a setting two share,
    as --seed or --model), less what a serial run decides itself (`serial.NOT_SERIAL`)."""
    from stepbus import serial

    cmd = sub.add_parser("run", help=RUN_HELP, description=RUN_HELP, allow_abbrev=False)
    skip = set(serial.NOT_SERIAL)
    for cls in (serial.Config, *(PROCESSES[name].config_class() for name in
                                 ("worker", "assembler", "learner", "broker", "controller",
                                  "evaluator"))):
        _add_config_flags(cmd, cls, settings, skip)
    _add_preset_flag(cmd)


def _add_preset_flag(cmd: argparse.ArgumentParser) -> None:
    """Read before the parser is built (`main`), since a preset sets other flags' defaults."""
    cmd.add_argument("--preset", metavar="NAME", default=os.environ.get(runconfig.PRESET_ENV, ""),
                     help=f"settings shipped for an env ({', '.join(runconfig.presets())}), "
                          f"under the run configuration's own (env {runconfig.PRESET_ENV}; "
                          f"docs/tuning.md)")


def serial_roles(flags: list[str]) -> serial.Roles:
    """The settings of a serial run from `stepbus run` flags (for tests and notebooks: then
    `serial.run(roles)`). A bad flag exits 2, as on the command line."""
    return _roles(build_parser(only="run").parse_args(["run", *flags]))


def _run_serial(args: argparse.Namespace) -> int:
    from stepbus import serial

    node.setup_logging("run")
    return serial.run(_roles(args))


def _roles(args: argparse.Namespace) -> serial.Roles:
    from stepbus import serial

    def config(name: str) -> Any:
        return _build_config(PROCESSES[name].config_class(), args)

    return serial.Roles(controller=config("controller"), broker=config("broker"),
                        worker=config("worker"), assembler=config("assembler"),
                        learner=config("learner"), run=_build_config(serial.Config, args),
                        evaluator=config("evaluator"))


def _add_supervise_parser(sub: Any) -> None:
    from stepbus.bus import supervisor

    cmd = sub.add_parser("supervise", help=SUPERVISE_HELP, description=SUPERVISE_HELP,
                         allow_abbrev=False,
                         usage="stepbus supervise [options] ROLE [ROLE FLAGS ...]")
    cmd.add_argument("role", metavar="ROLE", choices=supervisor.SUPERVISED_ROLES,
                     help=f"the process to run: {', '.join(supervisor.SUPERVISED_ROLES)} (the "
                          "trainer slot supervises its learners itself)")
    cmd.add_argument("flags", nargs=argparse.REMAINDER, metavar="ROLE FLAGS",
                     help="the role's own flags, checked before anything starts")
    cmd.add_argument("--quick-deaths", type=_number(int, {"min": 1}),
                     default=supervisor.QUICK_DEATHS_LIMIT,
                     metavar="N", help="give up after N deaths in a row of children that ran "
                     f"under 30 s each [default: {supervisor.QUICK_DEATHS_LIMIT}]")
    cmd.add_argument("--silence-s", type=_number(float, {"min": 0}), default=None,
                     metavar="S", help="kill and restart a child that sent no heartbeat for S "
                     "seconds (frozen, or hung in native code), or for half that (at least "
                     f"{node.LIVENESS_S:g} s) while it is not running at all (stopped by a "
                     "tracer, or asleep using no CPU: give an env whose calls wait with the GIL "
                     "held twice their length); one stopped by a signal is continued (SIGCONT) "
                     "then instead; its start-up has "
                     f"{supervisor.STARTUP_GRACE_S:g} s before its first beat; 0: never [default: "
                     f"{supervisor.SILENT_S:g}; 0 for the evaluator, which runs at idle priority "
                     "and may starve by design]")
    cmd.add_argument("--on-give-up", choices=[g.value for g in supervisor.GiveUp], default=None,
                     help="exit: exit 1, which ends a honcho run; stay: keep reporting the "
                          "last error while the run goes on [default: stay for a worker, one "
                          "of many, and the evaluator; exit for every other role]")


def _supervise(args: argparse.Namespace) -> int:
    if args.quick_deaths < 1:
        raise SettingError(f"--quick-deaths must be at least 1, not {args.quick_deaths}")
    if args.silence_s is not None and 0 < args.silence_s < 1:
        raise SettingError(f"--silence-s must be 0 (never) or at least 1 (heartbeats come "
                           f"every 0.5 s), not {args.silence_s:g}")
    from stepbus.bus import supervisor

    # bad flags: exit 2 here
    child = build_parser(only=args.role).parse_args([args.role, *args.flags])
    config = _build_config(PROCESSES[args.role].config_class(), child)
    give_up = (supervisor.GiveUp(args.on_give_up) if args.on_give_up
               else supervisor.default_give_up(args.role))
    return supervisor.run(args.role, args.flags, controller=config.controller,
                          security=config.security, give_up=give_up,
                          quick_deaths_limit=args.quick_deaths,
                          silent_s=(supervisor.default_silence(args.role)
                                    if args.silence_s is None else args.silence_s),
                          entry=functools.partial(main, [args.role, *args.flags]))


def swap_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepbus trainer swap", description=SWAP_HELP,
                                     allow_abbrev=False,
                                     usage="%(prog)s [options] [LEARNER FLAGS ...]")
    parser.add_argument("--slot", default="",
                        help="name of the trainer slot (default: the only one registered)")
    parser.add_argument("--controller", default=wiring.ENDPOINTS["controller"].resolve(),
                        type=_endpoint(wiring.ENDPOINTS["controller"].env_var),
                        help="controller endpoint (env STEPBUS_CONTROLLER)")
    parser.add_argument("--timeout", type=_number(float, {"above": 0}), default=30.0,
                        help="seconds to wait for the swap to be done")
    _add_keys_flag(parser)
    return parser


def _add_keys_flag(parser: argparse.ArgumentParser) -> None:
    keys = next(f for f in dataclasses.fields(wiring.Security) if f.name == "keys")
    parser.add_argument("--keys", default=wiring.Security().keys, help=keys.metadata["help"])


def _flag_fields(cls: type) -> dict[str, str]:
    """Every flag of a Config class, its groups' too, with the field it sets: aliases
    (`--lr`, `--learning-rate`) name the same one."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out |= _flag_fields(hints[f.name])
        else:
            out |= {_flag(name): f.name for name in _names(f)}
    return out


def merged_learner_flags(earlier: list[str], later: list[str]) -> list[str]:
    """A trainer slot's learner flags after a swap: `earlier` less what `later` sets again,
    then `later`. Later flags won already; dropping the values they override keeps a slot
    swapped every minute for days at one value per setting on its learner's command line."""
    fields = _flag_fields(PROCESSES["learner"].config_class())

    def units(flags: list[str]) -> list[tuple[str, list[str]]]:
        """(the setting a flag sets, the flag and its values): a flag begins at `--`; what
        follows it up to the next one is its values (negative numbers included)."""
        out: list[tuple[str, list[str]]] = []
        for token in flags:
            if token.startswith("--") or not out:
                name = token.split("=", 1)[0]
                out.append((fields.get(name, name), [token]))
            else:
                out[-1][1].append(token)
        return out

    again = {setting for setting, _ in units(later)}
    return [token for setting, tokens in units(earlier) if setting not in again
            for token in tokens] + later


def learner_flags_problem(flags: list[str]) -> str:
    """Why `stepbus learner FLAGS` would not parse (empty if it would): the slot checks a swap
    before stopping the learner it has."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            build_parser(only="learner").parse_args(["learner", *flags])
        except SystemExit:
            return stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue() else "invalid"
    return ""


def main(argv: list[str] | None = None) -> int:
    """Run one command. A setting that cannot work (`SettingError`) exits 2 with one line naming
    it, never a traceback, so a supervisor gives up on it at once (docs/operations.md#exit-codes).
    """
    argv = sys.argv[1:] if argv is None else argv
    command = "trainer swap" if argv[:2] == ["trainer", "swap"] else next(iter(argv), "")
    try:
        _take_preset(argv)
        return _command(_take_resume(argv))
    except SettingError as exc:
        print(f"stepbus {command}: {exc}", file=sys.stderr)
        if command in PROCESSES or command == "supervise":
            _exit_now(Exit.SETTING)
        return Exit.SETTING


def _take_preset(argv: list[str]) -> None:
    """`--preset NAME` sets the defaults of the flags after it, so it is read before the
    parser is built, as STEPBUS_PRESET, which the processes a command starts inherit."""
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            os.environ[runconfig.PRESET_ENV] = argv[i + 1]
        elif arg.startswith("--preset="):
            os.environ[runconfig.PRESET_ENV] = arg.partition("=")[2]
        elif arg == "--":
            return


def _take_resume(argv: list[str]) -> list[str]:
    """`--resume RUN` or STEPBUS_RESUME: the run's own configuration, set before the parser
    is built, as a preset is (trainer/resume.py). Imported only for a resume."""
    if not os.environ.get("STEPBUS_RESUME") and not any(a.startswith("--resume") for a in argv):
        return argv
    from stepbus.trainer import resume

    return resume.prepare(argv)


def _exit_now(code: int) -> typing.NoReturn:
    """Sockets are closed and files written by now. Skip interpreter finalisation: it restores
    default signal handlers, so honcho's SIGTERM to a process already exiting would turn a clean
    exit 0 into death by signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _command(argv: list[str]) -> int:
    if argv[:2] == ["trainer", "swap"]:
        opts, flags = swap_parser().parse_known_args(argv[2:])
        problem = learner_flags_problem(flags)
        if problem:
            raise SettingError(problem)
        swap = p.TrainerSwap(slot=opts.slot, args=flags)
        return _client("trainer swap", lambda: _answer(
            _ask(opts.controller, swap, opts.timeout, opts.keys)))
    given = next(iter(argv), "")
    args = build_parser(only=None if given.startswith("-") else given).parse_args(argv)
    if args.command == "plot":
        from stepbus import plot as stepbus_plot

        try:
            print(stepbus_plot.plot(args.run_dir, args.output))
        except stepbus_plot.NoMetrics as exc:
            print(f"stepbus plot: {exc}", file=sys.stderr)
            return 1
        return 0

    if args.command in PROCESSES or args.command == "supervise":
        node.supervisor_beat()  # its pipe taken before any env or child is made (it is ours)
        if args.command == "supervise":
            code = _supervise(args)
        elif args.command == "trainer":
            code = PROCESSES["trainer"].runner()(
                _build_config(PROCESSES["trainer"].config_class(), args), argv[1:],
                learner_flags_problem, merged_learner_flags,
                entry=functools.partial(main, ["learner", *argv[1:]]))
        else:
            command = PROCESSES[args.command]
            code = command.runner()(_build_config(command.config_class(), args))
        _exit_now(code)
    if args.command == "run":
        return _run_serial(args)
    if args.command == "eval":
        return evaluate.main(args)
    if args.command == "keys":
        for path in wiring.make_keys(args.dir, args.client_of):
            print(path)
        return 0
    if args.command == "export":
        from stepbus import export

        print(export.export_run(args.run, args.format, args.output).path)
        return 0
    if args.command == "status":
        return _client("status", lambda: _status(args))
    request: p.Message = (p.ResetRequest(options=dict(args.option)) if args.command == "reset"
                          else p.ShutdownRequest(reason="stepbus shutdown"))
    return _client(args.command, lambda: _answer(
        _ask(args.controller, request, args.timeout, args.keys)))


if __name__ == "__main__":
    sys.exit(main())
