"""A raftps node's replica: the store, its payloads and its data plane, over a ReplicatedLog.

A write reaches the leader with its tensors. The leader writes the payload to its own
PayloadStore, streams it to every peer's data plane, and once a majority (itself included)
holds it, proposes a small entry naming the payload to the log. Every node applies committed
entries in log order through ``TensorStore.apply`` (``apply`` below, called by the log's thread).
A node that must apply an entry whose payload it lacks (it was down when the payload went out)
does not block that thread: ``apply`` raises NotReady, a fetcher thread gets the payload from a
peer, and the log tries again. So heartbeats never wait on the network.

The Raft library is behind ``raftps.raft.ReplicatedLog``; this module never imports it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import numpy as np

from . import codec, snapshot_file
from .dataplane import DataPlaneServer, Peers
from .errors import Internal, InvalidRequest, RaftpsError, StepTimeout
from .group_commit import BATCH, GroupCommit
from .machine import TensorStore
from .metrics import Instruments
from .payloads import PayloadStore, digest_of
from .raft import NotApplied, NotReady, RaftSettings, ReplicatedLog, SnapshotMeta
from .raft.storage import OSStorage, process_storage, unsafe_skip_fsync

log = logging.getLogger("raftps.node")
# How long an applier waits for a payload the leader is still sending before asking a peer.
PUT_GRACE = 0.2
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
    payload_dir: str | None = None            # default: default_payload_dir(data_dir)
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
    # "fsync": nothing acknowledged is lost to a power cut (README, Durability): the Raft journal,
    # term and vote, payloads (on disk in the data dir, not tmpfs) and snapshots are fsynced before
    # they count. "none": they survive a process crash, not a power loss (the default, measured).
    durability: str = "none"
    # With several Raft groups: the member that should lead this group (groups.py spreads them
    # over the nodes); a leader hands over to it once it is connected and caught up. None: any.
    preferred_leader: str | None = None
    limits: codec.Limits = field(default_factory=codec.Limits)   # frame, tensor and array-count limits
    # The client port (see README, Security). No token: any client that reaches the port is served.
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
    # are served on: no round trip; rests on a bound on clock-rate drift, README "Linearizable
    # reads") or "log" (a barrier entry through the log, the way every read went before).
    read_mode: str = "lease"
    # Tests only: skip ReadIndex's confirmation round (step 3). UNSAFE: a deposed leader that does
    # not know it yet then serves stale reads; tests/test_readindex.py shows it.
    read_confirm: bool = True

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


def default_payload_dir(data_dir: str) -> str:
    """Payloads live in tmpfs where there is one: they survive a process crash (the guarantee
    pysyncobj's own unsynced journal gives) and need no disk bandwidth. Three nodes on one disk
    writing every payload measured 117 MB/s of pushes, disk-bound; tmpfs writes 2 GB/s here.
    A snapshot (taken every ``payload_budget`` bytes, and on graceful stop) makes the data dir
    self-contained again."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        tag = hashlib.sha256(os.path.abspath(data_dir).encode()).hexdigest()[:16]
        return f"/dev/shm/raftps-payloads-{tag}"
    return os.path.join(data_dir, "payloads")


def sweep_abandoned_payload_dirs(root: str = "/dev/shm") -> None:
    """Remove tmpfs payload dirs whose node's data dir no longer exists (a wiped test run)."""
    try:
        names = [n for n in os.listdir(root) if n.startswith("raftps-payloads-")]
    except OSError:
        return
    for name in names:
        try:
            with open(os.path.join(root, name, "OWNER")) as f:
                owner = f.read().strip()
        except OSError:
            continue
        if owner and not os.path.isdir(owner):      # empty: being written (by an older node); keep it
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


LogFactory = Callable[[RaftSettings, Any], ReplicatedLog]


def pysyncobj_log(settings: RaftSettings, applier: Any) -> ReplicatedLog:
    from .raft.pysyncobj_log import SyncObjLog
    return SyncObjLog(settings, applier)


class RaftNode:
    """One member of the store: TensorStore + payloads + data plane, applied by a ReplicatedLog."""

    def __init__(self, config: NodeConfig, log_factory: LogFactory = pysyncobj_log):
        self.config = config
        self.instruments = Instruments()
        self.metrics_address: str | None = None   # host:port of /metrics once it is served
        self._leader_seen: str | None = None
        os.makedirs(config.data_dir, exist_ok=True)
        self.machine = TensorStore()
        self.lock = threading.Lock()              # guards machine against readers in other threads
        self.applied = threading.Condition(self.lock)
        self._lease_reads = 0                     # reads served on the lease in the caller's thread
        sweep_abandoned_payload_dirs()
        durable = config.durability == "fsync"
        payload_dir = config.payload_dir or (os.path.join(config.data_dir, "payloads") if durable
                                             else default_payload_dir(config.data_dir))
        # durable: the journal, payloads and snapshots share one file layer, which a test may
        # replace by a simulated disk (raftps/chaos/simdisk_node.py) to cut the power under all three at once
        self.storage = process_storage() if durable else OSStorage()
        # durable: payloads on disk; every collected file is kept as a spare (up to the budget that
        # forces a snapshot) so that new payloads overwrite allocated blocks (payloads.py)
        self.payloads = PayloadStore(payload_dir, owner=os.path.abspath(config.data_dir), storage=self.storage,
                                     fsync=durable and not unsafe_skip_fsync("payload"),
                                     **({"spare_bytes": config.payload_budget} if durable else {}))
        others = [config.peers[n - 1] for n in range(1, len(config.peers) + 1) if n != config.node_id]
        # The other members' Raft addresses. Membership changes move them (raftps member
        # add/remove); tick() keeps the data plane and the majority in step.
        self._members: frozenset[str] = frozenset(others)
        self.peers = Peers([offset_address(a, config.data_offset) for a in sorted(others)], config.secret)
        self.data_server = DataPlaneServer(*config.bind(config.data_offset), config.secret,
                                           self.payloads, config.limits,
                                           snapshot_file=snapshot_file.path(config.data_dir))
        self._missing: str | None = None          # the payload the next entry waits for
        self._missing_index = 0
        self._missing_event = threading.Event()
        self.fetched = [0, 0]                     # payloads, bytes received from peers' get/get_range
        self._snapshot_index = 0                  # index of the newest snapshot we wrote or loaded
        self._collected_through = 0
        self._to_collect: queue.SimpleQueue[int] = queue.SimpleQueue()   # snapshot-covered indices (_collect_loop)
        self._last_housekeeping = self._budget_compacted = time.monotonic()
        self._budget_snapshot = -1                # snapshot index when the payload budget last asked for one
        self._stopped = False
        if config.read_mode not in READ_MODES:
            raise ValueError(f"read_mode must be one of {', '.join(READ_MODES)}, not {config.read_mode!r}")
        self.log: ReplicatedLog | None = None     # the log may call tick() before its constructor returns
        self.log = log_factory(RaftSettings(
            address=config.raft_address, others=sorted(others), data_dir=config.data_dir,
            secret=config.secret, bind=":".join(map(str, config.bind(0))), heartbeat=config.heartbeat,
            election_timeout=config.election_timeout, leader_fallback=config.leader_fallback,
            compaction_entries=config.compaction_entries, read_confirm=config.read_confirm,
            read_lease=config.read_mode == "lease",
            durability=config.durability, storage=self.storage), self)
        self.group_commit = GroupCommit(self.log, in_flight=config.entries_in_flight)
        threading.Thread(target=self._fetch_loop, name="payload-fetch", daemon=True).start()
        threading.Thread(target=self._collect_loop, name="payload-collect", daemon=True).start()
        if config.preferred_leader not in (None, config.raft_address):
            threading.Thread(target=self._hand_over_loop, name="leader-balance", daemon=True).start()

    # ---- the Applier: called by the log's thread, one at a time --------------------------------

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
        with self.lock:
            results = [self.machine.apply(self.machine.version + 1, c) for c, _ in commands]
            self.applied.notify_all()
        self.instruments.apply_seconds.observe(time.perf_counter() - started)
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
                    self._wait_for_payload(pid, index)
                    raise NotReady(pid)
                command["tensors"] = tensors
            elif "inline" in command:
                command["tensors"] = codec.decode(command.pop("inline"), self.config.limits)["tensors"]
        except NotReady:
            raise
        except Exception as exc:    # same bytes on every replica, so the same error everywhere
            return {"op": "invalid", "reason": f"undecodable entry: {exc}"}, None
        return command, pid

    def save_snapshot(self, path: str, meta: SnapshotMeta) -> None:
        # In the log's thread: no apply runs until the frame is written, so nothing is frozen.
        # Durable: the log fsyncs it, renames it into place and fsyncs the directory.
        snapshot_file.write(path, meta, self.machine.snapshot(share=False), self.storage)

    def snapshot_saved(self, meta: SnapshotMeta) -> None:
        # The file is in place: tick() may now collect the payloads it covers (not before: a
        # failed rename or fsync would leave them needed by the older snapshot and the journal).
        self._snapshot_index = meta.index
        self.instruments.snapshots.labels("write").inc()

    def load_snapshot(self, path: str) -> SnapshotMeta:
        meta, machine = snapshot_file.read(path)
        with self.lock:
            self.machine.restore(machine)
            self.applied.notify_all()
        self._snapshot_index = meta.index
        self.instruments.snapshots.labels("load").inc()
        return meta

    def tick(self) -> None:
        if self.log is None:
            return
        leader = self.log.leader()
        if leader is not None and leader != self._leader_seen:
            self._leader_seen = leader
            self.instruments.leader_changes.inc()
        members = frozenset(self.log.others())
        if members != self._members:
            log.warning("membership changed: other members %s (were %s)", sorted(members), sorted(self._members))
            self._members = members
            self.peers.set_addresses([offset_address(a, self.config.data_offset) for a in sorted(members)])
        # The log renamed the snapshot into place right after save_snapshot returned (durable:
        # fsynced, with its directory), so the payloads it covers are no longer needed to
        # restart. Keep the two newest entries' payloads: pysyncobj keeps those two entries in
        # its log and may still send them to a peer.
        if self._snapshot_index - 2 > self._collected_through:
            self._collected_through = self._snapshot_index - 2
            # not in the log's thread: removing the few hundred files of a snapshot's worth of
            # 1 MiB payloads took 0.6 s there, a stall of every commit on every node at once
            self._to_collect.put(self._collected_through)
        now = time.monotonic()
        # Every second once the last one's snapshot is written (else every 5 s): checked every
        # 5 s, 4 MiB pushes at 100 MB/s overshot the budget by 500 MB, more than the spares
        # keep, and the rest was unlinked (durable: trimmed in a journal commit that stalls every
        # fsync on the disk; p99 0.9-1.6 s).
        wait = 1.0 if self._snapshot_index > self._budget_snapshot else 5.0
        if now - self._budget_compacted > wait and self._payloads_call_for_snapshot():
            self._budget_compacted, self._budget_snapshot = now, self._snapshot_index
            self.log.compact()
        if now - self._last_housekeeping > 5.0:
            self._last_housekeeping = now
            self.payloads.collect_orphans(max_age=600.0, keep=[self._missing] if self._missing else [])

    def _payloads_call_for_snapshot(self) -> bool:
        """Whether the payload files waiting for a snapshot are worth one: more bytes than
        ``payload_snapshot_ratio`` times the store (model and optimizer state: what a snapshot
        writes), at least ``payload_snapshot_floor``, at most ``payload_budget``. A snapshot lets
        the files it covers be overwritten as spares: in tmpfs a new 4 MiB file costs page
        allocation and zeroing that a spare does not (4 MiB x4 on a 4 MiB model, bench.ab: node
        CPU per push 26.7 -> 23.0 ms against the flat 512 MiB budget). A snapshot costs
        writing the store once, so at the ratio 4 it adds at most a quarter to what the payloads
        wrote; a model of 128 MiB or more keeps the whole budget."""
        config, disk = self.config, self.payloads.disk_bytes
        if disk <= min(config.payload_budget, config.payload_snapshot_floor):
            return False                      # the common case, without summing the store
        return disk > min(config.payload_budget, max(config.payload_snapshot_floor,
                                                     config.payload_snapshot_ratio * self.machine.model_bytes()))

    def _collect_loop(self) -> None:
        while not self._stopped:
            through = self._to_collect.get()
            while not self._to_collect.empty():     # only the newest snapshot matters
                through = max(through, self._to_collect.get())
            try:
                self.payloads.collect(through)
            except Exception:          # housekeeping: a file it missed is collected as an orphan later
                log.exception("payload collection failed")

    def _hand_over_loop(self, every: float = 5.0) -> None:
        """Leaders spread over the nodes: pysyncobj elects whoever times out first, so without
        this one node may lead several groups and carry their traffic. A leader that is not this
        group's preferred member hands over (TimeoutNow) once that member is connected and has
        the whole log (pysyncobj refuses otherwise); checked every few seconds, so a flapping
        node cannot make leadership move often."""
        preferred = self.config.preferred_leader
        while not self._stopped:
            time.sleep(every)
            if self._stopped or not self.log.is_leader() or not self.log.is_connected(preferred):
                continue
            status = self.log.status()
            if status.match.get(preferred) == status.commit:
                log.info("handing leadership to the preferred member %s", preferred)
                self.log.transfer_leadership(timeout=2.0, to=preferred)

    # ---- payloads an entry waits for --------------------------------------------------------

    def _wait_for_payload(self, pid: str, index: int) -> None:
        self._missing_index = index
        if self._missing != pid:
            self._missing = pid
            self._missing_event.set()

    def _fetch_loop(self) -> None:
        while not self._stopped:
            try:
                self._fetch_missing()
            except Exception:          # the fetcher must outlive any one bad reply
                log.exception("payload fetch failed")
                time.sleep(0.2)

    def _fetch_missing(self) -> None:
        failures = 0
        while not self._stopped:
            self._missing_event.wait(1.0)
            self._missing_event.clear()
            pid = self._missing
            if pid is None:
                failures = 0
                continue
            # The leader sends a payload to every peer before it proposes the entry, so a node
            # that was up is usually a few ms from having it, even when commits run several
            # entries ahead of its applies under concurrent pushes (asking a peer at once there
            # re-received 17-32% of all pushed bytes at 1 MiB x4). Only a node that missed
            # puts (down, cut off) gets past this wait; it asks for the next entries' payloads
            # too (a peer knows them by log index).
            if not self.payloads.wait(pid, PUT_GRACE) and self.log.commit_index - self._missing_index > 2:
                self._fetch_range(self._missing_index)
            if not self.payloads.has(pid):
                tensors = self.peers.fetch(pid)
                if tensors is None:
                    failures += 1
                    self.instruments.errors.labels("PayloadNotOnPeers").inc()
                    log.warning("payload %s of the next entry is on no reachable peer yet", pid)
                    # Peers delete a payload once their snapshot covers its entry, so when none has
                    # it, a peer's snapshot covers it: that committed state replaces the entry.
                    if failures >= 3:
                        found = self.peers.fetch_snapshot(self.log.applied_index + 1)
                        if found is not None:
                            self._install_peer_snapshot(*found)
                            failures = 0
                    time.sleep(0.2)
                    self._missing_event.set()
                    continue
                self.payloads.put(pid, tensors)
                self._count_fetched(tensors)
            if self._missing == pid:
                self._missing = None
            self.log.wake()

    def _install_peer_snapshot(self, meta: SnapshotMeta, machine: dict) -> None:
        """Jump the state machine to a peer's snapshot (in the log's thread). The Raft log is
        untouched; only entries the snapshot already covers are skipped."""
        def restore() -> None:
            with self.lock:
                self.machine.restore(machine)
                self.applied.notify_all()
            log.warning("installed a peer's snapshot at index %d (payload %s is gone everywhere)",
                        meta.index, self._missing)
            self._missing = None
        self.log.install(meta.index, restore)

    def _fetch_range(self, first: int) -> None:
        for pid, tensors in self.peers.fetch_range(first, first + 256).items():
            self._count_fetched(tensors)
            if not self.payloads.has(pid):
                self.payloads.put(pid, tensors)

    def _count_fetched(self, tensors: dict[str, np.ndarray]) -> None:
        self.fetched[0] += 1
        self.fetched[1] += sum(a.nbytes for a in tensors.values())

    # ---- what the client server asks --------------------------------------------------------

    @property
    def members(self) -> list[str]:
        """Raft addresses of every member, this node included."""
        return sorted([self.config.raft_address, *self._members])

    @property
    def majority(self) -> int:
        return (len(self._members) + 1) // 2 + 1

    def is_leader(self) -> bool:
        return self.log.is_leader()

    def leader_client_address(self) -> str | None:
        leader = self.log.leader()
        return None if leader is None else offset_address(leader, self.config.client_offset)

    def submit(self, command: dict, tensors: dict[str, np.ndarray] | None = None,
               on_applied: Callable[[dict], Any] | None = None, payload_name: str | None = None) -> Any:
        """Replicate one command and return the state machine's result (or ``on_applied``'s value,
        computed in the log's thread right after the entry is applied). Raises NotApplied.
        A payload is named ``payload_name`` (NAME-NUMBER), by default the write's client and seq."""
        started = time.perf_counter()
        deadline = time.monotonic() + self.config.request_timeout
        if tensors:
            size = sum(a.nbytes for a in tensors.values())
            if size <= self.config.inline_bytes:
                command["inline"] = codec.encode_bytes({"tensors": tensors})
            else:
                # One hash pass (BLAKE3) names the payload and is the digest every peer's frame tag
                # signs; the payload goes to the peers while this thread writes our own copy.
                ordered, digest, content = digest_of(tensors)
                pid = f"{payload_name or command['client'] + '-' + str(command['seq'])}-{content}"
                needed = self.majority - 1
                acks = self.peers.replicate(pid, ordered, needed, timeout=self.config.request_timeout, digest=digest,
                                            meanwhile=lambda: self.payloads.put(pid, ordered))
                if acks < needed:
                    raise NotApplied(f"payload reached {acks + 1} of {len(self._members) + 1} nodes, "
                                     f"a majority is {self.majority}", applied=False)
                command["payload"] = pid
        done = threading.Event()
        box: list = []

        def callback(result: Any, error: NotApplied | None) -> None:
            if error is None and on_applied is not None:
                result = on_applied(result)
            box.append((result, error))
            done.set()

        proposed = time.perf_counter()
        # a barrier's reader runs right after its apply: alone, or later writes would be in its state
        self.group_commit.propose(msgpack.packb(command, use_bin_type=True), callback, alone=command["op"] == "barrier")
        if not done.wait(max(0.0, deadline - time.monotonic())):
            raise NotApplied("no commit before the request timeout", applied=None)
        result, error = box[0]
        if error is not None:
            raise error
        now = time.perf_counter()
        self.instruments.commit_seconds.observe(now - proposed)
        if command["op"] != "barrier":       # reads commit barriers: their latency is in commit_seconds
            self.instruments.write_seconds.observe(now - started)
        return result

    def read(self, names: list[str] | None) -> tuple[dict, int]:
        with self.lock:
            return self.machine.read(names)

    def linearizable(self, fn: Callable[[TensorStore], Any]) -> Any:
        """Run ``fn(machine)`` in the log's thread at a state that includes every write that
        completed before this call began, and return its value: exactly the state at one version.
        ``fn`` must be quick (it runs between applies) and may raise RaftpsError. Raises NotApplied
        (the caller retries, possibly elsewhere) when this node cannot prove it may serve the read.

        read_mode "log": commit a barrier entry and run ``fn`` right after it is applied.
        read_mode "readindex" (Raft dissertation 6.4, no log entry) and "lease" (the same, most
        reads on the leader's lease): ReplicatedLog.read_index."""
        def run_now(_: Any = None) -> Any:
            try:
                return fn(self.machine)
            except RaftpsError as exc:
                return exc
            except Exception as exc:      # a bug: it must cost this read, not the log's thread
                log.exception("linearizable read failed")
                return Internal(f"internal error: {exc!r}")
        index = self.log.lease_read_index() if self.config.read_mode == "lease" else None
        if index is not None:
            with self.lock:
                # the log counts an entry applied after the machine applied it: here the machine
                # holds at least every entry through applied_index
                if self.log.applied_index >= index:
                    self._lease_reads += 1
                    out = run_now()
                    if isinstance(out, RaftpsError):
                        raise out
                    return out
        if self.config.read_mode == "log":
            out = self.submit({"op": "barrier"}, on_applied=run_now)
        else:
            out = self.log.read_index(run_now, self.config.request_timeout)
        if isinstance(out, RaftpsError):
            raise out
        return out

    def linearizable_read(self, names: list[str] | None) -> tuple[dict, int]:
        return self.linearizable(lambda m: m.read(names))

    def wait_version(self, version: int, timeout: float) -> bool:
        with self.applied:
            return self.applied.wait_for(lambda: self.machine.version >= version, timeout)

    def wait_step(self, step: int, timeout: float, group: str = "") -> int:
        with self.applied:
            if not self.applied.wait_for(lambda: self.machine.sync_step_applied(group) >= step, timeout):
                where = f" of group {group!r}" if group else ""
                raise StepTimeout(f"sync step {step}{where} not applied within {timeout:.1f} s "
                                  f"({self.machine.sync_count(group, step)} contribution(s) so far)")
            return self.machine.version

    def wait_ssp(self, group: str, worker: str, timeout: float) -> dict:
        """Block until ``worker`` may take its next SSP step (at most s clocks ahead of the slowest
        member of ``group``), it is no longer a member, or ``timeout`` passes. Never decides
        anything: on a timeout the caller gets the slowest members and may ask for an ssp_drop
        entry, which the state machine applies only if their clocks did not move."""
        from .machine import ssp_ahead

        def ready() -> bool:
            g = self.machine.ssp.get(group)
            return g is None or worker not in g["clocks"] or g["staleness"] is None \
                or ssp_ahead(g, worker) <= g["staleness"]
        with self.applied:
            ok = self.applied.wait_for(ready, timeout)
            g = self.machine.ssp_state(group) or {"staleness": None, "clocks": {}}
            clocks = g["clocks"]
            slowest = min(clocks.values()) if clocks else 0
            return {"version": self.machine.version, "ready": ok, "member": worker in clocks,
                    "clock": clocks.get(worker), "min_clock": slowest,
                    "slowest": [[w, c] for w, c in clocks.items() if c == slowest and w != worker]}

    def stats(self) -> dict:
        with self.lock:
            m = self.machine
            return {"pushes": m.stats["pushes"], "rejected": m.stats["rejected"],
                    "duplicates": m.stats["duplicates"], "staleness": m.staleness_histogram(),
                    "sync_applied": m.sync_applied, "version": m.version, "sessions": len(m.sessions)}

    def metrics_view(self) -> dict:
        """What /metrics shows, cheap enough for every scrape: no digest (it hashes the store)."""
        raft = self.log.status()
        with self.lock:
            m = self.machine
            view = {"version": m.version, "tensors": len(m.tensors), "sessions": len(m.sessions),
                    "model_bytes": m.model_bytes(), "pushes": m.stats["pushes"], "rejected": m.stats["rejected"],
                    "duplicates": m.stats["duplicates"], "staleness": m.staleness_histogram()}
        return {**view, "role": raft.role, "term": raft.term, "commit": raft.commit, "applied": raft.applied,
                "log_len": raft.log_len, "snapshot_index": self._snapshot_index,
                "has_quorum": 1 if raft.has_quorum else 0, "match": raft.match, "connected": raft.connected,
                "read_rounds": raft.read_rounds, "lease_reads": raft.lease_reads + self._lease_reads,
                "votes_withheld": raft.votes_withheld}

    def status(self, digest: bool = True) -> dict:
        """This node's row of ``raftps status``. ``digest=False`` skips hashing the store (a poller
        such as ``raftps top`` would otherwise hash it at every new version)."""
        raft = self.log.status()
        with self.lock:
            version, model_bytes = self.machine.version, self.machine.model_bytes()
            digest = self.machine.digest() if digest else None
            staleness = self.machine.staleness_histogram()
            pushes = self.machine.stats["pushes"]
        return {
            "node": self.config.cluster_node or self.config.node_id,
            "address": self.config.address(self.config.node_id, self.config.client_offset),
            "role": raft.role,
            "term": raft.term,
            "applied": raft.applied,
            "commit": raft.commit,
            "version": version,
            "digest": digest,
            "leader": None if raft.leader is None else offset_address(raft.leader, self.config.client_offset),
            "log_len": raft.log_len,
            "snapshot_index": self._snapshot_index,
            "model_bytes": model_bytes,
            "payload_disk_bytes": self.payloads.disk_bytes,
            "payloads_in_memory": self.payloads.in_memory,
            "payload_spare_bytes": self.payloads.spare_bytes_held,
            "missing_payload": self._missing,
            "fetched_payloads": self.fetched[0],      # received from peers' get/get_range, not pushed
            "fetched_bytes": self.fetched[1],
            "staleness": staleness,
            "pushes": pushes,                         # applied by the state machine (replicated)
            "members": self.members,                  # Raft addresses, as this node knows them
            "metrics": self.metrics_address,          # host:port of this node's /metrics, or None
            "pid": os.getpid(),
            "read_mode": self.config.read_mode,       # linearizable reads: readindex or log
            "read_rounds": raft.read_rounds,          # ReadIndex confirmation rounds completed
            "lease_reads": raft.lease_reads + self._lease_reads,   # reads served on the leader's lease
            "votes_withheld": raft.votes_withheld,    # vote requests refused under a lease promise
            "entries_proposed": self.group_commit.entries,   # log entries this node proposed as leader ...
            "writes_proposed": self.group_commit.writes,     # ... carrying this many writes (group commit)
        }

    # ---- membership (raftps member ...) ----------------------------------------------------

    def change_members(self, action: str, address: str, timeout: float = 10.0) -> dict:
        """Add or remove one member (Raft single-server changes: the change is a log entry, in
        force from the moment it is appended). On the leader only. Idempotent: adding a member
        or removing a non-member changes nothing. The leader cannot remove itself: it hands
        leadership to a caught-up follower and raises NotApplied, so the client retries with the
        new leader."""
        if action == "add" and (address == self.config.raft_address or address in self._members) or \
                action == "remove" and address != self.config.raft_address and address not in self._members:
            return {"changed": False, "members": self.members}
        if action == "remove" and address == self.config.raft_address:
            if not self._members:
                raise InvalidRequest(f"{address} is the only member: a cluster cannot remove its last node")
            self.log.transfer_leadership(timeout)
            raise NotApplied(f"{address} is the leader: leadership handed to another member; retry there", applied=False)
        done, box = threading.Event(), []
        self.log.change_members(action, address, lambda ok, why: box.append((ok, why)) or done.set())
        if not done.wait(timeout):
            raise NotApplied(f"membership change not committed within {timeout:.0f} s", applied=None)
        ok, why = box[0]
        if not ok:
            raise NotApplied(f"membership change refused by Raft ({why}): another change may be "
                             "under way; retry", applied=False)
        return {"changed": True, "members": self.members}

    def is_connected(self, address: str) -> bool:
        return self.log.is_connected(address)

    def tick_thread_alive(self) -> bool:
        return self.log.alive()

    def stop(self, snapshot_timeout: float = 30.0) -> None:
        """Stop gracefully: first a snapshot, so the data dir alone restores this node."""
        target = self.log.applied_index
        if self._snapshot_index < target - 1:
            self.log.compact()
            deadline = time.monotonic() + snapshot_timeout
            while self._snapshot_index < target - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        self._stopped = True
        self.group_commit.stop()
        self._missing_event.set()
        self.data_server.close()
        self.peers.close()
        self.log.stop()
        self.payloads.drop_spares()
