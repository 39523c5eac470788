"""A simulated disk that can lose power: a test tool, never imported by the product.

It implements ``raftps.raft.storage.Storage``, the file layer of every durable writer, so a test
hands it to a journal, a payload store or a snapshot writer (or, across processes, runs a node on
it with ``raftps/chaos/simdisk_node.py``) and cuts the power.

:class:`SimulatedDisk` performs every operation on the real files too (so the code under test
reads back what it wrote, and another process can read the files), but first records it in an
append-only **operation log** (``<state dir>/ops.log``), and never calls the real ``fsync`` (the
simulation decides what is durable, and tests stay fast).

The operation log
-----------------
One record per operation: ``<u32 header length><u32 data length><u32 crc32>`` + a JSON header +
the data bytes (the data of a write, or the whole content of a file seen for the first time). The
record is written (one ``write(2)`` on an ``O_APPEND`` descriptor, which survives a SIGKILL of the
writer because it is in the kernel's page cache) *before* the operation is done, so the log always
covers at least what the files contain; a torn last record (a writer killed mid-record) fails its
CRC and is ignored, like an operation that never returned (the next process cuts it off).

Headers: ``["base", path]`` (a file that existed before the log began, with its content: it is
durable as it is), ``["create", path]``, ``["write", inode, offset]``, ``["trunc", inode, size]``,
``["fsync", inode]``, ``["rename", src, dst]``, ``["remove", path]``, ``["fsyncdir", dir]``.
Data operations name an *inode* number, not a path, because a file may be renamed while open;
inode numbers are handed out in log order, so replaying the log reproduces them.

:class:`DiskModel` replays the log. It keeps, per inode, the durable content and the list of data
operations since its last fsync, and per directory the name operations (create, rename, remove)
since its last directory fsync; ``durable names`` map each path to an inode as of the last
directory fsync. A power cut (:meth:`DiskModel.cut`) then computes each path's content:

* ``"synced"``: every file is cut back to its last fsynced content, and a create, rename or remove
  not followed by an fsync of its directory is undone (a renamed-over file reappears, a created
  file vanishes), which is what POSIX promises and no more;
* ``"torn"``: keeps a seeded-random prefix of each file's unsynced data operations, the last one
  possibly cut inside its data (as a page cache may have written back part of it), and a
  seeded-random prefix of each directory's unsynced name operations.

Across processes
----------------
A node started as ``python -m raftps.chaos.simdisk_node serve ...`` with ``RAFTPS_SIMDISK=<state
dir>`` in its environment (see :func:`storage_from_env`, which gives every caller in the process the
same disk) logs to ``<state dir>/ops.log``. The harness SIGKILLs it and calls :func:`power_cut` with
the same state dir: the log is replayed, every path the log knows about is rewritten (or removed)
to its post-cut state, and the log is emptied: the files on disk are now the durable state, which
the next process's log takes as its base (it records a file's content the first time it touches it). A
process killed without a power cut leaves the log in place; the next process replays it on start
and carries on appending, so a later power cut still knows what the first one had not fsynced.
Only one process may use a state dir at a time. In-process, :meth:`SimulatedDisk.power_cut` does
the same and invalidates every open file of that disk (the writers are dead, as after a real cut).

Directory creation (``makedirs``) is treated as immediately durable: the writers create their
directories once, at start, and fsync the parent themselves where it matters.
"""

from __future__ import annotations

import json
import os
import random
import struct
import threading
import weakref
import zlib
from typing import Iterable

from raftps.raft.storage import OSFile, OSStorage, Storage, StorageFile

SIMDISK_ENV = "RAFTPS_SIMDISK"
_LOG_NAME = "ops.log"
_LOG_HEAD = struct.Struct("<III")      # header length, data length, crc32(header + data)
MODES = ("synced", "torn")


# ---- the model of what is durable -----------------------------------------------------------------

class _Inode:
    __slots__ = ("durable", "pending")

    def __init__(self, content: bytes = b""):
        self.durable = bytearray(content)
        self.pending: list[tuple] = []           # ("write", offset, data) | ("trunc", size)


def _apply_data(content: bytearray, op: tuple) -> None:
    if op[0] == "write":
        offset, data = op[1], op[2]
        if offset > len(content):
            content.extend(bytes(offset - len(content)))     # a hole reads as zeros
        content[offset:offset + len(data)] = data
    else:
        del content[op[1]:]
        if op[1] > len(content):
            content.extend(bytes(op[1] - len(content)))


def _apply_name(names: dict[str, int], op: tuple) -> None:
    if op[0] == "link":
        names[op[1]] = op[2]
    elif op[0] == "unlink":
        names.pop(op[1], None)
    else:                                        # ("rename", src, dst, inode): atomic in one directory
        names.pop(op[1], None)
        names[op[2]] = op[3]


class DiskModel:
    """What every file would contain after a power cut, from the operation log (module docstring)."""

    def __init__(self) -> None:
        self.inodes: dict[int, _Inode] = {}
        self.names: dict[str, int] = {}          # path -> inode, as the running process sees it
        self.durable_names: dict[str, int] = {}  # path -> inode, as of each directory's last fsync
        self.dir_pending: dict[str, list[tuple]] = {}
        self.known: set[str] = set()             # every path the log mentions: the cut rewrites them

    def _new_inode(self, content: bytes = b"") -> int:
        number = len(self.inodes) + 1            # log order, so a replay hands out the same numbers
        self.inodes[number] = _Inode(content)
        return number

    def apply(self, header: list, data: bytes) -> None:
        kind = header[0]
        if kind == "base":
            path = header[1]
            number = self._new_inode(data)
            self.names[path] = self.durable_names[path] = number
            self.known.add(path)
        elif kind == "create":
            path = header[1]
            number = self._new_inode()
            self.names[path] = number
            self.dir_pending.setdefault(os.path.dirname(path), []).append(("link", path, number))
            self.known.add(path)
        elif kind == "write":
            self.inodes[header[1]].pending.append(("write", header[2], data))
        elif kind == "trunc":
            self.inodes[header[1]].pending.append(("trunc", header[2]))
        elif kind == "fsync":
            inode = self.inodes[header[1]]
            for op in inode.pending:
                _apply_data(inode.durable, op)
            inode.pending.clear()
        elif kind == "rename":
            src, dst = header[1], header[2]
            number = self.names.pop(src)
            self.names[dst] = number
            self.known.update((src, dst))
            if os.path.dirname(src) == os.path.dirname(dst):
                self.dir_pending.setdefault(os.path.dirname(dst), []).append(("rename", src, dst, number))
            else:
                self.dir_pending.setdefault(os.path.dirname(src), []).append(("unlink", src))
                self.dir_pending.setdefault(os.path.dirname(dst), []).append(("link", dst, number))
        elif kind == "remove":
            path = header[1]
            self.names.pop(path)
            self.dir_pending.setdefault(os.path.dirname(path), []).append(("unlink", path))
        elif kind == "fsyncdir":
            for op in self.dir_pending.pop(header[1], []):
                _apply_name(self.durable_names, op)
        else:
            raise ValueError(f"unknown simulated-disk operation {header!r}")

    def cut(self, mode: str, seed: int = 0) -> dict[str, bytes | None]:
        """Every known path's content after a power cut in ``mode`` (None: the file is gone)."""
        if mode not in MODES:
            raise ValueError(f"power cut mode must be one of {MODES}, not {mode!r}")
        rng = random.Random(seed)
        contents: dict[int, bytearray] = {}
        for number in sorted(self.inodes):
            inode = self.inodes[number]
            content = bytearray(inode.durable)
            if mode == "torn" and inode.pending:
                keep = rng.randint(0, len(inode.pending))
                for op in inode.pending[:keep]:
                    _apply_data(content, op)
                if keep < len(inode.pending) and inode.pending[keep][0] == "write":
                    _, offset, data = inode.pending[keep]
                    _apply_data(content, ("write", offset, data[:rng.randint(0, len(data))]))
            contents[number] = content
        names = dict(self.durable_names)
        if mode == "torn":
            for directory in sorted(self.dir_pending):
                ops = self.dir_pending[directory]
                for op in ops[:rng.randint(0, len(ops))]:
                    _apply_name(names, op)
        return {path: (bytes(contents[names[path]]) if path in names else None)
                for path in sorted(self.known)}


# ---- the operation log ------------------------------------------------------------------------------

def _encode(header: list, data: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return _LOG_HEAD.pack(len(head), len(data), zlib.crc32(data, zlib.crc32(head))) + head + data


def read_log(state_dir: str) -> Iterable[tuple[list, bytes, int]]:
    """The operations logged in ``state_dir`` (header, data, end offset), stopping at a torn or
    corrupt record."""
    try:
        with open(os.path.join(state_dir, _LOG_NAME), "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return
    pos = 0
    while pos + _LOG_HEAD.size <= len(blob):
        hlen, dlen, crc = _LOG_HEAD.unpack_from(blob, pos)
        end = pos + _LOG_HEAD.size + hlen + dlen
        if end > len(blob):
            return
        head = blob[pos + _LOG_HEAD.size:pos + _LOG_HEAD.size + hlen]
        data = blob[pos + _LOG_HEAD.size + hlen:end]
        if zlib.crc32(data, zlib.crc32(head)) != crc:
            return
        yield json.loads(head), bytes(data), end
        pos = end


def load_model(state_dir: str) -> DiskModel:
    return _load(state_dir)[0]


def _load(state_dir: str) -> tuple[DiskModel, int]:
    model, valid = DiskModel(), 0
    for header, data, valid in read_log(state_dir):
        model.apply(header, data)
    return model, valid


def apply_cut(contents: dict[str, bytes | None]) -> None:
    """Make the real files what ``DiskModel.cut`` says survived."""
    for path, content in contents.items():
        if content is None:
            if os.path.lexists(path):
                os.remove(path)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content)


def power_cut(state_dir: str, mode: str, seed: int = 0) -> dict[str, bytes | None]:
    """Cut the power of the (dead) process that logged to ``state_dir``; returns what survived.

    The caller must have killed that process (SIGKILL) first: a live writer would keep writing."""
    contents = load_model(state_dir).cut(mode, seed)
    apply_cut(contents)
    with open(os.path.join(state_dir, _LOG_NAME), "wb"):
        pass                                    # the files are now the durable base of a new log
    return contents


# ---- the simulated disk -----------------------------------------------------------------------------

class PowerLost(OSError):
    """An operation on a file of a SimulatedDisk whose power was cut."""


class SimFile(StorageFile):
    def __init__(self, disk: "SimulatedDisk", path: str, number: int, real: OSFile):
        self.path = path
        self._disk, self._number, self._real = disk, number, real
        self._epoch = disk._epoch

    def _check(self) -> None:
        if self._epoch != self._disk._epoch or self._real.closed:
            raise PowerLost(f"{self.path}: closed or lost with the power")

    def append(self, data: bytes) -> int:
        with self._disk._lock:
            offset = self._real.size
            self._write(offset, data)
            return offset

    def write(self, offset: int, data: bytes) -> None:
        with self._disk._lock:
            self._write(offset, data)

    def _write(self, offset: int, data: bytes) -> None:
        self._check()
        self._disk._log(["write", self._number, offset], bytes(data))
        self._real.write(offset, data)

    def read(self, offset: int, size: int) -> bytes:
        self._check()
        return self._real.read(offset, size)

    def truncate(self, size: int) -> None:
        with self._disk._lock:
            self._check()
            self._disk._log(["trunc", self._number, size])
            self._real.truncate(size)

    def fsync(self) -> None:
        with self._disk._lock:
            self._check()
            self._disk._log(["fsync", self._number])
            self._disk.fsyncs += 1
            self._disk.fsyncs_by_path[self.path] = self._disk.fsyncs_by_path.get(self.path, 0) + 1

    @property
    def size(self) -> int:
        return self._real.size

    def close(self) -> None:
        self._real.close()


class SimulatedDisk(Storage):
    """Real files, plus a log of every operation, so that a power cut can be simulated.

    ``fsyncs`` counts file fsyncs and ``dir_fsyncs`` directory fsyncs (tests check group commit
    with them); ``seed`` makes torn cuts reproducible."""

    def __init__(self, state_dir: str, seed: int = 0):
        self.state_dir = os.path.abspath(state_dir)
        self.seed = seed
        os.makedirs(self.state_dir, exist_ok=True)
        self._lock = threading.RLock()
        self._epoch = 0
        self._files: "weakref.WeakSet[SimFile]" = weakref.WeakSet()
        self.fsyncs = 0
        self.dir_fsyncs = 0
        self.fsyncs_by_path: dict[str, int] = {}
        self.model, valid = _load(self.state_dir)  # a killed predecessor's operations still count
        self._log_fd = os.open(os.path.join(self.state_dir, _LOG_NAME),
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.ftruncate(self._log_fd, valid)        # its torn last record would hide all of ours

    def _log(self, header: list, data: bytes = b"") -> None:
        os.write(self._log_fd, _encode(header, data))
        self.model.apply(header, data)

    def _know(self, path: str) -> None:
        """Record a file that existed before the log began as durable, content and all."""
        if path not in self.model.names and path not in self.model.known and os.path.isfile(path):
            with open(path, "rb") as f:
                self._log(["base", path], f.read())

    def open(self, path: str, create: bool = True) -> StorageFile:
        path = os.path.abspath(path)
        with self._lock:
            self._know(path)
            if path not in self.model.names:
                if not create or not os.path.isdir(os.path.dirname(path)):
                    raise FileNotFoundError(path)      # before logging: the log holds what happened
                self._log(["create", path])
            f = SimFile(self, path, self.model.names[path], OSFile(path, create=True))
            self._files.add(f)
            return f

    def rename(self, src: str, dst: str) -> None:
        src, dst = os.path.abspath(src), os.path.abspath(dst)
        with self._lock:
            self._know(src)
            self._know(dst)
            if src not in self.model.names or not os.path.isdir(os.path.dirname(dst)):
                raise FileNotFoundError(src)
            self._log(["rename", src, dst])
            os.rename(src, dst)

    def remove(self, path: str) -> None:
        path = os.path.abspath(path)
        with self._lock:
            self._know(path)
            if path not in self.model.names:
                raise FileNotFoundError(path)
            self._log(["remove", path])
            os.remove(path)

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            self._log(["fsyncdir", os.path.abspath(path)])
            self.dir_fsyncs += 1

    def power_cut(self, mode: str, seed: int | None = None) -> dict[str, bytes | None]:
        """Lose the power now: every file goes back to what ``mode`` keeps (module docstring).

        Every file opened before the cut is dead afterwards (``PowerLost``); reopen them."""
        with self._lock:
            self._epoch += 1
            for f in list(self._files):
                f.close()
            contents = self.model.cut(mode, self.seed if seed is None else seed)
            apply_cut(contents)
            os.ftruncate(self._log_fd, 0)
            self.model = DiskModel()
            return contents

    def close(self) -> None:
        with _shared_lock:
            if _shared.get(self.state_dir) is self:
                del _shared[self.state_dir]
        os.close(self._log_fd)


_shared: dict[str, SimulatedDisk] = {}
_shared_lock = threading.Lock()


def storage_from_env(env: dict[str, str] | None = None) -> Storage:
    """A SimulatedDisk logging to ``$RAFTPS_SIMDISK`` if it is set, else the real disk.

    One SimulatedDisk per state dir and process: the journal, payloads and snapshots of a node
    (of every Raft group it hosts) must log to one operation log, in one order, or a replay would
    hand out the same inode numbers twice."""
    state_dir = (os.environ if env is None else env).get(SIMDISK_ENV)
    if not state_dir:
        return OSStorage()
    with _shared_lock:
        disk = _shared.get(os.path.abspath(state_dir))
        if disk is None:
            disk = _shared[os.path.abspath(state_dir)] = SimulatedDisk(state_dir)
        return disk
