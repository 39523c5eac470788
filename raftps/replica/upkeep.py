"""Housekeeping of one replica, on the log's tick and in two threads of its own: payload files a
snapshot covers collected, the payload budget that calls for a snapshot, orphan payloads, and
leadership handed to the group's preferred member."""
from __future__ import annotations

import logging
import queue
import threading
import time

from raftps.server.payloads import PayloadStore
from raftps.raft import ReplicatedLog
from raftps.replica.applier import Replica
from raftps.replica.config import NodeConfig
from raftps.replica.fetch import PayloadFetcher

log = logging.getLogger("raftps.server.node")


class Upkeep:
    def __init__(self, config: NodeConfig, replica: Replica, fetcher: PayloadFetcher):
        self._config = config
        self._replica = replica
        self._payloads: PayloadStore = replica.payloads
        self._fetcher = fetcher
        self._log: ReplicatedLog | None = None
        self._collected_through = 0
        self._to_collect: queue.SimpleQueue[int] = queue.SimpleQueue()   # snapshot-covered indices
        self._last_orphans = self._budget_compacted = time.monotonic()
        self._budget_snapshot = -1                # snapshot index when the payload budget last asked for one
        self._stopped = False
        # the member that should lead this group; with several groups the hosts record names
        # it and the placement loop may change it (hosting.py sets it on every new record)
        self.preferred_leader: str | None = config.preferred_leader

    def start(self, replicated_log: ReplicatedLog) -> None:
        self._log = replicated_log
        threading.Thread(target=self._collect_loop, name="payload-collect", daemon=True).start()
        if self.preferred_leader is not None:
            threading.Thread(target=self._hand_over_loop, name="leader-balance", daemon=True).start()

    def stop(self) -> None:
        self._stopped = True

    def tick(self) -> None:
        """On every turn of the log's loop."""
        snapshot_index = self._replica.snapshot_index
        # The log renamed the snapshot into place right after save_snapshot returned (durable:
        # fsynced, with its directory), so the payloads it covers are no longer needed to
        # restart. Keep the two newest entries' payloads: pysyncobj keeps those two entries in
        # its log and may still send them to a peer.
        if snapshot_index - 2 > self._collected_through:
            self._collected_through = snapshot_index - 2
            # not in the log's thread: removing the few hundred files of a snapshot's worth of
            # 1 MiB payloads took 0.6 s there, a stall of every commit on every node at once
            self._to_collect.put(self._collected_through)
        now = time.monotonic()
        # Every second once the last one's snapshot is written (else every 5 s): checked every
        # 5 s, 4 MiB pushes at 100 MB/s overshot the budget by 500 MB, more than the spares
        # keep, and the rest was unlinked (durable: trimmed in a journal commit that stalls every
        # fsync on the disk; p99 0.9-1.6 s).
        wait = 1.0 if snapshot_index > self._budget_snapshot else 5.0
        if now - self._budget_compacted > wait and self.payloads_call_for_snapshot():
            self._budget_compacted, self._budget_snapshot = now, snapshot_index
            self._log.compact()
        if now - self._last_orphans > 5.0:
            self._last_orphans = now
            missing = self._fetcher.missing
            self._payloads.collect_orphans(max_age=600.0, keep=[missing] if missing else [])

    def payloads_call_for_snapshot(self) -> bool:
        """Whether the payload files waiting for a snapshot are worth one: more bytes than
        ``payload_snapshot_ratio`` times the store (model and optimizer state: what a snapshot
        writes), at least ``payload_snapshot_floor``, at most ``payload_budget``. A snapshot lets
        the files it covers be overwritten as spares: in tmpfs a new 4 MiB file costs page
        allocation and zeroing that a spare does not (4 MiB x4 on a 4 MiB model, bench.ab: node
        CPU per push 26.7 -> 23.0 ms against the flat 512 MiB budget). A snapshot costs
        writing the store once, so at the ratio 4 it adds at most a quarter to what the payloads
        wrote; a model of 128 MiB or more keeps the whole budget."""
        config, disk = self._config, self._payloads.disk_bytes
        if disk <= min(config.payload_budget, config.payload_snapshot_floor):
            return False                      # the common case, without summing the store
        return disk > min(config.payload_budget, max(config.payload_snapshot_floor,
                                                     config.payload_snapshot_ratio * self._replica.model_bytes()))

    def _collect_loop(self) -> None:
        while not self._stopped:
            through = self._to_collect.get()
            while not self._to_collect.empty():     # only the newest snapshot matters
                through = max(through, self._to_collect.get())
            try:
                self._payloads.collect(through)
            except Exception:          # housekeeping: a file it missed is collected as an orphan later
                log.exception("payload collection failed")

    def _hand_over_loop(self, every: float = 5.0) -> None:
        """Leaders spread over the nodes: pysyncobj elects whoever times out first, so without
        this one node may lead several groups and carry their traffic. A leader that is not this
        group's preferred member hands over (TimeoutNow) once that member is connected and has
        the whole log (pysyncobj refuses otherwise); checked every few seconds, so a flapping
        node cannot make leadership move often."""
        while not self._stopped:
            time.sleep(every)
            preferred = self.preferred_leader
            if self._stopped or preferred in (None, self._config.raft_address) or not self._log.is_leader() \
                    or not self._log.is_connected(preferred):
                continue
            status = self._log.status()
            if status.match.get(preferred) == status.commit:
                log.info("handing leadership to the preferred member %s", preferred)
                self._log.transfer_leadership(timeout=2.0, to=preferred)
