"""Atomic checkpoints: params, optimiser state and run progress in one .npz (the numpy MLP) or
one .safetensors (a torch model: its state_dict and Adam's moments as tensors, the progress as
JSON in the header), never a pickle; and what waits for the next one."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
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


def _replace_synced(tmp: Path, path: Path) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def save_torch(path: Path, model: Mapping[str, Any], optimizer: Mapping[str, Any],
               progress: dict[str, Any]) -> None:
    """A torch model's checkpoint (tensors by name, `safetensors.torch.save_file`), written to
    a temp file and renamed like `save`. Imports torch: only a torch model's learner calls it."""
    from safetensors.torch import save_file

    # Own contiguous CPU copies: safetensors refuses views and tensors that share memory.
    tensors = {f"model/{k}": v.detach().cpu().contiguous().clone() for k, v in model.items()}
    tensors |= {f"optimizer/{k}": v.detach().cpu().contiguous().clone()
                for k, v in optimizer.items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"progress": json.dumps(progress)})
    _replace_synced(tmp, path)


def load_torch(path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A torch model's state_dict, optimiser tensors and progress, as `save_torch` wrote them
    (`safetensors.torch.load_file`: tensors and a JSON header, nothing that runs code)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    model = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("model/")}
    optimizer = {k.split("/", 1)[1]: v for k, v in tensors.items()
                 if k.startswith("optimizer/")}
    return model, optimizer, json.loads(meta.get("progress", "{}"))


@dataclass
class Unsaved:
    """What waits for the learner's next checkpoint (its "learned" receipts wait too, in
    `Receipts`): the metrics records of the updates it will hold, written only once they are
    on disk, so metrics.jsonl never runs ahead of the checkpoint a successor resumes. Due at
    most every `interval_s`."""

    interval_s: float
    last: float = -math.inf  # when the last checkpoint was written
    since: float | None = None  # when the oldest learning not on disk was settled
    records: list[dict[str, Any]] = field(default_factory=list)
    written: int = 0  # checkpoints this learner wrote
    write_ms: float = 0.0  # how long the last one took
    held_ms: float = 0.0  # how long the last one's oldest learning waited for it

    def settled(self, now: float) -> float:
        """Learning (or a drop) happened that a checkpoint must hold; when that is due."""
        if self.since is None:
            self.since = now
        return self.last + self.interval_s

    def wrote(self, began: float, now: float) -> list[dict[str, Any]]:
        """A checkpoint was written from `began` to `now`; the records it released."""
        self.written += 1
        self.write_ms = (now - began) * 1000
        self.held_ms = 0.0 if self.since is None else (now - self.since) * 1000
        self.last, self.since = now, None
        records, self.records = self.records, []
        return records

    def figures(self) -> dict[str, float]:
        return {"checkpoints": self.written, "checkpoint_ms": round(self.write_ms, 2),
                "checkpoint_held_ms": round(self.held_ms, 1)}
