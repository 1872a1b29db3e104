"""Loading user code named on the command line as `module:attribute`."""

from __future__ import annotations

import importlib
from typing import Any


def load_object(path: str) -> Any:
    """The object `module:attr.sub` names; ValueError if the text is not of that form."""
    module, colon, attr = path.partition(":")
    if not colon or not module or not all(part.isidentifier() for part in attr.split(".")):
        raise ValueError(f"expected module:attribute, got {path!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
