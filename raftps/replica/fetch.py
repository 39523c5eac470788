"""Payloads an entry waits for: fetched from peers in a thread of their own, so that the log's
thread never waits on the network. When no peer has the payload any more (their snapshots
cover its entry), a peer's snapshot replaces the entries it covers."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np

from raftps.server.dataplane import Peers
from raftps.instruments import Instruments
from raftps.raft import ReplicatedLog, SnapshotMeta
from raftps.replica.applier import Replica

log = logging.getLogger("raftps.server.node")
# How long an applier waits for a payload the leader is still sending before asking a peer.
PUT_GRACE = 0.2


class PayloadFetcher:
    """Gets the payload the next entry waits for (``want``) from a peer."""

    def __init__(self, replica: Replica, peers: Peers, instruments: Instruments):
        self._replica = replica
        self._payloads = replica.payloads
        self._peers = peers
        self._instruments = instruments
        self._log: ReplicatedLog | None = None
        self.missing: str | None = None           # the payload the next entry waits for
        self._missing_index = 0
        self._event = threading.Event()
        self.fetched_payloads = 0                 # received from peers' get/get_range, not pushed
        self.fetched_bytes = 0
        self._stopped = False

    def start(self, replicated_log: ReplicatedLog) -> None:
        self._log = replicated_log
        threading.Thread(target=self._loop, name="payload-fetch", daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        self._event.set()

    def want(self, pid: str, index: int) -> None:
        """Entry ``index`` waits for payload ``pid`` (called by the log's thread)."""
        self._missing_index = index
        if self.missing != pid:
            self.missing = pid
            self._event.set()

    def _loop(self) -> None:
        while not self._stopped:
            try:
                self._fetch_missing()
            except Exception:          # the fetcher must outlive any one bad reply
                log.exception("payload fetch failed")
                time.sleep(0.2)

    def _fetch_missing(self) -> None:
        failures = 0
        while not self._stopped:
            self._event.wait(1.0)
            self._event.clear()
            pid = self.missing
            if pid is None:
                failures = 0
                continue
            # The leader sends a payload to every peer before it proposes the entry, so a node
            # that was up is usually a few ms from having it, even when commits run several
            # entries ahead of its applies under concurrent pushes (asking a peer at once there
            # re-received 17-32% of all pushed bytes at 1 MiB x4). Only a node that missed
            # puts (down, cut off) gets past this wait; it asks for the next entries' payloads
            # too (a peer knows them by log index).
            if not self._payloads.wait(pid, PUT_GRACE) and self._log.commit_index - self._missing_index > 2:
                self._fetch_range(self._missing_index)
            if not self._payloads.has(pid):
                tensors = self._peers.fetch(pid)
                if tensors is None:
                    failures += 1
                    self._instruments.errors.labels("PayloadNotOnPeers").inc()
                    log.warning("payload %s of the next entry is on no reachable peer yet", pid)
                    # Peers delete a payload once their snapshot covers its entry, so when none has
                    # it, a peer's snapshot covers it: that committed state replaces the entry.
                    if failures >= 3:
                        found = self._peers.fetch_snapshot(self._log.applied_index + 1)
                        if found is not None:
                            self._install_peer_snapshot(*found)
                            failures = 0
                    time.sleep(0.2)
                    self._event.set()
                    continue
                self._payloads.put(pid, tensors)
                self._count(tensors)
            if self.missing == pid:
                self.missing = None
            self._log.wake()

    def _install_peer_snapshot(self, meta: SnapshotMeta, machine: dict) -> None:
        """Jump the state machine to a peer's snapshot (in the log's thread). The Raft log is
        untouched; only entries the snapshot already covers are skipped."""
        def restore() -> None:
            self._replica.restore(machine)
            log.warning("installed a peer's snapshot at index %d (payload %s is gone everywhere)",
                        meta.index, self.missing)
            self.missing = None
        self._log.install(meta.index, restore)

    def _fetch_range(self, first: int) -> None:
        for pid, tensors in self._peers.fetch_range(first, first + 256).items():
            self._count(tensors)
            if not self._payloads.has(pid):
                self._payloads.put(pid, tensors)

    def _count(self, tensors: dict[str, np.ndarray]) -> None:
        self.fetched_payloads += 1
        self.fetched_bytes += sum(a.nbytes for a in tensors.values())
