"""One run configuration: a TOML file every process reads, so a run's settings live in one
place instead of on five Procfile lines.

`stepbus.toml` next to the Procfile (the working directory), or the file `STEPBUS_CONFIG`
names, holds settings by their flag names (`learning_rate = 3e-4`, `envs_per_worker = 16`,
`env_kwargs = {max_episode_steps = 200}`), at the top or under tables whose names only group
them (`[env]`, `[algorithm]`); every process takes the keys its flags have. A `preset` key (or
`--preset`, `STEPBUS_PRESET`) names a file shipped in `stepbus/presets/`, whose settings the
file's own override. Precedence, lowest first: the built-in default, the preset, the file, a
`STEPBUS_<FLAG>` variable (honcho reads `.env`), the flag itself. A key no command has, or a
value its flag would refuse, is one line naming the file and the line, and exit 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepbus.bus import wiring
from stepbus.bus.exits import SettingError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_ENV = "STEPBUS_CONFIG"
PRESET_ENV = "STEPBUS_PRESET"
DEFAULT_FILE = "stepbus.toml"
PRESETS = Path(__file__).resolve().parent / "presets"
RESERVED = ("preset", "stepbus_version")  # keys that are no flag
VALUE_TABLES = ("env_kwargs",)  # keys whose value is a table, not a group of keys


@dataclass(frozen=True)
class Setting:
    """A value from a file, and where it came from, for the line that refuses it."""

    value: Any
    source: str


def env_var(key: str) -> str:
    """The variable that sets a flag's value for every process: STEPBUS_<FLAG>."""
    return "STEPBUS_" + key.upper().replace("-", "_")


def presets() -> list[str]:
    return sorted(path.stem for path in PRESETS.glob("*.toml"))


def load(known: Iterable[str] | None = None, environ: Mapping[str, str] | None = None,
         cwd: Path | None = None) -> dict[str, Setting]:
    """The run configuration's settings by key (the preset's under the file's), each with its
    source. Raises SettingError for a file that cannot be read or holds a key not `known`
    (None: any key; the CLI checked them already)."""
    environ = os.environ if environ is None else environ
    named = environ.get(CONFIG_ENV, "")
    path = Path(named) if named else (cwd or Path.cwd()) / DEFAULT_FILE
    if named and not path.is_file():
        raise SettingError(f"{CONFIG_ENV}={named}: no such file")
    settings = read(path, known) if path.is_file() else {}
    preset = environ.get(PRESET_ENV) or settings.pop("preset", Setting("", "")).value
    settings.pop("stepbus_version", None)
    if preset:
        settings = {**read_preset(str(preset), known), **settings}
    return settings


def read_preset(name: str, known: Iterable[str] | None) -> dict[str, Setting]:
    path = PRESETS / f"{name}.toml"
    if not re.fullmatch(r"[a-z0-9_-]+", name) or not path.is_file():
        raise SettingError(f"no preset {name!r}; there are {', '.join(presets())}")
    found = read(path, known, label=f"preset {name}")
    found.pop("preset", None)
    found.pop("stepbus_version", None)
    return found


def read(path: Path, known: Iterable[str] | None, label: str = "") -> dict[str, Setting]:
    """A file's settings; SettingError naming the file (or `label`) and line for what cannot
    be used."""
    text = path.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingError(f"{path}: {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in VALUE_TABLES:
            flat.update(value)  # a table only groups its keys
        else:
            flat[key] = value
    names = set(known or ()) | set(RESERVED)
    settings = {}
    for key, value in flat.items():
        source = f"{label or path} line {line_of(text, key)}"
        if known is not None and key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SettingError(f"{source}: unknown key {key!r}{hint}")
        table = key in VALUE_TABLES and isinstance(value, dict)
        settings[key] = Setting(json.dumps(value) if table else value, source)
    return settings


def line_of(text: str, key: str) -> int:
    """The line a key is set on (1-based; 0 when it cannot be told)."""
    pattern = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.match(line):
            return number
    return 0


NOT_RECORDED = ("security", "run_dir", "runs_dir", "resume", "name", "worker_index")


def recorded(config: Any) -> dict[str, Any]:
    """A process's settings as a run configuration names them (flag names; endpoints, keys
    and where runs live left out: they are the host's, not the run's)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in NOT_RECORDED or wiring.ENDPOINT in f.metadata:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out |= recorded(value)
        else:
            out[f.metadata.get("flag", f.name)] = value
    return out


def dumps(settings: Mapping[str, Any], header: str) -> str:
    """Settings as a file `load` reads back (None values left out: their defaults)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for key, value in settings.items():
        if value is not None:
            lines.append(f"{key} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string is a JSON string
