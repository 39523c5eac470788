"""The file layer under every durable writer: the real disk, or one a test tool hands in.

Every durable writer (the Raft journal, payload files, snapshots) does its file I/O through a
:class:`Storage`, so that a test can swap the real disk for a simulated one that loses power
(``raftps/chaos/simdisk.py``, which the product never imports).

``Storage`` (and the files it opens, :class:`StorageFile`) offers exactly what a careful writer
needs: open/create, append, positional write, read, truncate, fsync (and fdatasync) of a file, fsync
of a directory, rename and remove. :func:`write_atomic` builds the one composite everybody needs
(write a temporary file, fsync it, rename it over the target, fsync the directory), and
:func:`write_whole` writes a frame's buffers (a payload's arrays) straight from their memory.

Which ``Storage`` a replica's writers use is decided by its ``Durability`` (``raft/durability.py``):
a durable replica takes this process's (:func:`process_storage`) and hands it to its journal
(``raft/journal.py``), its payload store (``payloads.py``) and its snapshot writer
(``snapshot_file.py``, made durable by ``raft/journal_hook.py``'s ``install_durable_snapshots``),
so a power cut hits all of a node's files at the same instant. A node without ``--durability
fsync`` keeps payloads in tmpfs through :class:`OSStorage`, which adds nothing to the system calls.
"""


from __future__ import annotations

import os
from typing import Iterable


class StorageFile:
    """An open file. Offsets are Python ints: no 32-bit limit anywhere."""

    path: str

    def append(self, data: bytes) -> int:
        """Write ``data`` at the end of the file; returns the offset it was written at."""
        raise NotImplementedError

    def write(self, offset: int, data: bytes) -> None:
        raise NotImplementedError

    def read(self, offset: int, size: int) -> bytes:
        raise NotImplementedError

    def truncate(self, size: int) -> None:
        raise NotImplementedError

    def fsync(self) -> None:
        raise NotImplementedError

    def datasync(self) -> None:
        """``fsync`` without the timestamps (``fdatasync``): the data and the size are durable."""
        self.fsync()

    @property
    def size(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class Storage:
    """The file operations of a durable writer (see the module docstring)."""

    def open(self, path: str, create: bool = True) -> StorageFile:
        raise NotImplementedError

    def read_file(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def remove(self, path: str) -> None:
        raise NotImplementedError

    def fsync_dir(self, path: str) -> None:
        raise NotImplementedError


def write_atomic(storage: Storage, path: str, data: bytes, fsync: bool = True) -> None:
    """Replace ``path`` by ``data`` so that a crash leaves either the old or the new content.

    With ``fsync`` the new content is durable when this returns: the temporary file is fsynced
    before the rename (or the rename could become durable before the data), and the directory
    after it (or the rename itself could be undone)."""
    tmp = path + ".tmp"
    f = storage.open(tmp)
    try:
        f.truncate(0)
        f.write(0, data)
        if fsync:
            f.fsync()
    finally:
        f.close()
    storage.rename(tmp, path)
    if fsync:
        storage.fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_whole(f: StorageFile, buffers: Iterable[bytes | memoryview]) -> int:
    """Make ``f`` hold exactly ``buffers``, written in place from the caller's memory (no join,
    no copy: a payload's arrays go from their buffers to the file); returns the size."""
    size = 0
    for buf in buffers:
        f.write(size, buf)
        size += len(buf)
    if f.size != size:                           # a longer file overwritten (a spare), or a stale tmp
        f.truncate(size)
    return size


# ---- the real disk -------------------------------------------------------------------------------

class OSFile(StorageFile):
    def __init__(self, path: str, create: bool):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        self._size = os.fstat(self._fd).st_size

    def append(self, data: bytes) -> int:
        offset = self._size
        self.write(offset, data)
        return offset

    def write(self, offset: int, data: bytes) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):                  # pwrite may write less than asked (signals, quotas)
            done += os.pwrite(self._fd, view[done:], offset + done)
        self._size = max(self._size, offset + len(view))

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self._fd, size, offset)

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)
        self._size = size

    def fsync(self) -> None:
        os.fsync(self._fd)

    def datasync(self) -> None:
        os.fdatasync(self._fd)

    @property
    def size(self) -> int:
        return self._size

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class OSStorage(Storage):
    """The real disk."""

    def open(self, path: str, create: bool = True) -> StorageFile:
        return OSFile(path, create)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def remove(self, path: str) -> None:
        os.remove(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_process_storage: Storage = OSStorage()


def use_storage(storage: Storage) -> None:
    """Make ``storage`` the file layer of every durable writer this process builds from now on:
    a test tool's simulated disk (``python -m raftps.chaos.simdisk_node serve ...``), chosen
    before any node starts."""
    global _process_storage
    _process_storage = storage


def process_storage() -> Storage:
    """The file layer of this process's durable writers: the real disk unless a test tool chose
    another (:func:`use_storage`). One per process: the journal, payloads and snapshots of a node
    (of every Raft group it hosts) go through the same one, so one power cut hits them all.
    Read only by ``Durability.for_mode`` (raft/durability.py), which hands it to the writers."""
    return _process_storage
