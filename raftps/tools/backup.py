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

from raftps import codec

from raftps.server import snapshot_file
from raftps.client.client import Client
from raftps.groups import Layout, data_dir
from raftps.store.machine import TensorStore
from raftps.store.store_snapshot import snapshot_digest
from raftps.errors import UsageError
from raftps.raft.durability import JOURNAL_DIR, PLAIN_JOURNAL

BACKUP_FORMAT = 1           # one Raft group: the store at one version
GROUPS_FORMAT = 2           # several Raft groups: each group's state, at a version of its own
# A client that fetches a whole store: the reply is one frame (received into mmap memory as
# bytes arrive, so these bound what a node may send, not what is allocated up front).
SAVE_LIMITS = codec.Limits(max_header_bytes=1 << 30, max_blob_bytes=1 << 40, max_arrays=1 << 24,
                           max_tensor_bytes=1 << 40)
NODE_FILES = (PLAIN_JOURNAL, JOURNAL_DIR, snapshot_file.NAME)


def save(client: Client, path: str) -> dict:
    """Write the whole store to ``path`` (whole, or not at all); a summary. One Raft group: the
    store at one version (format 1). Several: each group's state at a version of its own, in
    group order (format 2)."""
    out = client.snapshot()
    parts = out["groups"] if "groups" in out else [out]
    for g, part in enumerate(parts):
        if snapshot_digest(part["snapshot"]) != part["digest"]:     # what arrived is what the leader hashed
            raise UsageError(f"the snapshot of group {g} received does not match the digest its leader sent "
                             f"({part['digest'][:16]})")
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if "groups" in out:
        message = {"raftps_backup": GROUPS_FORMAT, "created": created, "groups": len(parts),
                   "parts": [{"version": p["version"], "digest": p["digest"], "machine": p["snapshot"]} for p in parts]}
    else:
        message = {"raftps_backup": BACKUP_FORMAT, "version": out["version"], "digest": out["digest"],
                   "created": created, "machine": out["snapshot"]}
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
    return {**_summary(message), "bytes": size, "path": path}


def _parts(backup: dict) -> list[dict]:
    """A backup's states, in group order ({version, digest, machine} each)."""
    return backup["parts"] if backup.get("raftps_backup") == GROUPS_FORMAT else [backup]


def _summary(backup: dict) -> dict:
    """version and digest (maps by group with several), tensors, created."""
    parts = _parts(backup)
    several = backup.get("raftps_backup") == GROUPS_FORMAT
    return {"version": {g: p["version"] for g, p in enumerate(parts)} if several else parts[0]["version"],
            "digest": {g: p["digest"] for g, p in enumerate(parts)} if several else parts[0]["digest"],
            "tensors": sum(len(p["machine"]["tensors"]) for p in parts), "created": backup.get("created")}


def read(path: str) -> dict:
    """A backup file, checked: readable, a raftps backup, and each state matching its digest."""
    try:
        backup = codec.read_frame_file(path)       # limits: the file's size (a bad length cannot allocate more)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:                       # ProtocolError, LimitExceeded, msgpack errors
        raise UsageError(f"{path} is not a raftps backup (made by `raftps snapshot save`): {exc}") from None
    if not isinstance(backup, dict) or backup.get("raftps_backup") not in (BACKUP_FORMAT, GROUPS_FORMAT) \
            or backup.get("raftps_backup") == GROUPS_FORMAT and not isinstance(backup.get("parts"), list):
        raise UsageError(f"{path} is not a raftps backup of format {BACKUP_FORMAT} or {GROUPS_FORMAT} "
                         "(made by `raftps snapshot save`)")
    for g, part in enumerate(_parts(backup)):
        try:
            TensorStore().restore(part["machine"])
            actual = snapshot_digest(part["machine"])
        except Exception as exc:
            raise UsageError(f"{path}: the state of group {g} does not load: {exc}") from None
        if actual != part["digest"] or type(part["version"]) is not int or part["version"] < 0:
            raise UsageError(f"{path} is damaged: group {g}'s state hashes to {actual[:16]}, the file says "
                             f"{str(part['digest'])[:16]} at version {part['version']}")
    return backup


def restore(path: str, data_dirs: list[str], peers: list[str] | None = None) -> dict:
    """Seed every dir in ``data_dirs`` (each empty or missing; the nodes' dirs in node order) from
    the backup at ``path``: start nodes on them with the new cluster's --peers (and, for a backup
    of several Raft groups, the same --groups) and they come up at its versions."""
    if not data_dirs:
        raise UsageError("give the data dir of every node to seed (--data-dir DIR, repeated)")
    backup = read(path)
    for d in data_dirs:
        held = [f for f in NODE_FILES if os.path.exists(os.path.join(d, f))]
        if held:
            raise UsageError(f"{d} already holds a node's data ({', '.join(held)}); restore seeds new nodes "
                                 "only: stop that node and give an empty or new data dir")
    parts = _parts(backup)
    if peers and len(peers) != len(data_dirs):
        raise UsageError(f"{len(data_dirs)} data dirs but {len(peers)} --peers: give one data dir per node")
    layout = Layout(tuple(peers or (f"node{i}:{i}" for i in range(1, len(data_dirs) + 1))), len(parts))
    from raftps.server.node import default_payload_dir
    for node, d in enumerate(data_dirs, 1):
        for g in layout.hosted_by(node):
            where = data_dir(d, g)
            os.makedirs(where, exist_ok=True)
            # Payloads a previous node with this data dir left in tmpfs belong to another history.
            shutil.rmtree(default_payload_dir(where), ignore_errors=True)
            snapshot_file.seed(where, parts[g]["version"], parts[g]["machine"], layout.peers(g) if peers else [])
    return {**_summary(backup), "groups": len(parts), "data_dirs": list(data_dirs)}
