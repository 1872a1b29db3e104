"""Atomic checkpoints: params, optimiser moments and run progress in one .npz, no pickle."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from stepbus.trainer.model import Adam


def save(path: Path, params: dict[str, np.ndarray], adam: Adam, progress: dict[str, Any]) -> None:
    """Write to a temp file, then rename: a reader never sees half a checkpoint."""
    arrays = {f"param/{k}": v for k, v in params.items()}
    arrays |= {f"adam_m/{k}": v for k, v in adam.m.items()}
    arrays |= {f"adam_v/{k}": v for k, v in adam.v.items()}
    meta = {"progress": progress, "adam_t": adam.t}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path, adam: Adam) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Params and progress; fills `adam`'s moments in place."""
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        params = {k.split("/", 1)[1]: data[k].copy() for k in data.files if k.startswith("param/")}
        adam.m = {k.split("/", 1)[1]: data[k].copy() for k in data.files if k.startswith("adam_m/")}
        adam.v = {k.split("/", 1)[1]: data[k].copy() for k in data.files if k.startswith("adam_v/")}
    adam.t = int(meta["adam_t"])
    return params, meta["progress"]
