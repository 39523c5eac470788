"""Group commit: writes that reach the leader while earlier entries are being committed share one
log entry.

Every log entry costs the same fixed work whatever it carries: pickling, framing and signing
per follower in pysyncobj's one tick thread, an append, an acknowledgement, and with
``--durability fsync`` a place in an fsync. So the leader keeps at most ``in_flight`` entries
proposed and not yet applied; writes that arrive meanwhile wait in a queue and go out together
as one ``{"op": "batch", "entries": [entry, ...]}`` entry when one of those is applied. A write
that arrives while fewer are in flight goes out at once, alone: group commit adds no wait to a
lone write, and batches grow exactly as fast as writes arrive faster than entries commit.

Each write in a batch keeps its own (client id, seq) and its own result; the replica applies the
writes of a batch in order and gives each the next store version, so versions stay unique. A
write that must be applied alone (a read barrier, whose reader runs right after its apply) is
never batched.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import msgpack

from raftps.raft import NotApplied, ReplicatedLog

Done = Callable[[Any, NotApplied | None], None]
BATCH = "batch"


def pack_batch(entries: list[bytes]) -> bytes:
    return msgpack.packb({"op": BATCH, "entries": entries}, use_bin_type=True)


class GroupCommit:
    def __init__(self, log: ReplicatedLog, in_flight: int = 2, max_writes: int = 256, max_bytes: int = 4 << 20):
        """``in_flight`` 0: no group commit (every write proposed at once, alone)."""
        self.log = log
        self.in_flight_limit = in_flight or 1 << 30
        self.max_writes = max_writes if in_flight else 1
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._queue: list[tuple[bytes, Done, bool]] = []
        self._in_flight = 0
        self._stopped = False
        self.entries = self.writes = 0            # proposed so far (status: writes per entry)
        threading.Thread(target=self._loop, name="group-commit", daemon=True).start()

    def propose(self, entry: bytes, done: Done, alone: bool = False) -> None:
        """Propose ``entry`` (with others, unless ``alone``); ``done`` as ReplicatedLog.propose."""
        with self._cond:
            if self._stopped:
                done(None, NotApplied("the node is stopping", applied=False))
                return
            self._queue.append((entry, done, alone))
            self._cond.notify_all()

    def _take(self) -> list[tuple[bytes, Done, bool]]:
        """The next entry's writes: the queue's head and what may join it (caller holds the lock)."""
        taken = [self._queue.pop(0)]
        if taken[0][2]:
            return taken
        size = len(taken[0][0])
        while self._queue and len(taken) < self.max_writes and not self._queue[0][2] \
                and size + len(self._queue[0][0]) <= self.max_bytes:
            size += len(self._queue[0][0])
            taken.append(self._queue.pop(0))
        return taken

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._queue or self._in_flight >= self.in_flight_limit):
                    self._cond.wait(1.0)
                if self._stopped:
                    return
                writes = self._take()
                self._in_flight += 1
                self.entries += 1
                self.writes += len(writes)
            if len(writes) == 1:
                self.log.propose(writes[0][0], self._finisher(writes))
            else:
                self.log.propose(pack_batch([w[0] for w in writes]), self._finisher(writes))

    def _finisher(self, writes: list[tuple[bytes, Done, bool]]) -> Done:
        def finish(result: Any, error: NotApplied | None) -> None:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()
            if len(writes) == 1:
                writes[0][1](result, error)
                return
            each = result if isinstance(result, list) and len(result) == len(writes) else [result] * len(writes)
            for (_, done, _), one in zip(writes, each):
                done(None if error is not None else one, error)
        return finish

    def stop(self) -> None:
        """Fail the writes still queued (never proposed, so certainly not applied)."""
        with self._cond:
            self._stopped = True
            queued, self._queue = self._queue, []
            self._cond.notify_all()
        for _, done, _ in queued:
            done(None, NotApplied("the node stopped before the write was proposed", applied=False))
