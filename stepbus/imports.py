"""Loading user code named on the command line as `module:attribute`."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def load_object(path: str) -> Any:
    """The object `module:attr.sub` names; ValueError if the text is not of that form. The
    working directory is searched too (the `stepbus` script, unlike `python -m`, leaves it
    out), so `--env mymodule:make` finds mymodule.py where honcho runs."""
    module, colon, attr = path.partition(":")
    if not colon or not module or not all(part.isidentifier() for part in attr.split(".")):
        raise ValueError(f"expected module:attribute, got {path!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module next to the Procfile, as `python -m` finds it
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
