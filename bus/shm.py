"""Observation frames through shared memory for a worker on the broker's host (`--shm-frames`).

A worker's observations cross three sockets (worker -> broker -> assembler -> learner) and cost
CPU at each end of each hop; on one host the first two hops can carry a slot number instead.
The worker owns one segment, `/dev/shm/stepbus-<name>-<incarnation>` (mode 0600, created
exclusively as `<that>.part<pid>` and renamed once its header is whole), of SLOTS slots of one
batch of observation rows each, after a one-page header. A slot holds every leaf of the batch
(one for a Box observation space, one per leaf of any other, `bus/rows.py`), each leaf's rows
in one block, the blocks of wider items first and every slot on a cache line, so that each
block stays aligned; both ends lay a slot out from the batch's layout (`slot_obs`), which the
messages carry as zero-row arrays:

    int64 [0] MAGIC  [1:3] nonce (16 random bytes, also in the worker's hello)  [3] creator pid
          [4] slots  [5] rows per slot  [6] bytes per row  [7] reader stamp (CLOCK_MONOTONIC ns)
          [8] broker mark: 1 = the broker maps it (set before each RESET, cleared by the worker)
          [9 : 9 + slots]            written: the sequence number of the batch in each slot
                                              (-1 while it is being written or never was)
          [9 + slots : 9 + 2 slots]  released: the sequence number its reader has finished with

The worker uses slots from a RESET on only if the broker marked the segment before sending it
(the worker clears the mark as it reads it), so a broker that cannot map the segment (another
host) gets rows; one batch sent to a new broker that cannot read it is refused and answered
with a RESET, which then finds no mark.

Lifetimes: the worker writes a batch only into a slot whose last batch was released (else that
batch goes on the socket), so a slot is never rewritten while the broker or the assembler may
still read it. The broker reads a batch for inference, then forwards its slot number if the
assembler stamped the segment within READER_FRESH_S (it maps it too), else copies the rows onto
the socket and releases the slot itself. The assembler copies a slot's rows, checks that the
slot still holds the same sequence number (a mismatch is counted and cuts that worker's
trajectories, never used silently), and releases it. A slot whose release never comes (its
message died with a killed assembler) is taken back after RECLAIM_S.

Readers open by name with plain `mmap` (not `multiprocessing.shared_memory`, whose resource
tracker would unlink the segment when a reader exits), and only our own prefix, our own uid,
the exact size the header implies and the hello's nonce: a name on the wire is untrusted.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
import time

import numpy as np

from stepbus.bus import rows as obs_rows
from stepbus.bus.rows import Obs

DIR = "/dev/shm"
PREFIX = "stepbus-"
# Batches a worker may have in flight in shared memory. The assembler normally keeps within a
# few batches of the broker; beyond this many, batches go on the socket (slower, nothing lost).
SLOTS = 16
MAX_SLOTS = 64
HEADER_BYTES = mmap.PAGESIZE
MAGIC = 0x7374657062757301
READER_FRESH_S = 1.0  # a reader stamp older than this: the broker sends the bytes itself
READER_STAMP_S = 0.2  # how often the assembler re-stamps segments it maps while idle
RECLAIM_S = 60.0  # a slot not released for this long is taken back (its reader died)
# With every slot still read, the worker waits this long for a release before it sends the batch
# on the socket: an assembler that is merely the slowest stage then keeps the cheap path (rows
# on the socket cost it more, so falling back at once slowed the whole pipeline); a stopped one
# costs this much per batch.
ACQUIRE_WAIT_S = 0.02
MAX_SEGMENT_BYTES = 1 << 34
# A worker's batches of observations smaller than this go on the socket even on the broker's
# host (`stepbus worker --shm-min-batch-bytes`): below it, a slot's bookkeeping in the worker,
# the broker and the assembler costs more than the two socket copies it saves.
MIN_BATCH_BYTES = 64 << 10
_FIXED = 9  # int64 header words before the per-slot arrays
SLOT_ALIGN = 64
PART = ".part"  # a segment being made: PATH.partPID until it is whole
_NAME = re.compile(r"stepbus-[A-Za-z0-9_.-]{1,200}(\.part\d{1,10})?")
_PART_OF = re.compile(r"\.part(\d{1,10})$")


class Refused(Exception):
    """A segment that cannot (or must not) be mapped; the message says why."""


def segment_name(worker: str, incarnation: str) -> str:
    """`stepbus-<worker>-<incarnation>`, with characters a file name must not hold replaced."""
    return PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{worker}-{incarnation}")[:200]


def valid_name(name: str) -> bool:
    """Only our own prefix and plain characters: no path, no traversal."""
    return bool(_NAME.fullmatch(name)) and name not in (".", "..")


def _words(buf: mmap.mmap | memoryview, slots: int) -> np.ndarray:
    return np.frombuffer(buf, np.int64, _FIXED + 2 * slots)


Layout = tuple[tuple[str, str, tuple[int, ...]], ...]  # `rows.layout`: key, dtype, row shape


def leaf_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of one row of one leaf."""
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


def layout_bytes(layout: Layout) -> int:
    """Bytes of one row of every leaf."""
    return sum(leaf_bytes(dtype, shape) for _, dtype, shape in layout)


def slot_stride(rows: int, width: int) -> int:
    """Bytes from one slot to the next: its rows, rounded up to a cache line, so that every
    slot begins as aligned as the first."""
    return -(-rows * width // SLOT_ALIGN) * SLOT_ALIGN


def slot_obs(slot: np.ndarray, rows: int, layout: Layout) -> Obs:
    """A slot's bytes (uint8) as a batch of `rows` observations laid out as `layout` says:
    one array for a Box space's single leaf (key ""), else a map of leaf key to array."""
    if len(layout) == 1 and layout[0][0] == "":
        _, dtype, shape = layout[0]
        return slot[:rows * layout_bytes(layout)].view(dtype).reshape(rows, *shape)
    out: dict[str, np.ndarray] = {}
    offset = 0
    for key, dtype, shape in sorted(layout, key=lambda leaf: -np.dtype(leaf[1]).itemsize):
        size = rows * leaf_bytes(dtype, shape)
        out[key] = slot[offset:offset + size].view(dtype).reshape(rows, *shape)
        offset += size
    return {key: out[key] for key, _, _ in layout}  # in the batch's own order


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's: alive as far as we can tell
    return True


class Writer:
    """The worker's segment: SLOTS slots of a batch shaped as `like` (its rows, its leaves)."""

    def __init__(self, name: str, like: Obs, slots: int = SLOTS) -> None:
        self.name, self.path = name, os.path.join(DIR, name)
        self.slots, self.rows = slots, obs_rows.count(like)
        self.layout = obs_rows.layout(like)
        rows, width = self.rows, layout_bytes(self.layout)
        size = HEADER_BYTES + slots * slot_stride(rows, width)
        self.nonce = secrets.token_bytes(16)
        # Made under a name that says whose it is until it is whole: a worker killed while it
        # makes one leaves a file no header names the maker of (`remove_orphans`).
        part = f"{self.path}{PART}{os.getpid()}"
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.ftruncate(fd, size)
            # Every page taken now: a tmpfs hands out pages as they are first written, so a
            # full /dev/shm would otherwise kill the worker with SIGBUS at some later write,
            # where now it is an OSError and the worker sends its rows on the socket.
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
            self.write_header(slots, rows, width)
            # Whole, under its name, at once (one name at a time; over another user's file
            # in sticky /dev/shm it fails, EPERM, and the rows go on the socket).
            os.rename(part, self.path)
        except BaseException:  # the half-made object, its map with it, is dropped by the caller
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
            raise
        finally:
            os.close(fd)
        data = np.frombuffer(self.map, np.uint8, offset=HEADER_BYTES).reshape(slots, -1)
        self.views = [slot_obs(data[s], rows, self.layout) for s in range(slots)]
        self.since = np.zeros(slots)  # when each slot was last written
        self.next = 0
        self.last = -1  # the slot of the previous batch: its rows are the envs' last_obs

    def write_header(self, slots: int, rows: int, row_bytes: int) -> None:
        self.words = _words(self.map, slots)
        self.words[1:3] = np.frombuffer(self.nonce, np.int64)
        self.words[3:7] = (os.getpid(), slots, rows, row_bytes)
        self.written, self.released = self.words[_FIXED:_FIXED + slots], self.words[_FIXED + slots:]
        self.written[:] = -1
        self.released[:] = -1
        self.words[0] = MAGIC  # last: a reader never sees a half-made header as ours
        self.reclaimed = 0

    def acquire(self, wait_s: float = ACQUIRE_WAIT_S) -> int:
        """A free slot for the next batch, marked as being written, or -1: every slot is still
        read after `wait_s` (a stopped or slow assembler), so this batch goes on the socket."""
        deadline = time.monotonic() + wait_s
        while True:
            s = self._acquire_now()
            if s >= 0 or time.monotonic() >= deadline:
                return s
            time.sleep(0.0002)

    def _acquire_now(self) -> int:
        now = time.monotonic()
        for k in range(self.slots):
            s = (self.next + k) % self.slots
            if s == self.last:
                continue
            written = int(self.written[s])
            if written != -1 and int(self.released[s]) != written:
                if now - self.since[s] < RECLAIM_S:
                    continue
                self.reclaimed += 1
            self.written[s] = -1
            self.next = s + 1
            return s
        return -1

    def take_broker_mark(self) -> bool:
        """Did the broker mark the segment as mapped since we last asked? (Cleared.)"""
        marked = int(self.words[8]) == 1
        self.words[8] = 0
        return marked

    def publish(self, s: int, seq: int) -> None:
        """Slot s holds batch `seq` now."""
        self.written[s] = seq
        self.since[s] = time.monotonic()
        self.last = s

    def close(self) -> None:
        """Unlink the segment (our mapping stays valid until the process exits)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class Reader:
    """A worker's segment mapped by the broker or the assembler (data read-only)."""

    def __init__(self, name: str, nonce_hex: str) -> None:
        if not valid_name(name):
            raise Refused(f"not a stepbus segment name: {name[:80]!r}")
        try:
            nonce = bytes.fromhex(nonce_hex)
        except ValueError:
            raise Refused("nonce is not hex") from None
        if len(nonce) != 16:
            raise Refused("nonce must be 16 bytes")
        self.name = name
        try:
            fd = os.open(os.path.join(DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise Refused(f"cannot open {DIR}/{name}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise Refused("not a regular file of our own uid")
            if not HEADER_BYTES <= st.st_size <= MAX_SEGMENT_BYTES:
                raise Refused(f"size {st.st_size}")
            self.head = mmap.mmap(fd, HEADER_BYTES)
            fixed = np.frombuffer(self.head, np.int64, _FIXED)
            magic, slots, rows, row_bytes = (int(fixed[0]), int(fixed[4]), int(fixed[5]),
                                             int(fixed[6]))
            if magic != MAGIC or fixed[1:3].tobytes() != nonce:
                raise Refused("another segment (magic or nonce differ)")
            if not (1 <= slots <= MAX_SLOTS and 1 <= rows <= 1 << 16 and row_bytes >= 1
                    and HEADER_BYTES + slots * slot_stride(rows, row_bytes) == st.st_size):
                raise Refused(f"header ({slots} slots x {rows} rows x {row_bytes} B) does not "
                              f"match the size {st.st_size}")
            self.data = mmap.mmap(fd, st.st_size - HEADER_BYTES, prot=mmap.PROT_READ,
                                  offset=HEADER_BYTES)
        finally:
            os.close(fd)
        self.pid, self.slots, self.rows, self.row_bytes = int(fixed[3]), slots, rows, row_bytes
        self.words = _words(self.head, slots)
        self.written = self.words[_FIXED:_FIXED + slots]
        self.released = self.words[_FIXED + slots:]
        self.bytes = np.frombuffer(self.data, np.uint8).reshape(slots, -1)
        # Every slot laid out as the last layout asked for: one per worker in practice, so a
        # message costs a lookup, not a layout (one kept: a hostile peer cannot grow it).
        self.laid_out: tuple[Layout, list[Obs]] = ((), [])

    def view(self, s: int, like: Obs) -> Obs | None:
        """Slot s as `rows` observations laid out as `like` (zero rows of every leaf: how a
        message names its layout), read in place (None: not such a layout, or not of the
        segment's row size)."""
        if not (0 <= s < self.slots and obs_rows.layout_only(like)):
            return None
        layout = obs_rows.layout(like)
        if layout != self.laid_out[0]:
            if layout_bytes(layout) != self.row_bytes:
                return None
            self.laid_out = (layout, [slot_obs(self.bytes[k], self.rows, layout)
                                      for k in range(self.slots)])
        return self.laid_out[1][s]

    def holds(self, s: int, seq: int) -> bool:
        return int(self.written[s]) == seq

    def release(self, s: int, seq: int) -> None:
        self.released[s] = seq

    def mark(self) -> None:
        """The broker maps this segment (see `Writer.take_broker_mark`)."""
        self.words[8] = 1

    def stamp(self) -> None:
        """Say that this host's assembler reads this segment (the broker checks it)."""
        self.words[7] = time.monotonic_ns()

    def reader_fresh(self) -> bool:
        return time.monotonic_ns() - int(self.words[7]) < READER_FRESH_S * 1e9

    def remove_if_orphaned(self) -> bool:
        """Unlink the segment if its worker is dead (SIGKILLed workers cannot unlink their
        own); True if it was."""
        if _pid_alive(self.pid):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(DIR, self.name))
        return True


def remove_orphans(worker: str) -> int:
    """Unlink earlier incarnations' segments of this worker whose process is dead, whole ones
    (their header names the maker) and half-made ones (their name does)."""
    prefix = segment_name(worker, "")
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(DIR):
            if not entry.name.startswith(prefix) or not valid_name(entry.name):
                continue
            try:
                maker = _maker(entry.path)
                if (maker is not None and entry.stat().st_uid == os.getuid()
                        and not _pid_alive(maker)):
                    os.unlink(entry.path)
                    removed += 1
            except (OSError, ValueError):
                continue
    return removed


def _maker(path: str) -> int | None:
    """The pid of the worker that made the segment at `path`: its header's, or while it has
    none, its name's (None: not one of ours)."""
    with open(path, "rb") as f:
        fixed = np.frombuffer(f.read(_FIXED * 8), np.int64)
    if len(fixed) == _FIXED and int(fixed[0]) == MAGIC:
        return int(fixed[3])
    made_by = _PART_OF.search(path)
    return int(made_by[1]) if made_by else None
