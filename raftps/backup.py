"""Backups: ``raftps snapshot save`` and ``raftps snapshot restore`` (like ``etcdctl snapshot``).

A backup is one codec frame (raw array bytes, no pickle): the state machine's ``snapshot()`` taken
between two applies on the leader after a barrier (so it holds every write acknowledged before
the save began), the store version it is at, and its digest, the same SHA-256 every node's
``status()`` reports at that version.

Restoring seeds empty data dirs with a snapshot file in the format the nodes write themselves
(``snapshot_file.seed``): the state machine plus two boundary log entries. The
entries are no-ops at indices V-1 and V of term 0, identical on every seeded node, so the new
cluster's logs agree at V, the first election makes term 1 (log terms stay monotonic) and the
store's versions continue from V rather than start again. pysyncobj loads that file on the first
tick, like a node restarting after a snapshot; nothing else about a node's start changes.
"""
from __future__ import annotations

import datetime
import os
import shutil

from . import codec, snapshot_file
from .client import Client
from .machine import TensorStore, snapshot_digest
from .models import UsageError

BACKUP_FORMAT = 1
# A client that fetches a whole store: the reply is one frame (received into mmap memory as
# bytes arrive, so these bound what a node may send, not what is allocated up front).
SAVE_LIMITS = codec.Limits(max_header_bytes=1 << 30, max_blob_bytes=1 << 40, max_arrays=1 << 24,
                           max_tensor_bytes=1 << 40)
NODE_FILES = ("raft.journal", "raft.journal.d", snapshot_file.NAME)   # plain and durable journals


def save(client: Client, path: str) -> dict:
    """Write the whole store at one version to ``path`` (whole, or not at all); a summary."""
    out = client.snapshot()
    snap, version, digest = out["snapshot"], out["version"], out["digest"]
    if snapshot_digest(snap) != digest:            # what arrived is what the leader hashed
        raise UsageError(f"the snapshot received does not match the digest the leader sent ({digest[:16]})")
    message = {"raftps_backup": BACKUP_FORMAT, "version": version, "digest": digest,
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": snap}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            size = codec.write_frame(f, message)
            f.flush()
            os.fsync(f.fileno())                   # a backup is for the day the disks are gone
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"version": version, "digest": digest, "tensors": len(snap["tensors"]), "bytes": size, "path": path}


def read(path: str) -> dict:
    """A backup file, checked: readable, a raftps backup, and its state matching its digest."""
    try:
        backup = codec.read_frame_file(path)       # limits: the file's size (a bad length cannot allocate more)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:                       # ProtocolError, LimitExceeded, msgpack errors
        raise UsageError(f"{path} is not a raftps backup (made by `raftps snapshot save`): {exc}") from None
    if not isinstance(backup, dict) or backup.get("raftps_backup") != BACKUP_FORMAT:
        raise UsageError(f"{path} is not a raftps backup of format {BACKUP_FORMAT} (made by `raftps snapshot save`)")
    try:
        TensorStore().restore(backup["machine"])
        actual = snapshot_digest(backup["machine"])
    except Exception as exc:
        raise UsageError(f"{path}: its state does not load: {exc}") from None
    if actual != backup["digest"] or type(backup["version"]) is not int or backup["version"] < 2:
        raise UsageError(f"{path} is damaged: its state hashes to {actual[:16]}, the file says "
                             f"{str(backup['digest'])[:16]} at version {backup['version']}")
    return backup


def restore(path: str, data_dirs: list[str], peers: list[str] | None = None) -> dict:
    """Seed every dir in ``data_dirs`` (each empty or missing) from the backup at ``path``:
    start nodes on them with the new cluster's --peers and they come up at its version."""
    if not data_dirs:
        raise UsageError("give the data dir of every node to seed (--data-dir DIR, repeated)")
    backup = read(path)
    for d in data_dirs:
        held = [f for f in NODE_FILES if os.path.exists(os.path.join(d, f))]
        if held:
            raise UsageError(f"{d} already holds a node's data ({', '.join(held)}); restore seeds new nodes "
                                 "only: stop that node and give an empty or new data dir")
    version = backup["version"]
    from .node import default_payload_dir
    for d in data_dirs:
        os.makedirs(d, exist_ok=True)
        # Payloads a previous node with this data dir left in tmpfs belong to another history.
        shutil.rmtree(default_payload_dir(d), ignore_errors=True)
        snapshot_file.seed(d, version, backup["machine"], peers or [])
    return {"version": version, "digest": backup["digest"], "created": backup.get("created"),
            "tensors": len(backup["machine"]["tensors"]), "data_dirs": list(data_dirs)}
