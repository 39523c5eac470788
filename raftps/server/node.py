"""A raftps node's replica of one Raft group: the store, its payloads and its data plane, over a
ReplicatedLog. ``RaftNode`` composes the jobs of raftps/replica/ and is the one door the client
server, the step aggregator and /metrics use:

- the Applier (``replica.applier.Replica``): the log applies committed entries through it, in
  log order; it owns the state machine and the lock readers take;
- the write path (``replica.writes``): payload to a majority, then the entry via group commit;
- reads (``replica.reads``): linearizable reads on the lease, by ReadIndex or a barrier;
- payload fetch (``replica.fetch``) and housekeeping (``replica.upkeep``) in threads of their own;
- membership (``replica.membership``) and one status record (``replica.status``).

The Raft library is behind ``raftps.raft.ReplicatedLog``; this module never imports it.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, TypeVar

import numpy as np

from raftps.server import snapshot_file
from raftps.server.dataplane import DataPlaneServer, Peers
from raftps.server.group_commit import GroupCommit
from raftps.store.machine import TensorStore
from raftps.instruments import Instruments
from raftps.server.payloads import PayloadStore
from raftps.raft import RaftSettings, ReplicatedLog
from raftps.raft.durability import Durability, default_payload_dir, sweep_abandoned_payload_dirs  # noqa: F401 (re-exported)
from raftps.replica.applier import Replica
from raftps.replica.config import READ_MODES, NodeConfig, offset_address  # noqa: F401 (re-exported)
from raftps.replica.fetch import PayloadFetcher
from raftps.replica.membership import Membership
from raftps.replica.reads import Reads
from raftps.replica.status import ReplicaStatus
from raftps.replica.upkeep import Upkeep
from raftps.replica.writes import WritePath

T = TypeVar("T")


LogFactory = Callable[[RaftSettings, Any], ReplicatedLog]


def pysyncobj_log(settings: RaftSettings, applier: Any) -> ReplicatedLog:
    from raftps.raft.pysyncobj_log import SyncObjLog
    return SyncObjLog(settings, applier)


class RaftNode:
    """One member of the store: TensorStore + payloads + data plane, applied by a ReplicatedLog."""

    def __init__(self, config: NodeConfig, log_factory: LogFactory = pysyncobj_log):
        if config.read_mode not in READ_MODES:
            raise ValueError(f"read_mode must be one of {', '.join(READ_MODES)}, not {config.read_mode!r}")
        self.config = config
        self.instruments = Instruments()
        self.metrics_address: str | None = None   # host:port of /metrics once it is served
        self._leader_seen: str | None = None
        os.makedirs(config.data_dir, exist_ok=True)
        sweep_abandoned_payload_dirs()
        # Durability is decided once, here, and handed to the journal, the payloads and the
        # snapshots (raft/durability.py), which share one file layer so a test's simulated disk
        # (raftps/chaos/simdisk_node.py) cuts the power under all three at once.
        durability = Durability.for_mode(config.durability)
        self._payloads = PayloadStore(config.payload_dir or durability.payload_dir(config.data_dir),
                                      owner=os.path.abspath(config.data_dir), storage=durability.storage,
                                      fsync=durability.payload_fsync,
                                      spare_bytes=durability.payload_spare_bytes(config.payload_budget))
        self._replica = Replica(self._payloads, durability.storage, config.limits, self.instruments)
        others = Membership.initial_others(config)
        peers = Peers([offset_address(a, config.data_offset) for a in others], config.secret)
        self._membership = Membership(config, peers)
        self._data_server = DataPlaneServer(*config.bind(config.data_offset), config.secret, self._payloads,
                                            config.limits, snapshot_file=snapshot_file.path(config.data_dir))
        self._fetcher = PayloadFetcher(self._replica, peers, self.instruments)
        self._upkeep = Upkeep(config, self._replica, self._fetcher)
        self._replica.on_missing = self._fetcher.want
        self._replica.on_tick = self._tick
        # The log may tick before its constructor returns, and before the parts below are wired
        # to it: _tick does nothing until the last of them has started.
        self._wired = False
        self.log: ReplicatedLog | None = None
        self.log = log_factory(RaftSettings(
            address=config.raft_address, others=others, data_dir=config.data_dir,
            secret=config.secret, bind=":".join(map(str, config.bind(0))), heartbeat=config.heartbeat,
            election_timeout=config.election_timeout, leader_fallback=config.leader_fallback,
            compaction_entries=config.compaction_entries, read_confirm=config.read_confirm,
            read_lease=config.read_mode == "lease", learner=config.learner,
            durability=durability), self._replica)
        self._membership.attach(self.log)
        self._group_commit = GroupCommit(self.log, in_flight=config.entries_in_flight)
        self._writes = WritePath(config, self._membership, self._payloads, self._group_commit, self.instruments)
        self._reads = Reads(config, self._replica, self.log, self._writes)
        self._fetcher.start(self.log)
        self._upkeep.start(self.log)
        self._wired = True

    def _tick(self) -> None:
        """On every turn of the log's loop (its thread)."""
        if not self._wired:
            return
        leader = self.log.leader()
        if leader is not None and leader != self._leader_seen:
            self._leader_seen = leader
            self.instruments.leader_changes.inc()
        self._membership.follow()
        self._upkeep.tick()

    # ---- writes -----------------------------------------------------------------------------

    def submit(self, command: dict, tensors: dict[str, np.ndarray] | None = None,
               on_applied: Callable[[dict], Any] | None = None, payload_name: str | None = None) -> Any:
        """Replicate one command and return the state machine's result (or ``on_applied``'s value,
        computed in the log's thread right after the entry is applied). Raises NotApplied."""
        return self._writes.submit(command, tensors, on_applied, payload_name)

    def held_payload(self, pid: str) -> dict[str, np.ndarray] | None:
        """The payload ``pid`` if this node holds it intact (a write's, sent to it by a leader)."""
        try:
            return self._payloads.get(pid)
        except ValueError:            # not a payload id
            return None

    # ---- reads ------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The store version this replica has applied."""
        return self._replica.version

    def read(self, names: list[str] | None) -> tuple[dict, int]:
        return self._replica.read(names)

    def read_locked(self, fn: Callable[[TensorStore], T]) -> T:
        """``fn(machine)`` between two applies (under the apply lock); ``fn`` must be quick."""
        return self._replica.locked(fn)

    def read_in_log_thread(self, fn: Callable[[TensorStore], T]) -> T:
        """``fn(machine)`` from the log's thread (an ``on_applied`` callback), where no apply runs."""
        return self._replica.in_log_thread(fn)

    def linearizable(self, fn: Callable[[TensorStore], Any]) -> Any:
        """``fn(machine)`` at a state that includes every write completed before this call
        (replica/reads.py). Raises NotApplied when this node cannot prove it may serve the read."""
        return self._reads.linearizable(fn)

    def linearizable_read(self, names: list[str] | None) -> tuple[dict, int]:
        return self.linearizable(lambda m: m.read(names))

    def wait_version(self, version: int, timeout: float) -> bool:
        return self._replica.wait_version(version, timeout)

    def wait_step(self, step: int, timeout: float, job: str = "") -> int:
        """Block until sync step ``step`` of ``job`` is applied; the store version then."""
        return self._replica.wait_step(step, timeout, job)

    def wait_ssp(self, ssp_group: str, worker: str, timeout: float) -> dict:
        return self._replica.wait_ssp(ssp_group, worker, timeout)

    # ---- the Raft group ---------------------------------------------------------------------

    @property
    def members(self) -> list[str]:
        """Raft addresses of every member, this node included."""
        return self._membership.members

    def joined(self) -> bool:
        """A learner: whether the group's log has made this node's address a member (appended,
        perhaps not committed yet: pysyncobj puts a membership change in force on append)."""
        return self.config.raft_address in self._membership.others

    @property
    def majority(self) -> int:
        return self._membership.majority

    def is_leader(self) -> bool:
        return self.log.is_leader()

    def leader_client_address(self) -> str | None:
        leader = self.log.leader()
        return None if leader is None else offset_address(leader, self.config.client_offset)

    def set_preferred_leader(self, address: str) -> None:
        """The member (its Raft address) this group's leader hands leadership to (upkeep.py)."""
        self._upkeep.preferred_leader = address

    def change_members(self, action: str, address: str, timeout: float = 10.0) -> dict:
        """Add or remove one member (replica/membership.py)."""
        return self._membership.change(action, address, timeout)

    def is_connected(self, address: str) -> bool:
        return self.log.is_connected(address)

    def tick_thread_alive(self) -> bool:
        return self.log.alive()

    # ---- status -----------------------------------------------------------------------------

    def status_record(self, digest: bool = False, count_files: bool = False) -> ReplicaStatus:
        """This replica's one status record. ``digest`` hashes the store; ``count_files`` scans
        the payload directory."""
        raft = self.log.status()
        store = self._replica.store_view(digest)
        files, spares = self._payloads.count_files() if count_files else (None, None)
        config = self.config
        return ReplicaStatus(
            node=config.cluster_node or config.node_id, address=config.address(config.node_id, config.client_offset),
            pid=os.getpid(), metrics=self.metrics_address, read_mode=config.read_mode, members=self.members,
            role="learner" if config.learner else raft.role, term=raft.term, commit=raft.commit, applied=raft.applied,
            leader=None if raft.leader is None else offset_address(raft.leader, config.client_offset),
            log_len=raft.log_len, snapshot_index=self._replica.snapshot_index, has_quorum=raft.has_quorum,
            match=raft.match, connected=raft.connected, read_rounds=raft.read_rounds,
            lease_reads=raft.lease_reads + self._reads.lease_reads, votes_withheld=raft.votes_withheld,
            entries_proposed=self._group_commit.entries, writes_proposed=self._group_commit.writes,
            version=store["version"], digest=store["digest"], tensors=store["tensors"], sessions=store["sessions"],
            model_bytes=store["model_bytes"], pushes=store["pushes"], rejected=store["rejected"],
            duplicates=store["duplicates"], staleness=store["staleness"], sync_applied=store["sync_applied"],
            payload_disk_bytes=self._payloads.disk_bytes, payloads_in_memory=self._payloads.in_memory,
            payload_spare_bytes=self._payloads.spare_bytes_held, payload_files=files, payload_spare_files=spares,
            missing_payload=self._fetcher.missing, fetched_payloads=self._fetcher.fetched_payloads,
            fetched_bytes=self._fetcher.fetched_bytes)

    def stats(self) -> dict:
        return self.status_record().stats()

    def status(self, digest: bool = True) -> dict:
        """This node's row of ``raftps status``. ``digest=False`` skips hashing the store (a poller
        such as ``raftps top`` would otherwise hash it at every new version)."""
        return self.status_record(digest=digest).row()

    def stop(self, snapshot_timeout: float = 30.0) -> None:
        """Stop gracefully: first a snapshot, so the data dir alone restores this node."""
        target = self.log.applied_index
        if self._replica.snapshot_index < target - 1:
            self.log.compact()
            deadline = time.monotonic() + snapshot_timeout
            while self._replica.snapshot_index < target - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        self._upkeep.stop()
        self._group_commit.stop()
        self._fetcher.stop()
        self._data_server.close()
        self._membership.peers.close()
        self.log.stop()
        self._payloads.drop_spares()
