"""The state machine's snapshot: the whole TensorStore as one codec message and back, and its
digest. Every collection is written in sorted (or, for sessions, least recently active) order,
so equal states give equal bytes on every replica.
"""
from __future__ import annotations

import hashlib
from collections import deque
from typing import Any

import numpy as np

from raftps import codec
from raftps.tensor import Tensor, freeze, freeze_tensor
from raftps.store.write_sessions import Session

# 2: sync steps per job, with the ranks that contributed; 3: moves (frozen tensors, tombstones,
# installs, the placement table: moves.py). ``fill`` still reads formats 1 and 2.
SNAPSHOT_FORMAT = 3


def message(store: Any, share: bool = True) -> dict:
    """``store`` (a TensorStore) as a codec message; see TensorStore.snapshot."""
    if share:
        for tensor in store.tensors.values():
            freeze_tensor(tensor)
    return {
        "format": SNAPSHOT_FORMAT,
        "version": store.version,
        "tensors": [[name, t.data, t.version, t.optimizer, sorted(t.state.items())]
                    for name, t in sorted(store.tensors.items())],
        "sessions": [[client, s.floor, s.last_index, sorted(s.results.items())]
                     for client, s in store.sessions.items()],
        "sync": store.sync.snapshot(),
        "update_indices": [[name, list(ix)] for name, ix in sorted(store.update_indices.items())],
        "ssp": store.ssp.snapshot(),
        "stats": [store.stats["pushes"], store.stats["rejected"], store.stats["duplicates"],
                  sorted(store.stats["staleness"].items())],
        "moves": store.moves.snapshot(),
        # group 0's hosts record (hosts.py), once a host was added or a replica moved
        **({"hosts": store.hosts.snapshot()} if store.hosts.current is not None else {}),
    }


def fill(fresh: Any, snap: Any) -> None:
    """Load ``snap`` (a ``message``, of any format this code reads) into ``fresh``, a new TensorStore."""
    if not isinstance(snap, dict) or snap.get("format") not in (1, 2, SNAPSHOT_FORMAT):
        raise ValueError(f"not a raftps snapshot of format 1, 2 or {SNAPSHOT_FORMAT}")
    fresh.version = snap["version"]
    for name, data, version, spec, state in snap["tensors"]:
        fresh.tensors[name] = Tensor(freeze(np.array(data)), version, spec,
                                     {k: freeze(np.array(v)) if isinstance(v, np.ndarray) else v for k, v in state})
    for client, floor, last_index, results in snap["sessions"]:
        fresh.sessions[client] = Session(floor, last_index, dict(results))
    fresh.sync.restore(snap["sync"], snap["format"])
    for name, indices in snap.get("update_indices", []):
        fresh.update_indices[name] = deque(indices, maxlen=fresh.staleness_window)
    fresh.ssp.restore(snap.get("ssp", []))
    pushes, rejected, duplicates, staleness = snap["stats"]
    fresh.stats = {"pushes": pushes, "rejected": rejected, "duplicates": duplicates, "staleness": dict(staleness)}
    fresh.moves.restore(snap.get("moves"))
    fresh.hosts.restore(snap.get("hosts"))


def snapshot_digest(snap: dict) -> str:
    """The digest of the store that ``snap`` (a ``message``) was taken from. ``message`` freezes
    the tensors' arrays (the next row-sparse push copies instead of writing in place), and every
    other update replaces arrays, so a snapshot taken between applies can be hashed and sent
    later, outside the thread that applies."""
    h = hashlib.sha256()
    for buf in codec.encode(snap):
        h.update(buf)
    return h.hexdigest()
