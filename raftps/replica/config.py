"""A node's configuration (one Raft group's replica of it) and its addresses. Where its payload files
live is decided with the rest of its durability (raft/durability.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from raftps import codec

READ_MODES = ("readindex", "lease", "log")     # NodeConfig.read_mode


@dataclass
class NodeConfig:
    node_id: int                              # 1..N, position in `peers`
    peers: list[str]                          # every node's Raft address host:port, in node order
    data_dir: str
    secret: bytes
    cluster_node: int = 0                     # with several Raft groups: this node's --id (0: node_id)
    client_offset: int = 100                  # client port = Raft port + client_offset
    data_offset: int = 200                    # data-plane port = Raft port + data_offset
    metrics_offset: int = 300                 # /metrics port = Raft port + metrics_offset ...
    metrics_port: int | None = None           # ... unless given here; 0: no metrics server
    bind_host: str | None = None              # default: the host of this node's Raft address
    payload_dir: str | None = None            # default: Durability.payload_dir(data_dir) (raft/durability.py)
    # Payloads up to this size travel inside the entry. Above a few KiB pysyncobj's per-follower
    # pickle + framing + signing in the tick thread cost more than a data-plane round trip
    # (64 KiB inline, measured with Fernet: 41 pushes/s with 4 clients, the leader's tick 66% in TcpConnection.send).
    inline_bytes: int = 8 << 10
    payload_budget: int = 512 << 20           # payload bytes on disk that force a snapshot, at most
    # ... and at least max(floor, ratio x the store's bytes): a small model snapshots often, so its
    # payload files turn into spares (overwritten, not allocated) early; see _payloads_call_for_snapshot.
    payload_snapshot_floor: int = 64 << 20
    payload_snapshot_ratio: int = 4
    compaction_entries: int = 2000
    election_timeout: tuple[float, float] = (0.75, 1.5)   # leader SIGKILL to next push: median 1.02 s, max 1.26 s (8 kills); no spurious election under 16 MiB x4 adam load
    heartbeat: float = 0.1
    leader_fallback: float = 1.875            # a leader without a majority steps down after this (2.5x election)
    request_timeout: float = 3.0              # one write's wait for replication and commit
    # Group commit (group_commit.py): log entries proposed and not yet applied, at most; writes
    # arriving meanwhile share the next entry. 0: every write its own entry, at once.
    entries_in_flight: int = 2
    # "fsync": nothing acknowledged is lost to a power cut (docs/guarantees/durability.md): the Raft journal,
    # term and vote, payloads (on disk in the data dir, not tmpfs) and snapshots are fsynced before
    # they count. "none": they survive a process crash, not a power loss (the default, measured).
    # What each mode means for each file is decided in one place: raft/durability.py.
    durability: str = "none"
    # With several Raft groups: the member that should lead this group (groups.py spreads them
    # over the nodes); a leader hands over to it once it is connected and caught up. None: any.
    preferred_leader: str | None = None
    limits: codec.Limits = field(default_factory=codec.Limits)   # frame, tensor and array-count limits
    # The client port (docs/security.md). No token: any client that reaches the port is served.
    client_token: str | None = None
    token_file: str | None = None             # where client_token came from: re-read when it changes
    auth_file: str | None = None              # named identities with roles (rbac.py), re-read when it changes
    tls_cert: str | None = None               # serve the client port over TLS with this cert + key
    tls_key: str | None = None
    max_connections: int = 256                # client connections in total (a thread each)
    max_connections_per_ip: int = 64
    max_tensors_per_push: int = 1024
    frame_timeout: float = 30.0               # a frame must complete within this of its first byte
    idle_timeout: float = 600.0               # an idle client connection is closed after this
    # Linearizable reads: "readindex" (Raft ReadIndex, no log entry: see RaftNode.linearizable),
    # "lease" (ReadIndex whose confirmation rounds also grant the leader a lease that most reads
    # are served on: no round trip; rests on a bound on clock-rate drift, docs/design/reads.md,
    # "lease") or "log" (a barrier entry through the log, the way every read went before).
    read_mode: str = "lease"
    # Tests only: skip ReadIndex's confirmation round (step 3). UNSAFE: a deposed leader that does
    # not know it yet then serves stale reads; tests/test_readindex.py shows it.
    read_confirm: bool = True
    # A non-voting learner of the group (a move's stage "learn", hosting.py): it catches up into
    # data_dir and is never a member until a voter is started on the same files.
    learner: bool = False

    def address(self, node: int, offset: int = 0) -> str:
        host, port = self.peers[node - 1].rsplit(":", 1)
        return f"{host}:{int(port) + offset}"

    @property
    def raft_address(self) -> str:
        return self.address(self.node_id)

    def bind(self, offset: int) -> tuple[str, int]:
        host, port = self.address(self.node_id, offset).rsplit(":", 1)
        return self.bind_host or host, int(port)

    def metrics_bind(self) -> tuple[str, int] | None:
        """Where this node serves /metrics (its own host), or None when turned off."""
        if self.metrics_port == 0:
            return None
        host, port = self.bind(self.metrics_offset)
        return host, self.metrics_port or port


def offset_address(address: str, offset: int) -> str:
    """The port ``offset`` above a node's Raft address (client +100, data plane +200, metrics +300)."""
    host, port = address.rsplit(":", 1)
    return f"{host}:{int(port) + offset}"
