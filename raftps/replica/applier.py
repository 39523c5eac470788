"""The Applier: one replica's state machine and its payloads, applied by the log's thread.

``Replica`` owns the ``TensorStore``, the lock that guards it against readers in other threads,
and the condition they wait on for a version. The log calls ``apply``, ``save_snapshot``,
``snapshot_saved``, ``load_snapshot`` and ``tick`` (raftps.raft.Applier), one at a time. Everyone
else reads through the doors below (``read``, ``locked``, ``in_log_thread``, ``wait_*``,
``store_view``); nothing outside this module touches the machine or its lock.

An entry whose payload is not here yet (its node was down when it went out) does not block the
log's thread: ``apply`` tells ``on_missing`` (the fetcher) and raises NotReady; the log tries
again once the fetcher has it. So heartbeats never wait on the network.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

import msgpack

from raftps import codec

from raftps.server import snapshot_file
from raftps.errors import StepTimeout
from raftps.server.group_commit import BATCH
from raftps.store.machine import TensorStore
from raftps.store.ssp_clocks import ahead as ssp_ahead
from raftps.instruments import Instruments
from raftps.server.payloads import PayloadStore
from raftps.raft import NotReady, SnapshotMeta
from raftps.raft.storage import Storage

log = logging.getLogger("raftps.server.node")
T = TypeVar("T")


class Replica:
    """The state machine over its payloads; raftps.raft.Applier for the log."""

    def __init__(self, payloads: PayloadStore, storage: Storage, limits: codec.Limits, instruments: Instruments):
        self.payloads = payloads
        self._storage = storage
        self._limits = limits
        self._instruments = instruments
        self._machine = TensorStore()
        self._lock = threading.Lock()
        self._applied = threading.Condition(self._lock)
        self.snapshot_index = 0                   # index of the newest snapshot written or loaded
        # set by the node once its collaborators exist (the log may tick before they do)
        self.on_missing: Callable[[str, int], None] = lambda pid, index: None
        self.on_tick: Callable[[], None] = lambda: None

    # ---- called by the log's thread, one at a time ------------------------------------------

    def apply(self, entry: bytes, index: int) -> Any:
        """Apply log entry ``index``: one write, or a batch of them (group_commit.py), each with
        the next store version. A batch's payloads must all be here before any write applies."""
        batch = False
        try:
            command = msgpack.unpackb(entry, raw=False)
            if isinstance(command, dict) and command.get("op") == BATCH:
                batch = True
                entries = command["entries"]
                if not isinstance(entries, list) or not all(isinstance(e, bytes) for e in entries):
                    raise ValueError("a batch's entries are a list of bytes")
                commands = [self._decode(msgpack.unpackb(e, raw=False), index) for e in entries]
            else:
                commands = [self._decode(command, index)]
        except NotReady:
            raise
        except Exception as exc:    # same bytes on every replica, so the same error everywhere
            commands, batch = [({"op": "invalid", "reason": f"undecodable entry: {exc}"}, None)], False
        started = time.perf_counter()
        with self._lock:
            results = [self._machine.apply(self._machine.version + 1, c) for c, _ in commands]
            self._applied.notify_all()
        self._instruments.apply_seconds.observe(time.perf_counter() - started)
        for _, pid in commands:
            if pid is not None:
                self.payloads.applied(pid, index)
        return results if batch else results[0]

    def _decode(self, command: Any, index: int) -> tuple[dict, str | None]:
        """(the command with its tensors, its payload id): raises NotReady if the payload is not here."""
        if not isinstance(command, dict):
            return {"op": "invalid", "reason": "an entry is a map"}, None
        pid = command.pop("payload", None)
        try:
            if pid is not None:
                tensors = self.payloads.get(pid)
                if tensors is None:
                    self.on_missing(pid, index)
                    raise NotReady(pid)
                command["tensors"] = tensors
            elif "inline" in command:
                command["tensors"] = codec.decode(command.pop("inline"), self._limits)["tensors"]
        except NotReady:
            raise
        except Exception as exc:    # same bytes on every replica, so the same error everywhere
            return {"op": "invalid", "reason": f"undecodable entry: {exc}"}, None
        return command, pid

    def save_snapshot(self, path: str, meta: SnapshotMeta) -> None:
        # In the log's thread: no apply runs until the frame is written, so nothing is frozen.
        # Durable: the log fsyncs it, renames it into place and fsyncs the directory.
        snapshot_file.write(path, meta, self._machine.snapshot(share=False), self._storage)

    def snapshot_saved(self, meta: SnapshotMeta) -> None:
        # The file is in place: upkeep may now collect the payloads it covers (not before: a
        # failed rename or fsync would leave them needed by the older snapshot and the journal).
        self.snapshot_index = meta.index
        self._instruments.snapshots.labels("write").inc()

    def load_snapshot(self, path: str) -> SnapshotMeta:
        meta, machine = snapshot_file.read(path)
        self.restore(machine)
        self.snapshot_index = meta.index
        self._instruments.snapshots.labels("load").inc()
        return meta

    def restore(self, machine: dict) -> None:
        """Replace the state by a snapshot's (in the log's thread)."""
        with self._lock:
            self._machine.restore(machine)
            self._applied.notify_all()

    def tick(self) -> None:
        self.on_tick()

    # ---- the doors: what other threads may ask ----------------------------------------------

    @property
    def version(self) -> int:
        return self._machine.version

    def read(self, names: list[str] | None) -> tuple[dict, int]:
        with self._lock:
            return self._machine.read(names)

    def locked(self, fn: Callable[[TensorStore], T]) -> T:
        """``fn(machine)`` under the apply lock: between two applies. ``fn`` must be quick and
        must not keep references to the machine's mutable containers."""
        with self._lock:
            return fn(self._machine)

    def in_log_thread(self, fn: Callable[[TensorStore], T]) -> T:
        """``fn(machine)`` without the lock: only from the log's thread (a read it runs, an
        on_applied callback), where no apply can run meanwhile."""
        return fn(self._machine)

    def wait_version(self, version: int, timeout: float) -> bool:
        with self._applied:
            return self._applied.wait_for(lambda: self._machine.version >= version, timeout)

    def wait_step(self, step: int, timeout: float, job: str = "") -> int:
        machine = self._machine
        with self._applied:
            if not self._applied.wait_for(lambda: machine.sync_step_applied(job) >= step, timeout):
                where = f" of job {job!r}" if job else ""
                raise StepTimeout(f"sync step {step}{where} not applied within {timeout:.1f} s "
                                  f"({machine.sync_count(job, step)} contribution(s) so far)")
            return machine.version

    def wait_ssp(self, ssp_group: str, worker: str, timeout: float) -> dict:
        """Block until ``worker`` may take its next SSP step (at most s clocks ahead of the slowest
        member of ``ssp_group``), it is no longer a member, or ``timeout`` passes. Never decides
        anything: on a timeout the caller gets the slowest members and may ask for an ssp_drop
        entry, which the state machine applies only if their clocks did not move."""
        machine = self._machine

        def ready() -> bool:
            g = machine.ssp.get(ssp_group)
            return g is None or worker not in g["clocks"] or g["staleness"] is None \
                or ssp_ahead(g, worker) <= g["staleness"]
        with self._applied:
            ok = self._applied.wait_for(ready, timeout)
            g = machine.ssp_state(ssp_group) or {"staleness": None, "clocks": {}}
            clocks = g["clocks"]
            slowest = min(clocks.values()) if clocks else 0
            return {"version": machine.version, "ready": ok, "member": worker in clocks,
                    "clock": clocks.get(worker), "min_clock": slowest,
                    "slowest": [[w, c] for w, c in clocks.items() if c == slowest and w != worker]}

    def store_view(self, digest: bool = False) -> dict:
        """The store's counters at one version, for the replica's status record."""
        with self._lock:
            m = self._machine
            return {"version": m.version, "tensors": len(m.tensors), "sessions": len(m.sessions),
                    "model_bytes": m.model_bytes(), "pushes": m.stats["pushes"], "rejected": m.stats["rejected"],
                    "duplicates": m.stats["duplicates"], "staleness": m.staleness_histogram(),
                    "sync_applied": m.sync_applied, "digest": m.digest() if digest else None}

    def model_bytes(self) -> int:
        return self._machine.model_bytes()
