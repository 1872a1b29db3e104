"""Atomic checkpoints: params, optimiser state and run progress in one .npz (the numpy MLP) or
one .safetensors (a torch model: its state_dict and Adam's moments as tensors, the progress as
JSON in the header), never a pickle; and what waits for the next one.

A checkpoint is read as hostile input: one a learner cannot use (truncated, not the format, a
pickle, dtypes or sizes stepbus never writes, non-finite values) is refused with one line
naming the file and what is wrong, `CannotStart`, so the learner exits 2 instead of dumping a
traceback, hanging or loading something it should not."""

from __future__ import annotations

import contextlib
import json
import math
import os
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from stepbus.trainer.algorithm import CannotStart

NPZ_FILE = "checkpoint.npz"  # the numpy MLP's
TORCH_FILE = "checkpoint.safetensors"  # a torch model's
FILE_NAMES = (NPZ_FILE, TORCH_FILE)
# What the first bytes of a file that is no checkpoint say it is, for the refusal's line.
MAGIC = ((b"PK\x03\x04", "a zip archive (torch.save writes those; stepbus never unpickles)"),
         (b"\x80", "a pickle (stepbus never unpickles)"),
         (b"\x93NUMPY", "a bare .npy array"))
# A torch checkpoint's tensors as numpy holds them (weights cross the bus as numpy arrays):
# safetensors' dtype names. bfloat16 and float8 are not among them.
SAFETENSORS_DTYPES = frozenset({"BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "F32", "F64"})
# Of a torch checkpoint: the model's tensors must fit in a WEIGHTS message (bus/protocol.py's
# MAX_ARRAYS, MAX_ARRAY_BYTES), and the optimiser keeps a few per parameter.
MAX_TENSOR_BYTES = 1 << 30
MAX_MODEL_TENSORS = 256
MAX_TENSORS = 8 * MAX_MODEL_TENSORS
RETRY_AFTER_FAILURE_S = 1.0  # a checkpoint that could not be written (a full disk) is tried again


def save(path: Path, params: dict[str, np.ndarray], optimizer: dict[str, np.ndarray],
         progress: dict[str, Any]) -> None:
    """Write to a temp file, then rename: a reader never sees half a checkpoint."""
    arrays: dict[str, Any] = {f"param/{k}": v for k, v in params.items()}
    arrays |= {f"optimizer/{k}": v for k, v in optimizer.items()}
    arrays["meta"] = np.frombuffer(json.dumps({"progress": progress}).encode(), dtype=np.uint8)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _removed_if_failed(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


@contextlib.contextmanager
def _removed_if_failed(tmp: Path) -> Iterator[None]:
    """A temp file a failed write or rename leaves (a full disk) is removed: it would hold the
    space the next try needs, and the last good checkpoint is untouched."""
    try:
        yield
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def refuse(path: Path, problem: str) -> NoReturn:
    """The learner's one line for a checkpoint it cannot use."""
    raise CannotStart(f"checkpoint {path} {problem}: start a new run (another --run-dir) or "
                      "restore a good copy of it")


def check_file(path: Path, what: str, own: bytes = b"") -> None:
    """A regular file (a FIFO would block the reader) whose first bytes are not those of
    something else (`own`: those of its own format). Raises CannotStart."""
    if not path.is_file():
        refuse(path, "is not a regular file")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        refuse(path, f"cannot be read ({exc.strerror or exc})")
    for magic, kind in MAGIC:
        if head.startswith(magic) and not (own and head.startswith(own)):
            refuse(path, f"is {kind}, not {what}")


def progress_of(path: Path, text: str) -> dict[str, Any]:
    """The run's progress a checkpoint carries: a JSON object. Raises CannotStart."""
    try:
        progress = json.loads(text)
    except (ValueError, RecursionError) as exc:
        refuse(path, f"has a progress record that is not JSON ({exc})")
    if not isinstance(progress, dict):
        refuse(path, f"has a progress record that is a {type(progress).__name__}, not a JSON "
                     "object")
    return progress


def load(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """Params, optimiser state and progress. Raises CannotStart for a file that is not such a
    checkpoint."""
    progress, arrays = _read_npz(path, arrays=True)
    check_values(path, arrays)
    params = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("param/")}
    optimizer = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("optimizer/")}
    return params, optimizer, progress


def _read_npz(path: Path, *, arrays: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The progress record of an .npz checkpoint, and its arrays if `arrays` (copied out of
    the file; else none are read). Raises CannotStart for a file that is no checkpoint."""
    check_file(path, "an .npz", own=b"PK\x03\x04")
    try:
        with np.load(path, allow_pickle=False) as data:
            if "meta" not in data.files:
                refuse(path, "is not a stepbus checkpoint (no meta record)")
            meta = data["meta"].tobytes().decode()
            out = {k: data[k].copy() for k in data.files if k != "meta"} if arrays else {}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        refuse(path, f"is not a readable .npz ({type(exc).__name__}: {exc})"[:300])
    record = progress_of(path, meta)
    if not isinstance(record.get("progress"), dict):
        refuse(path, "has no progress record")
    return record["progress"], out


def progress_only(path: Path) -> dict[str, Any]:
    """The progress record of a checkpoint of either kind, its weights unread (a torch
    model's without importing torch): what `stepbus trainer --resume` looks at before anything
    starts. Raises CannotStart for a file that is no checkpoint."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        check_file(path, "a safetensors file")
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            refuse(path, f"is not a readable safetensors file ({exc})"[:300])
        return progress_of(path, meta.get("progress", "{}"))
    return _read_npz(path, arrays=False)[0]


def check_values(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Numbers, and finite floats: a checkpoint stepbus wrote never holds anything else."""
    for name, value in arrays.items():
        if value.dtype.kind not in "biuf":
            refuse(path, f"holds {name} of dtype {value.dtype}, not numbers")
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            refuse(path, f"holds non-finite values in {name}")


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
    with _removed_if_failed(tmp):
        save_file(tensors, str(tmp), metadata={"progress": json.dumps(progress)})
        _replace_synced(tmp, path)


def load_torch(path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A torch model's state_dict, optimiser tensors and progress, as `save_torch` wrote them
    (safetensors: tensors and a JSON header, nothing that runs code). Its header is judged
    before a tensor is read: dtypes numpy holds, sizes a WEIGHTS message carries. Raises
    CannotStart for a file that is not such a checkpoint."""
    from safetensors import SafetensorError, safe_open

    check_file(path, "a safetensors file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta, names = f.metadata() or {}, f.keys()
            check_layout(path, {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape())
                                for k in names})
            tensors = {k: f.get_tensor(k) for k in names}
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        refuse(path, f"is not a readable safetensors file ({exc})"[:300])
    check_values(path, {k: v.numpy() for k, v in tensors.items()})
    model = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("model/")}
    optimizer = {k.split("/", 1)[1]: v for k, v in tensors.items()
                 if k.startswith("optimizer/")}
    check_optimizer(path, model, optimizer)
    return model, optimizer, progress_of(path, meta.get("progress", "{}"))


def check_layout(path: Path, layout: dict[str, tuple[str, list[int]]]) -> None:
    """Names, dtypes and sizes from a safetensors header, before any tensor is read."""
    if len(layout) > MAX_TENSORS:
        refuse(path, f"holds {len(layout)} tensors, more than {MAX_TENSORS}")
    if sum(name.startswith("model/") for name in layout) > MAX_MODEL_TENSORS:
        refuse(path, f"holds a model of more than {MAX_MODEL_TENSORS} tensors")
    for name, (dtype, shape) in layout.items():
        if not name.startswith(("model/", "optimizer/")):
            refuse(path, f"holds {name!r}, neither a model/ nor an optimizer/ tensor")
        if dtype not in SAFETENSORS_DTYPES:
            refuse(path, f"holds {name} of dtype {dtype}, which stepbus never writes")
        itemsize = 1 if dtype in ("BOOL", "U8", "I8") else int(dtype[1:]) // 8
        if math.prod(shape) * itemsize > MAX_TENSOR_BYTES:
            refuse(path, f"holds {name} of shape {shape}, over {MAX_TENSOR_BYTES >> 30} GiB")


def check_optimizer(path: Path, model: dict[str, Any], optimizer: dict[str, Any]) -> None:
    """An optimiser tensor of a parameter (`name/field`, as TorchPPO names Adam's moments) is
    one number (a step count) or of the parameter's shape: else it would load, and the first
    update would fail long after the learner said it resumed."""
    for key, value in optimizer.items():
        param = model.get(key.rpartition("/")[0])
        if param is not None and value.numel() != 1 and value.shape != param.shape:
            refuse(path, f"holds optimizer/{key} of shape {list(value.shape)}, its parameter's "
                         f"is {list(param.shape)}")


@dataclass
class Unsaved:
    """What waits for the learner's next checkpoint (its "learned" receipts wait too, in
    `Receipts`): the metrics records of the updates it will hold, written only once they are
    on disk, so metrics.jsonl never runs ahead of the checkpoint a successor resumes. Due at
    most every `interval_s`."""

    interval_s: float
    last: float = -math.inf  # when the last checkpoint was written (or failed to be)
    since: float | None = None  # when the oldest learning not on disk was settled
    records: list[dict[str, Any]] = field(default_factory=list)
    written: int = 0  # checkpoints this learner wrote
    write_ms: float = 0.0  # how long the last one took
    held_ms: float = 0.0  # how long the last one's oldest learning waited for it
    failed: int = 0  # writes that failed since the last one that did not (a full disk)
    failures: int = 0  # writes that failed, in all

    def settled(self, now: float) -> float:
        """Learning (or a drop) happened that a checkpoint must hold; when that is due."""
        if self.since is None:
            self.since = now
        return self.last + (self.interval_s if not self.failed else
                            max(self.interval_s, RETRY_AFTER_FAILURE_S))

    def failed_at(self, now: float) -> bool:
        """A checkpoint could not be written at `now`: what waits for it goes on waiting, the
        next try not before RETRY_AFTER_FAILURE_S. True for the first failure in a row."""
        self.last = now
        self.failed += 1
        self.failures += 1
        return self.failed == 1

    def wrote(self, began: float, now: float) -> list[dict[str, Any]]:
        """A checkpoint was written from `began` to `now`; the records it released."""
        self.written, self.failed = self.written + 1, 0
        self.write_ms = (now - began) * 1000
        self.held_ms = 0.0 if self.since is None else (now - self.since) * 1000
        self.last, self.since = now, None
        records, self.records = self.records, []
        return records

    def figures(self) -> dict[str, float]:
        return {"checkpoints": self.written, "checkpoint_ms": round(self.write_ms, 2),
                "checkpoint_held_ms": round(self.held_ms, 1),
                "checkpoint_failures": self.failures}
