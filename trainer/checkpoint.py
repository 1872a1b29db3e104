"""Atomic checkpoints: params, optimiser state and run progress in one .npz, no pickle."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np


def save(path: Path, params: dict[str, np.ndarray], optimizer: dict[str, np.ndarray],
         progress: dict[str, Any]) -> None:
    """Write to a temp file, then rename: a reader never sees half a checkpoint."""
    arrays: dict[str, Any] = {f"param/{k}": v for k, v in params.items()}
    arrays |= {f"optimizer/{k}": v for k, v in optimizer.items()}
    arrays["meta"] = np.frombuffer(json.dumps({"progress": progress}).encode(), dtype=np.uint8)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """Params, optimiser state and progress."""
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        params = {k.split("/", 1)[1]: data[k].copy() for k in data.files if k.startswith("param/")}
        optimizer = {k.split("/", 1)[1]: data[k].copy() for k in data.files
                     if k.startswith("optimizer/")}
    return params, optimizer, meta["progress"]
