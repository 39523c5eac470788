"""One status record per replica: ``stats``, the rows of ``raftps status`` and /metrics are all
made from it, so the three cannot disagree on what a counter means."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaStatus:
    node: int                     # the node's --id
    address: str                  # its client address
    pid: int
    metrics: str | None           # host:port of the node's /metrics, or None
    read_mode: str                # linearizable reads: lease, readindex or log
    members: list[str]            # Raft addresses, as this replica knows them
    # Raft
    role: str
    term: int
    commit: int
    applied: int
    leader: str | None            # the leader's client address
    log_len: int
    snapshot_index: int
    has_quorum: bool
    match: dict[str, int]         # leader: the highest index known replicated on each peer
    connected: dict[str, bool]
    read_rounds: int              # ReadIndex confirmation rounds completed
    lease_reads: int              # reads served on the leader's lease
    votes_withheld: int           # vote requests refused under a lease promise
    entries_proposed: int         # log entries this replica proposed as leader ...
    writes_proposed: int          # ... carrying this many writes (group commit)
    # the store, at one version
    version: int
    digest: str | None            # None unless asked for (it hashes the store)
    tensors: int
    sessions: int
    model_bytes: int
    pushes: int                   # applied by the state machine (replicated)
    rejected: int
    duplicates: int
    staleness: dict[int, int]
    sync_applied: int
    # payloads
    payload_disk_bytes: int
    payloads_in_memory: int
    payload_spare_bytes: int
    payload_files: int | None     # None unless counted (a directory scan)
    payload_spare_files: int | None
    missing_payload: str | None   # the payload the next entry waits for
    fetched_payloads: int         # received from peers' get/get_range, not pushed
    fetched_bytes: int

    def stats(self) -> dict:
        """The ``stats`` op's answer."""
        return {"pushes": self.pushes, "rejected": self.rejected, "duplicates": self.duplicates,
                "staleness": self.staleness, "sync_applied": self.sync_applied, "version": self.version,
                "sessions": self.sessions}

    def row(self) -> dict:
        """This replica's row of ``raftps status``."""
        return {key: getattr(self, key) for key in ROW}


ROW = ("node", "address", "role", "term", "applied", "commit", "version", "digest", "leader", "log_len",
       "snapshot_index", "model_bytes", "payload_disk_bytes", "payloads_in_memory", "payload_spare_bytes",
       "missing_payload", "fetched_payloads", "fetched_bytes", "staleness", "pushes", "members", "metrics",
       "pid", "read_mode", "read_rounds", "lease_reads", "votes_withheld", "entries_proposed", "writes_proposed")
