"""Linearizable reads: on the leader's lease, by Raft ReadIndex, or through a barrier entry."""
from __future__ import annotations

import logging
from typing import Any, Callable

from raftps.errors import Internal, RaftpsError
from raftps.store.machine import TensorStore
from raftps.raft import ReplicatedLog
from raftps.replica.applier import Replica
from raftps.replica.config import NodeConfig
from raftps.replica.writes import WritePath

log = logging.getLogger("raftps.server.node")


class Reads:
    def __init__(self, config: NodeConfig, replica: Replica, replicated_log: ReplicatedLog, writes: WritePath):
        self._config = config
        self._replica = replica
        self._log = replicated_log
        self._writes = writes
        self.lease_reads = 0                      # reads served on the lease in the caller's thread

    def linearizable(self, fn: Callable[[TensorStore], Any]) -> Any:
        """Run ``fn(machine)`` in the log's thread at a state that includes every write that
        completed before this call began, and return its value: exactly the state at one version.
        ``fn`` must be quick (it runs between applies) and may raise RaftpsError. Raises NotApplied
        (the caller retries, possibly elsewhere) when this node cannot prove it may serve the read.

        read_mode "log": commit a barrier entry and run ``fn`` right after it is applied.
        read_mode "readindex" (Raft dissertation 6.4, no log entry) and "lease" (the same, most
        reads on the leader's lease): ReplicatedLog.read_index."""
        def run(machine: TensorStore) -> Any:
            try:
                return fn(machine)
            except RaftpsError as exc:
                return exc
            except Exception as exc:      # a bug: it must cost this read, not the log's thread
                log.exception("linearizable read failed")
                return Internal(f"internal error: {exc!r}")
        index = self._log.lease_read_index() if self._config.read_mode == "lease" else None
        if index is not None:
            def on_lease(machine: TensorStore) -> tuple[bool, Any]:
                # the log counts an entry applied after the machine applied it: under the lock
                # the machine holds at least every entry through applied_index
                if self._log.applied_index < index:
                    return False, None
                self.lease_reads += 1
                return True, run(machine)
            served, out = self._replica.locked(on_lease)
            if served:
                if isinstance(out, RaftpsError):
                    raise out
                return out

        def run_in_log_thread(_: Any = None) -> Any:
            return self._replica.in_log_thread(run)
        if self._config.read_mode == "log":
            out = self._writes.submit({"op": "barrier"}, on_applied=run_in_log_thread)
        else:
            out = self._log.read_index(run_in_log_thread, self._config.request_timeout)
        if isinstance(out, RaftpsError):
            raise out
        return out
