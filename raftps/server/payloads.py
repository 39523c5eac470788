"""Where tensor payloads of log entries live: one file per payload in the node's data directory.

A payload is written before the node acknowledges it, so a log entry that a majority committed
can be applied after any number of process crashes (pysyncobj's own journal has the same
durability: the page cache, no fsync). The copy in memory is dropped once the entry is applied;
the file stays until a snapshot of this node covers the entry, because a lagging peer may still
need it.

Files of collected payloads are kept as spares (up to ``spare_bytes``) and overwritten by the next
payloads: in tmpfs a new file costs page allocation and zeroing, which overwriting a spare does
not. A spare is never a valid payload id, and a
payload appears under its id only once completely written (rename), as with a new file.

Durable mode (``fsync``, payloads on the data dir's disk): a payload is fdatasynced, renamed into
place and its directory fsynced before ``put`` returns; puts that rename while a directory fsync
runs share the next one. On disk a new file allocates blocks, and with the ``discard`` mount
option an unlinked one is trimmed in a journal commit that every fsync on the file system waits
for, while a spare's blocks are allocated already (fdatasync writes its data and nothing else).
So the node keeps every collected file as a spare (up to the payload budget) and picks the spare
whose size fits best.

A payload's id names its content (``content_hash``) through the digest the data plane's frame MAC
takes over the blob (``codec.blob_hasher``, BLAKE3), so each byte is hashed once per node: the
leader hashes a payload once for its id and every peer's frame tag, a follower once as it arrives
(the MAC check), and the id check reuses that digest.
"""
from __future__ import annotations

import bisect
import hashlib
import os
import re
import threading
import time
from typing import Iterable

import msgpack
import numpy as np

from raftps import codec
from raftps.raft.storage import OSStorage, Storage, write_whole

PAYLOAD_ID = re.compile(r"[A-Za-z0-9_\-]{1,64}-[0-9]{1,20}-[0-9a-f]{8}")
SPARE_SUFFIX = ".spare"
DEFAULT_SPARE_BYTES = 256 << 20          # spares kept in tmpfs (a durable node keeps up to its budget)


def _ordered_arrays(tensors: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(name, little-endian contiguous array) in sorted name order: the order of a put's blob."""
    return [(name, np.asarray(tensors[name], dtype=np.dtype(codec.DTYPES[codec.dtype_name(tensors[name].dtype)]), order="C"))
            for name in sorted(tensors)]


def content_hash(layout: list[tuple[str, str, list[int]]], blob_digest: bytes) -> str:
    """The content part of a payload id: SHA-256 over the tensors' names, dtypes and shapes (in
    sorted name order) and the digest of their bytes in that order (``codec.blob_digest``)."""
    return hashlib.sha256(msgpack.packb(layout) + blob_digest).hexdigest()[:8]


def layout_of(ordered: list[tuple[str, np.ndarray]]) -> list[tuple[str, str, list[int]]]:
    return [(name, codec.dtype_name(a.dtype), list(a.shape)) for name, a in ordered]


def digest_of(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], bytes, str]:
    """(the tensors in sorted order, the digest of their bytes, the content hash): one pass."""
    ordered = _ordered_arrays(tensors)
    h = codec.blob_hasher()
    for _, a in ordered:
        h.update(memoryview(a.reshape(-1)).cast("B"))
    digest = h.digest()
    return dict(ordered), digest, content_hash(layout_of(ordered), digest)


def payload_id(client: str, seq: int, tensors: dict[str, np.ndarray]) -> str:
    """Names a payload by who sent it and what it holds, so a retry maps to the same id."""
    return f"{client}-{seq}-{digest_of(tensors)[2]}"


def verify(pid: str, tensors: dict[str, np.ndarray]) -> bool:
    try:
        return pid.rsplit("-", 1)[1] == digest_of(tensors)[2]
    except Exception:           # an unsupported dtype, say: not this payload
        return False


def verify_digest(pid: str, tensors: dict[str, np.ndarray], blob_digest: bytes) -> bool:
    """``verify`` given the digest of the tensors' bytes in their dict order (a received frame's
    blob, hashed for its MAC): no second pass over the bytes when they arrived in sorted order."""
    names = list(tensors)
    if names != sorted(names):
        return verify(pid, tensors)
    try:
        layout = layout_of(list(tensors.items()))
    except Exception:
        return False
    return pid.rsplit("-", 1)[1] == content_hash(layout, blob_digest)


class PayloadStore:
    def __init__(self, directory: str, owner: str | None = None, spare_bytes: int | None = None,
                 fsync: bool = False, storage: Storage | None = None):
        """``fsync``: durable mode; a payload's file, then the directory, are fsynced before
        ``put`` returns (so before the data plane acknowledges it). ``storage``: the file layer
        (the node's, shared with its journal, so that a simulated disk sees every write). A node
        takes all three from its Durability (raft/durability.py). ``spare_bytes`` None:
        ``DEFAULT_SPARE_BYTES``."""
        self.directory = os.path.abspath(directory)
        self.spare_bytes = DEFAULT_SPARE_BYTES if spare_bytes is None else spare_bytes
        self.fsync = fsync
        self.storage = storage or OSStorage()
        os.makedirs(directory, exist_ok=True)
        if owner is not None:       # lets a sweep tell an abandoned tmpfs dir from a live one
            # atomically: a sweep by another node starting now must never read it empty
            tmp = os.path.join(directory, f"OWNER.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "w") as f:
                f.write(owner + "\n")
            os.replace(tmp, os.path.join(directory, "OWNER"))
        self._memory: dict[str, dict[str, np.ndarray]] = {}
        self._applied: dict[str, int] = {}          # payload id -> log index it was applied at
        self._disk_bytes = 0
        self._spares: list[tuple[int, str]] = []    # (size, path) of files free for reuse, by size
        self._spare_total = 0
        self._spare_serial = 0
        self._cond = threading.Condition()
        self._dir_sync = threading.Lock()           # one directory fsync at a time (_sync_names)
        self._renames = 0                           # puts renamed into place so far ...
        self._names_synced = 0                      # ... of which a directory fsync covers this many
        for name in os.listdir(directory):
            if name == "OWNER":
                continue
            if name.endswith((".tmp", SPARE_SUFFIX)):
                self.storage.remove(os.path.join(self.directory, name))   # a write a crash interrupted, or a spare
            else:
                self._disk_bytes += os.path.getsize(os.path.join(self.directory, name))

    def _path(self, pid: str) -> str:
        if not PAYLOAD_ID.fullmatch(pid):
            raise ValueError(f"bad payload id {pid!r}")
        return os.path.join(self.directory, pid)

    def put(self, pid: str, tensors: dict[str, np.ndarray]) -> None:
        path = self._path(pid)
        if not os.path.exists(path):
            frame = codec.encode({"tensors": tensors})
            size = sum(len(b) for b in frame)
            tmp = self._take_spare(size) or f"{path}.{threading.get_ident()}.tmp"
            f = self.storage.open(tmp)
            try:
                write_whole(f, frame)
                if self.fsync:
                    # data and size, not the timestamps: an overwritten spare then needs no
                    # journal commit of its own, only its blocks written
                    f.datasync()
            finally:
                f.close()
            self.storage.rename(tmp, path)
            if self.fsync:
                self._sync_names()
            with self._cond:
                self._disk_bytes += size
        with self._cond:
            if pid not in self._applied:
                self._memory[pid] = tensors
            self._cond.notify_all()

    def get(self, pid: str) -> dict[str, np.ndarray] | None:
        with self._cond:
            tensors = self._memory.get(pid)
        if tensors is not None:
            return tensors
        try:
            tensors = codec.read_frame_file(self._path(pid))["tensors"]
        except FileNotFoundError:
            return None
        except Exception:
            return None               # a damaged file counts as missing: a peer will supply it
        return tensors if verify(pid, tensors) else None

    def has(self, pid: str) -> bool:
        with self._cond:
            if pid in self._memory:
                return True
        return os.path.exists(self._path(pid))

    def wait(self, pid: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (pid in self._memory or os.path.exists(self._path(pid))):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def applied(self, pid: str, index: int) -> None:
        with self._cond:
            self._memory.pop(pid, None)
            self._applied[pid] = index

    def applied_between(self, first: int, last: int) -> list[str]:
        """Ids of payloads applied here at log indices first..last, in log order."""
        with self._cond:
            return [pid for pid, index in sorted(self._applied.items(), key=lambda kv: kv[1]) if first <= index <= last]

    def collect(self, through_index: int) -> int:
        """Delete payloads applied at or below ``through_index``; returns bytes freed."""
        with self._cond:
            done = [pid for pid, index in self._applied.items() if index <= through_index]
            for pid in done:
                del self._applied[pid]
        freed = 0
        for pid in done:
            freed += self._unlink(pid)
        return freed

    def collect_orphans(self, max_age: float, keep: Iterable[str] = ()) -> int:
        """Delete payloads never applied here and older than ``max_age`` seconds (proposals that
        never committed). Local housekeeping only: the state machine never sees it."""
        now = time.time()
        keep = set(keep)
        freed = 0
        for name in os.listdir(self.directory):
            if name.endswith((".tmp", SPARE_SUFFIX)) or name in keep or name == "OWNER":
                continue
            with self._cond:
                if name in self._applied:
                    continue
            try:
                if now - os.path.getmtime(os.path.join(self.directory, name)) > max_age:
                    with self._cond:
                        self._memory.pop(name, None)
                    freed += self._unlink(name)
            except FileNotFoundError:
                pass
        return freed

    def _unlink(self, pid: str) -> int:
        """Remove a payload: its file becomes a spare while spares stay under ``spare_bytes``."""
        try:
            path = self._path(pid)
            size = os.path.getsize(path)
            with self._cond:          # a rename is a few microseconds: done under the lock
                if self._spare_total + size <= self.spare_bytes:
                    self._spare_serial += 1
                    spare = os.path.join(self.directory, f"{self._spare_serial}{SPARE_SUFFIX}")
                    self.storage.rename(path, spare)
                    bisect.insort(self._spares, (size, spare))
                    self._spare_total += size
                else:
                    self.storage.remove(path)
                self._disk_bytes -= size
        except (FileNotFoundError, ValueError):
            return 0
        return size

    def _take_spare(self, size: int = 0) -> str | None:
        """A spare file to overwrite: the smallest that holds ``size`` bytes, else the largest (a
        spare of the right size is written in place, with no blocks to allocate or free)."""
        with self._cond:
            if not self._spares:
                return None
            # thousands of small spares after a run of 64 KiB pushes: a search, not a scan
            best = min(bisect.bisect_left(self._spares, (size, "")), len(self._spares) - 1)
            held, spare = self._spares.pop(best)
            self._spare_total -= held
            return spare

    def _sync_names(self) -> None:
        """Make every rename done in the directory so far durable: one directory fsync for all
        the puts that finished their rename while the previous one ran (group commit)."""
        with self._cond:
            self._renames += 1
            mine = self._renames
        with self._dir_sync:
            if self._names_synced >= mine:
                return                    # an fsync that began after our rename covered it
            with self._cond:
                target = self._renames
            self.storage.fsync_dir(self.directory)
            self._names_synced = target

    def drop_spares(self) -> None:
        """Free the spares' memory (tmpfs) when the node stops."""
        while (spare := self._take_spare()) is not None:
            try:
                self.storage.remove(spare)
            except FileNotFoundError:
                pass

    def count_files(self) -> tuple[int, int]:
        """(payload files, spare files) in the directory, counted now (a scan: for scrapes)."""
        files = spares = 0
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    if entry.name == "OWNER" or entry.name.endswith(".tmp"):
                        continue
                    if entry.name.endswith(SPARE_SUFFIX):
                        spares += 1
                    else:
                        files += 1
        except OSError:
            pass
        return files, spares

    @property
    def disk_bytes(self) -> int:
        return self._disk_bytes

    @property
    def spare_bytes_held(self) -> int:
        return self._spare_total

    @property
    def in_memory(self) -> int:
        with self._cond:
            return len(self._memory)
