"""``MemoryLog``: a one-member ReplicatedLog in memory, for fast in-process tests of a replica and
the client server (no sockets, no elections: it is the leader of term 1 from the start).

Entries commit as soon as they are appended (one member is a majority) and are applied in order
by the log's own thread, with the same contract as the real log: NotReady stops the loop before
the entry until ``wake()``; ``read_index`` runs once everything committed before it is applied;
``compact()`` saves a snapshot through the Applier. The log itself is not kept across restarts;
a snapshot in ``data_dir`` is loaded on start, as a real member would.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

from raftps.raft import (Applier, NotApplied, NotReady, RaftSettings, RaftStatus, ReplicatedLog, SnapshotMeta,
                         saved_hook)

TICK = 0.05
NO_OP = b"\x01"          # the boundary entries' bytes in a snapshot this log writes


class MemoryLog(ReplicatedLog):
    def __init__(self, settings: RaftSettings, applier: Applier):
        self.address = settings.address
        self._applier = applier
        self._snapshot = os.path.join(settings.data_dir, "raft.snapshot")
        self._cond = threading.Condition()
        self._entries: list[tuple[bytes, Callable[[Any, NotApplied | None], None] | None]] = []
        self._first = 1                      # index of _entries[0]
        self._applied = 0
        self._jobs: list[Callable[[], None]] = []
        self._compact = False
        self._stopped = False
        self._woken = False
        if os.path.exists(self._snapshot):
            meta = applier.load_snapshot(self._snapshot)
            self._applied = meta.index
            self._first = meta.index + 1
        self._thread = threading.Thread(target=self._loop, name="memory-log", daemon=True)
        self._thread.start()

    # ---- the log's thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._woken:
                    self._cond.wait(TICK)
                self._woken = False
                if self._stopped:
                    return
                jobs, self._jobs = self._jobs, []
            for job in jobs:
                job()
            self._apply_committed()
            if self._compact:
                self._compact = False
                self._save_snapshot()
            self._applier.tick()

    def _apply_committed(self) -> None:
        while True:
            with self._cond:
                offset = self._applied + 1 - self._first
                if offset >= len(self._entries):
                    return
                entry, done = self._entries[offset]
            try:
                result = self._applier.apply(entry, self._applied + 1)
            except NotReady:
                return
            with self._cond:
                self._applied += 1
                self._cond.notify_all()
            if done is not None:
                done(result, None)

    def _save_snapshot(self) -> None:
        index = self._applied
        meta = SnapshotMeta((NO_OP, index, 1), (NO_OP, index - 1, 1), [self.address])
        self._applier.save_snapshot(self._snapshot + ".tmp", meta)
        os.replace(self._snapshot + ".tmp", self._snapshot)
        saved_hook(self._applier)(meta)
        with self._cond:
            del self._entries[:index + 1 - self._first]
            self._first = index + 1

    def _in_thread(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._jobs.append(job)
            self._woken = True
            self._cond.notify_all()

    # ---- ReplicatedLog -----------------------------------------------------------------------

    def propose(self, entry: bytes, done: Callable[[Any, NotApplied | None], None]) -> None:
        with self._cond:
            if self._stopped:
                done(None, NotApplied("the log is stopped", applied=False))
                return
            self._entries.append((entry, done))
            self._woken = True
            self._cond.notify_all()

    def read_index(self, run: Callable[[], Any], timeout: float) -> Any:
        with self._cond:
            index = self._first + len(self._entries) - 1       # commit index: everything appended
        box: list = []
        ready = threading.Event()

        def attempt() -> None:
            if self._applied >= index:
                box.append(run())
                ready.set()
            else:
                self._jobs.append(attempt)          # runs again on the next turn, after applies
        self._in_thread(attempt)
        if not ready.wait(timeout):
            raise NotApplied("read not served before the request timeout", applied=False)
        return box[0]

    def is_leader(self) -> bool:
        return not self._stopped

    def leader(self) -> str | None:
        return None if self._stopped else self.address

    def others(self) -> list[str]:
        return []

    def status(self) -> RaftStatus:
        with self._cond:
            commit = self._first + len(self._entries) - 1
            return RaftStatus(role="leader", term=1, commit=commit, applied=self._applied,
                              log_len=len(self._entries), has_quorum=True, leader=self.address)

    @property
    def applied_index(self) -> int:
        return self._applied

    @property
    def commit_index(self) -> int:
        with self._cond:
            return self._first + len(self._entries) - 1

    def compact(self) -> None:
        self._compact = True
        self.wake()

    def install(self, meta_index: int, restore: Callable[[], None]) -> None:
        def job() -> None:
            if meta_index > self._applied:
                restore()
                with self._cond:
                    self._applied = meta_index
        self._in_thread(job)

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def change_members(self, action: str, address: str, done: Callable[[bool, str], None]) -> None:
        done(False, "a MemoryLog has exactly one member")

    def transfer_leadership(self, timeout: float, to: str | None = None) -> None:
        return None

    def is_connected(self, address: str) -> bool:
        return False

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            pending = self._entries[self._applied + 1 - self._first:]
            self._cond.notify_all()
        self._thread.join(5.0)
        for _, done in pending:
            if done is not None:
                done(None, NotApplied("the log stopped before the entry was applied", applied=None))
