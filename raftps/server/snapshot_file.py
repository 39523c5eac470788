"""The snapshot file, the one place that knows its layout.

One codec frame (raw array bytes, no pickle): ``{"raft": [last, previous], "cluster": [Raft
addresses], "machine": TensorStore.snapshot()}``, where ``last`` and ``previous`` are the Raft
library's boundary entries ``[entry bytes, index, term]``. Nodes write it when the log compacts
(node.py), serve it to peers that lost a payload (dataplane.py), and ``raftps snapshot restore``
seeds new nodes with it (backup.py).
"""
from __future__ import annotations

import os
import struct
from typing import Any

from raftps import codec
from raftps.raft import SnapshotMeta
from raftps.raft.storage import OSStorage, Storage, write_whole

NAME = "raft.snapshot"                   # in the node's data dir; the Raft library renames it into place
NO_OP = struct.pack("B", 1)              # pysyncobj's _COMMAND_TYPE.NO_OP: applies as nothing


def path(data_dir: str) -> str:
    return os.path.join(data_dir, NAME)


def to_frame(meta: SnapshotMeta, machine: dict) -> dict:
    return {"raft": [list(meta.last), list(meta.previous)], "cluster": sorted(meta.members), "machine": machine}


def from_frame(frame: Any) -> tuple[SnapshotMeta, dict]:
    """(what the snapshot covers, the state machine's snapshot); ValueError if it is not one."""
    try:
        last, previous = (tuple(e) for e in frame["raft"])
        meta = SnapshotMeta(last, previous, list(frame["cluster"] or []))
        machine = frame["machine"]
        if not isinstance(meta.index, int) or not isinstance(machine, dict):
            raise TypeError("index or machine of the wrong type")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a raftps snapshot: {exc!r}") from None
    return meta, machine


def write(filename: str, meta: SnapshotMeta, machine: dict, storage: Storage | None = None,
          fsync: bool = False) -> None:
    """Not fsynced unless asked: a durable log fsyncs the file before it renames it into place,
    and the directory after (raft/journal_hook.py, install_durable_snapshots). ``storage``: the
    node's file layer, so that a simulated disk sees the writes."""
    f = (storage or OSStorage()).open(filename)
    try:
        write_whole(f, codec.encode(to_frame(meta, machine)))
        if fsync:
            f.fsync()
    finally:
        f.close()


def read(filename: str, limits: codec.Limits | None = None) -> tuple[SnapshotMeta, dict]:
    # Default limits from the file's size, not the client-facing ones: a store of more than 4096
    # arrays (1,366 Adam tensors) or 1 GiB would otherwise fail to load its own snapshot.
    return from_frame(codec.read_frame_file(filename, limits))


def read_frame(filename: str, limits: codec.Limits | None = None) -> dict:
    """The file's frame as it is, for a peer (which parses it with ``from_frame``)."""
    return codec.read_frame_file(filename, limits)


def seed(data_dir: str, version: int, machine: dict, members: list[str], storage: Storage | None = None) -> None:
    """A snapshot that starts a new node with ``machine`` (at its store version): the boundary
    entries are no-ops of term 0 at Raft index I and I - 1, I = max(version, 2), the same on every
    seeded node, so their logs agree and continue at I + 1. Durable when this returns (file
    fsynced, renamed, directory fsynced): a restored data dir is the only copy of the state once
    the operator moves on, in either durability mode."""
    storage = storage or OSStorage()
    index = max(version, 2)
    meta = SnapshotMeta((NO_OP, index, 0), (NO_OP, index - 1, 0), sorted(members))
    tmp = path(data_dir) + ".tmp"
    write(tmp, meta, machine, storage, fsync=True)
    storage.rename(tmp, path(data_dir))
    storage.fsync_dir(os.path.abspath(data_dir))
