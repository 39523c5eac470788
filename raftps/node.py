"""A raftps node's Raft side: pysyncobj orders small entries; tensor bytes go by the data plane.

A write reaches the leader with its tensors. The leader writes the payload to its own
PayloadStore, streams it to every peer's data plane, and once a majority (itself included)
holds it, proposes a small entry naming the payload to Raft. Every node applies committed
entries in log order through ``TensorStore.apply`` in pysyncobj's tick thread. A node that must
apply an entry whose payload it lacks (it was down when the payload went out) does not block
that thread: our ``_SyncObj__applyLogEntries`` stops before the entry, a fetcher thread gets the
payload from a peer, and the next tick goes on. So heartbeats never wait on the network.

Snapshots use pysyncobj's serializer hooks with our codec (raw array bytes, no pickle, no gzip).
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
from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated
from pysyncobj.node import TCPNode

from . import codec, stored_zlib
from .dataplane import DataPlaneServer, Peers
from .errors import Internal, InvalidRequest, RaftpsError, StepTimeout
from .machine import TensorStore
from .metrics import Instruments
from .payloads import PayloadStore, payload_id
from .pysyncobj_fixes import install as install_pysyncobj_fixes
from .pysyncobj_fixes import install_read_probes, limit_peer_reads, limit_unknown_connections, send_read_probe

log = logging.getLogger("raftps.node")
ROLES = {0: "follower", 1: "candidate", 2: "leader"}
# How long an applier waits for a payload the leader is still sending before asking a peer.
PUT_GRACE = 0.2
# Outcomes after which the entry certainly was not applied; anything else is "unknown".
NOT_APPLIED = {FAIL_REASON.QUEUE_FULL, FAIL_REASON.MISSING_LEADER, FAIL_REASON.DISCARDED,
               FAIL_REASON.NOT_LEADER, FAIL_REASON.REQUEST_DENIED}


@dataclass
class NodeConfig:
    node_id: int                              # 1..N, position in `peers`
    peers: list[str]                          # every node's Raft address host:port, in node order
    data_dir: str
    secret: bytes
    client_offset: int = 100                  # client port = Raft port + client_offset
    data_offset: int = 200                    # data-plane port = Raft port + data_offset
    metrics_offset: int = 300                 # /metrics port = Raft port + metrics_offset ...
    metrics_port: int | None = None           # ... unless given here; 0: no metrics server
    bind_host: str | None = None              # default: the host of this node's Raft address
    payload_dir: str | None = None            # default: default_payload_dir(data_dir)
    # Payloads up to this size travel inside the entry. Above a few KiB pysyncobj's per-follower
    # pickle + zlib + Fernet in the tick thread costs more than a data-plane round trip
    # (64 KiB inline: 41 pushes/s with 4 clients, the leader's tick 66% in TcpConnection.send).
    inline_bytes: int = 8 << 10
    payload_budget: int = 512 << 20           # payload bytes on disk that force a snapshot
    compaction_entries: int = 2000
    election_timeout: tuple[float, float] = (0.75, 1.5)   # leader SIGKILL to next push: median 1.02 s, max 1.26 s (8 kills); no spurious election under 16 MiB x4 adam load
    heartbeat: float = 0.1
    leader_fallback: float = 1.875            # a leader without a majority steps down after this (2.5x election)
    request_timeout: float = 3.0              # one write's wait for replication and commit
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
    # Linearizable reads: "readindex" (Raft ReadIndex, no log entry: see RaftNode.linearizable) or
    # "log" (a barrier entry through the log, the way every read went before).
    read_mode: str = "readindex"
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
        if not os.path.isdir(owner):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


class PayloadMissing(Exception):
    """Raised inside an apply whose payload is not here yet; never escapes our applier."""


class Outcome(Exception):
    """A write that did not complete: ``applied`` is False (certainly not) or None (unknown)."""

    def __init__(self, message: str, applied: bool | None):
        super().__init__(message)
        self.applied = applied


class _Read:
    """One ReadIndex read: ``run`` is called in the tick thread once the read may be served."""
    __slots__ = ("run", "done", "result", "error", "cancelled")

    def __init__(self, run: Callable[[], Any]):
        self.run = run
        self.done = threading.Event()
        self.result: Any = None
        self.error: str | None = None
        self.cancelled = False

    def finish(self, result: Any = None, error: str | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class RaftNode(SyncObj):
    def __init__(self, config: NodeConfig):
        self.config = config
        self.instruments = Instruments()
        self.metrics_address: str | None = None   # host:port of /metrics once it is served
        self._leader_seen: Any = None
        os.makedirs(config.data_dir, exist_ok=True)
        self.machine = TensorStore()
        self.lock = threading.Lock()              # guards machine against readers in other threads
        self.applied = threading.Condition(self.lock)
        sweep_abandoned_payload_dirs()
        self.payloads = PayloadStore(config.payload_dir or default_payload_dir(config.data_dir),
                                     owner=os.path.abspath(config.data_dir))
        others = [config.peers[n - 1] for n in range(1, len(config.peers) + 1) if n != config.node_id]
        # The other members' Raft addresses. pysyncobj's dynamic membership changes them (raftps
        # member add/remove); _watch_members keeps the data plane and the majority in step.
        self._members: frozenset[str] = frozenset(others)
        self._tick_jobs: queue.SimpleQueue[Callable[[], bool]] = queue.SimpleQueue()
        self.peers = Peers([offset_address(a, config.data_offset) for a in sorted(others)], config.secret)
        self.data_server = DataPlaneServer(*config.bind(config.data_offset), config.secret,
                                           self.payloads, config.limits,
                                           snapshot_file=os.path.join(config.data_dir, "raft.snapshot"))
        self._missing: str | None = None
        self._missing_index = 0
        self._install: dict | None = None         # a peer's snapshot for the tick thread to install
        self._missing_event = threading.Event()
        self.fetched = [0, 0]                     # payloads, bytes received from peers' get/get_range
        self._snapshot_index = 0                  # index of the newest snapshot we wrote or loaded
        self._collected_through = 0
        self._last_housekeeping = time.monotonic()
        self._stopped = False
        if config.read_mode not in ("readindex", "log"):
            raise ValueError(f"read_mode must be 'readindex' or 'log', not {config.read_mode!r}")
        if not config.read_confirm:
            log.warning("UNSAFE: ReadIndex reads skip the leadership confirmation round (tests only)")
        self._reads: queue.SimpleQueue[_Read] = queue.SimpleQueue()   # new ReadIndex reads, any thread
        # Tick-thread state of ReadIndex (see _serve_reads).
        self._ri_term: int | None = None          # the term these rounds belong to (we lead it)
        self._ri_noop = 0                         # index of that term's first entry (pysyncobj's no-op)
        self._ri_round = 0                        # last confirmation round sent (never reset)
        self._ri_acks: dict[Any, int] = {}        # peer id -> highest round it acknowledged in _ri_term
        self._ri_early: list[_Read] = []          # reads waiting for this term's first commit
        self._ri_confirming: list[tuple[int, int, list[_Read]]] = []   # (round, read index, reads)
        self._ri_ready: list[tuple[int, list[_Read]]] = []             # (read index, reads)
        self.read_rounds = 0                      # confirmation rounds completed (status/metrics)
        threading.Thread(target=self._fetch_loop, name="payload-fetch", daemon=True).start()
        conf = SyncObjConf(
            password=config.secret.hex() if config.secret else None,   # None: `serve --insecure`, loopback only
            bindAddress=":".join(map(str, config.bind(0))),
            journalFile=os.path.join(config.data_dir, "raft.journal"),
            fullDumpFile=os.path.join(config.data_dir, "raft.snapshot"),
            dynamicMembershipChange=True,                  # raftps member add/remove/replace
            serializer=self._write_snapshot,
            deserializer=self._read_snapshot,
            appendEntriesUseBatch=False,                   # send at once: ~1 ms commits on loopback
            appendEntriesBatchSizeBytes=4 << 20,           # far above any entry: avoids the chunk-path bug
            appendEntriesPeriod=config.heartbeat,
            raftMinTimeout=config.election_timeout[0],
            raftMaxTimeout=config.election_timeout[1],
            connectionTimeout=max(4.0, 2 * config.election_timeout[1]),
            connectionRetryTime=1.0,
            leaderFallbackTimeout=config.leader_fallback,
            logCompactionMinEntries=config.compaction_entries,
            logCompactionBatchSize=1 << 20,
            sendBufferSize=1 << 20,
            recvBufferSize=1 << 20,
            commandsQueueSize=10_000,
        )
        stored_zlib.install()                              # before SyncObj opens any peer connection
        limit_peer_reads()                                 # no 2 GiB buffers for strangers (pysyncobj_fixes)
        super().__init__(config.raft_address, sorted(others), conf)
        install_pysyncobj_fixes(self)
        install_read_probes(self, self._on_read_ack)
        limit_unknown_connections(self)
        self.addOnTickCallback(self._housekeeping)
        self.addOnTickCallback(self._commit_alone)
        self.addOnTickCallback(self._watch_leader)
        self.addOnTickCallback(self._watch_members)
        self.addOnTickCallback(self._run_tick_jobs)
        self.addOnTickCallback(self._serve_reads)

    # ---- the replicated entry and our applier ----------------------------------------------

    @replicated
    def _entry(self, entry: bytes) -> dict:
        index = self.raftLastApplied + 1
        pid = None
        try:
            command = msgpack.unpackb(entry, raw=False)
            pid = command.pop("payload", None)
            if pid is not None:
                tensors = self.payloads.get(pid)
                if tensors is None:
                    raise PayloadMissing(pid)
                command["tensors"] = tensors
            elif "inline" in command:
                command["tensors"] = codec.decode(command.pop("inline"), self.config.limits)["tensors"]
        except PayloadMissing:
            raise
        except Exception as exc:    # same bytes on every replica, so the same error everywhere
            command = {"op": "invalid", "reason": f"undecodable entry: {exc}"}
        started = time.perf_counter()
        with self.lock:
            result = self.machine.apply(index, command)
            self.applied.notify_all()
        self.instruments.apply_seconds.observe(time.perf_counter() - started)
        if pid is not None:
            self.payloads.applied(pid, index)
        return result

    def _SyncObj__applyLogEntries(self) -> bool:
        """pysyncobj's apply loop, except that an entry whose payload is missing ends the loop
        without being consumed (pysyncobj's own loop would drop its callbacks and retry it from
        inside the tick, never reading the socket that brings the heartbeats)."""
        if self._install is not None:
            self._install_peer_snapshot()
        commit = self._SyncObj__raftCommitIndex
        if commit <= self._SyncObj__raftLastApplied:
            return False
        waiting = self._SyncObj__commandsWaitingCommit
        for command, index, term in self._SyncObj__getEntries(self._SyncObj__raftLastApplied + 1,
                                                               commit - self._SyncObj__raftLastApplied):
            try:
                result = self._SyncObj__doApplyCommand(command)
            except PayloadMissing as missing:
                self._missing_index = index
                if self._missing != str(missing):
                    self._missing = str(missing)
                    self._missing_event.set()
                break
            self._SyncObj__raftLastApplied += 1
            for subscriber_term, callback in waiting.pop(index, []):
                callback(*((result, FAIL_REASON.SUCCESS) if subscriber_term == term else (None, FAIL_REASON.DISCARDED)))
        return not self._SyncObj__conf.appendEntriesUseBatch

    def _install_peer_snapshot(self) -> None:
        """Jump the state machine to a peer's snapshot (tick thread). Our Raft log is untouched;
        only entries the snapshot already covers are skipped."""
        snap, self._install = self._install, None
        last = snap["raft"][0][1]
        if last <= self._SyncObj__raftLastApplied:
            return
        with self.lock:
            self.machine.restore(snap["machine"])
            self.applied.notify_all()
        log.warning("installed a peer's snapshot at index %d (was stuck at %d: payload %s is gone everywhere)",
                    last, self._SyncObj__raftLastApplied, self._missing)
        self._SyncObj__raftLastApplied = last
        self._missing = None

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
            if not self.payloads.wait(pid, PUT_GRACE) and self._SyncObj__raftCommitIndex - self._missing_index > 2:
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
                        snap = self.peers.fetch_snapshot(self.raftLastApplied + 1)
                        if snap is not None:
                            self._install = snap
                            self._wake_tick()
                            failures = 0
                    time.sleep(0.2)
                    self._missing_event.set()
                    continue
                self.payloads.put(pid, tensors)
                self._count_fetched(tensors)
            if self._missing == pid:
                self._missing = None
            self._wake_tick()

    def _fetch_range(self, first: int) -> None:
        for pid, tensors in self.peers.fetch_range(first, first + 256).items():
            self._count_fetched(tensors)
            if not self.payloads.has(pid):
                self.payloads.put(pid, tensors)

    def _count_fetched(self, tensors: dict[str, np.ndarray]) -> None:
        self.fetched[0] += 1
        self.fetched[1] += sum(a.nbytes for a in tensors.values())

    def _commit_alone(self) -> None:
        """A one-node leader commits what this tick appended on the next tick, at once.

        pysyncobj's tick computes the commit index before it appends new commands, then sleeps
        in poll() until a message arrives or its 50 ms tick ends. With peers, their replies wake
        it; alone, every write and linearizable read waited >= 50 ms for nothing."""
        if (not self._SyncObj__otherNodes and self._isLeader()
                and self._SyncObj__getCurrentLogIndex() > self._SyncObj__raftCommitIndex):
            self._wake_tick()

    def _watch_members(self) -> None:
        members = frozenset(node.address for node in self._SyncObj__otherNodes)
        if members != self._members:
            log.warning("membership changed: other members %s (were %s)", sorted(members), sorted(self._members))
            self._members = members
            self.peers.set_addresses([offset_address(a, self.config.data_offset) for a in sorted(members)])

    def _run_tick_jobs(self) -> None:
        """Jobs that must run in the tick thread (pysyncobj is not thread-safe); a job returning
        False runs again on the next tick."""
        again = []
        while True:
            try:
                job = self._tick_jobs.get_nowait()
            except queue.Empty:
                break
            if not job():
                again.append(job)
        for job in again:
            self._tick_jobs.put(job)

    def _watch_leader(self) -> None:
        leader = self._getLeader()
        if leader is not None and leader != self._leader_seen:
            self._leader_seen = leader
            self.instruments.leader_changes.inc()

    def _wake_tick(self) -> None:
        notifier = getattr(self, "_SyncObj__pipeNotifier", None)
        if notifier is not None:
            notifier.notify()

    # ---- snapshots -----------------------------------------------------------------------

    def _write_snapshot(self, filename: str, raft_data: tuple) -> None:
        last, previous, cluster = raft_data
        with open(filename, "wb") as f:
            codec.write_frame(f, {"raft": [list(last), list(previous)],
                                  "cluster": sorted(node.address for node in cluster),
                                  # The tick thread (pysyncobj does not fork with our serializer):
                                  # no apply runs until the frame is written, so nothing is frozen.
                                  "machine": self.machine.snapshot(share=False)})
        self._snapshot_index = last[1]
        self.instruments.snapshots.labels("write").inc()

    def _read_snapshot(self, filename: str) -> tuple:
        # Limits from the file's size, not the client-facing ones: a store of more than 4096
        # arrays (1,366 Adam tensors) or 1 GiB would otherwise fail to load its own snapshot,
        # and pysyncobj, logging "failed to load full dump", would go on with an empty store.
        snap = codec.read_frame_file(filename)
        with self.lock:
            self.machine.restore(snap["machine"])
            self.applied.notify_all()
        last, previous = (tuple(e) for e in snap["raft"])
        self._snapshot_index = last[1]
        self.instruments.snapshots.labels("load").inc()
        # pysyncobj takes the membership from the snapshot; a seed without one (snapshot restore
        # without --peers) keeps the membership this node was started with.
        cluster = snap["cluster"] or [self.config.raft_address, *self._members]
        return last, previous, {TCPNode(address) for address in cluster}

    def _housekeeping(self) -> None:
        # pysyncobj renamed the snapshot into place right after _write_snapshot returned, so the
        # payloads it covers are no longer needed to restart. Keep the two newest entries' payloads:
        # pysyncobj keeps those two entries in its log and may still send them to a peer.
        if self._snapshot_index - 2 > self._collected_through:
            self._collected_through = self._snapshot_index - 2
            self.payloads.collect(self._collected_through)
        now = time.monotonic()
        if now - self._last_housekeeping > 5.0:
            self._last_housekeeping = now
            if self.payloads.disk_bytes > self.config.payload_budget:
                self.forceLogCompaction()
            self.payloads.collect_orphans(max_age=600.0, keep=[self._missing] if self._missing else [])

    # ---- what the client server asks --------------------------------------------------------

    @property
    def members(self) -> list[str]:
        """Raft addresses of every member, this node included."""
        return sorted([self.config.raft_address, *self._members])

    @property
    def majority(self) -> int:
        return (len(self._members) + 1) // 2 + 1

    def is_leader(self) -> bool:
        return self._isLeader()

    def leader_client_address(self) -> str | None:
        leader = self._getLeader()
        if leader is None:
            return None
        return offset_address(leader.address, self.config.client_offset)

    def submit(self, command: dict, tensors: dict[str, np.ndarray] | None = None,
               on_applied: Callable[[dict], Any] | None = None) -> Any:
        """Replicate one command and return the state machine's result (or ``on_applied``'s value,
        computed in the tick thread right after the entry is applied). Raises Outcome."""
        started = time.perf_counter()
        deadline = time.monotonic() + self.config.request_timeout
        if tensors:
            size = sum(a.nbytes for a in tensors.values())
            if size <= self.config.inline_bytes:
                command["inline"] = codec.encode_bytes({"tensors": tensors})
            else:
                pid = payload_id(command["client"], command["seq"], tensors)
                self.payloads.put(pid, tensors)
                needed = self.majority - 1
                acks = self.peers.replicate(pid, tensors, needed, timeout=self.config.request_timeout)
                if acks < needed:
                    raise Outcome(f"payload reached {acks + 1} of {len(self._members) + 1} nodes, "
                                  f"a majority is {self.majority}", applied=False)
                command["payload"] = pid
        done = threading.Event()
        box: list = []

        def callback(result: Any, error: int) -> None:
            if error == FAIL_REASON.SUCCESS and on_applied is not None:
                result = on_applied(result)
            box.append((result, error))
            done.set()

        proposed = time.perf_counter()
        self._entry(msgpack.packb(command, use_bin_type=True), callback=callback)
        if not done.wait(max(0.0, deadline - time.monotonic())):
            raise Outcome("no commit before the request timeout", applied=None)
        result, error = box[0]
        if error != FAIL_REASON.SUCCESS:
            raise Outcome(f"raft reported failure code {error}", applied=False if error in NOT_APPLIED else None)
        now = time.perf_counter()
        self.instruments.commit_seconds.observe(now - proposed)
        if command["op"] != "barrier":       # reads commit barriers: their latency is in commit_seconds
            self.instruments.write_seconds.observe(now - started)
        return result

    def read(self, names: list[str] | None) -> tuple[dict, int]:
        with self.lock:
            return self.machine.read(names)

    def linearizable(self, fn: Callable[[TensorStore], Any]) -> Any:
        """Run ``fn(machine)`` in the tick thread at a state that includes every write that
        completed before this call began, and return its value: exactly the state at one version.
        ``fn`` must be quick (it runs between applies) and may raise RaftpsError. Raises Outcome
        (the caller retries, possibly elsewhere) when this node cannot prove it may serve the read.

        read_mode "log": commit a barrier entry and run ``fn`` right after it is applied.
        read_mode "readindex" (Raft dissertation 6.4, no log entry): see _serve_reads."""
        def run_now(_: Any = None) -> Any:
            try:
                return fn(self.machine)
            except RaftpsError as exc:
                return exc
            except Exception as exc:      # a bug: it must cost this read, not the tick thread
                log.exception("linearizable read failed")
                return Internal(f"internal error: {exc!r}")
        if self.config.read_mode == "log":
            out = self.submit({"op": "barrier"}, on_applied=run_now)
        else:
            out = self._read_index(run_now)
        if isinstance(out, RaftpsError):
            raise out
        return out

    def _read_index(self, run: Callable[[], Any]) -> Any:
        read = _Read(run)
        self._reads.put(read)
        self._wake_tick()
        if not read.done.wait(self.config.request_timeout):
            read.cancelled = True            # the tick thread drops it; nothing was changed anywhere
            raise Outcome("leadership not confirmed by a majority before the request timeout", applied=False)
        if read.error is not None:
            raise Outcome(read.error, applied=False)
        return read.result

    # ReadIndex, in the tick thread (pysyncobj's state is only consistent there):
    # (1) the leader waits until an entry of its current term is committed: pysyncobj appends a
    #     no-op when it becomes leader (``__onBecomeLeader``) and commits only entries of the current
    #     term, so commitIndex >= that no-op's index means the commit index covers every entry any
    #     earlier leader committed;
    # (2) the read index is the commit index, read after the request arrived;
    # (3) one probe per peer carries a round number sent after (2); a peer answers with its current
    #     term. A round is confirmed when the leader plus peers that answered that round or a later
    #     one (sent later still) with our term make a majority: at those moments no majority node
    #     had moved past our term, so no later leader existed yet, and every write acknowledged
    #     before the read began is at or below the read index. All reads that arrived before a
    #     round was sent share it;
    # (4) once lastApplied >= the read index, fn runs, still leader of the same term.
    # No clocks, no leases: a paused or partitioned ex-leader gets no majority of acks in its term.

    def _fail_reads(self, reads: list["_Read"], why: str) -> None:
        for read in reads:
            read.finish(error=why)

    def _serve_reads(self) -> None:
        leader = self._isLeader()
        term = self.raftCurrentTerm
        if not leader or term != self._ri_term:
            why = "not the leader any more" if not leader else "a new term began before the read was served"
            self._fail_reads(self._ri_early, why)
            for _, _, reads in self._ri_confirming:
                self._fail_reads(reads, why)
            for _, reads in self._ri_ready:
                self._fail_reads(reads, why)
            self._ri_early, self._ri_confirming, self._ri_ready = [], [], []
            self._ri_acks = {}
            self._ri_term = term if leader else None
            # __onBecomeLeader set it in this thread before this term could be seen as ours
            noop = self._SyncObj__noopIDx
            self._ri_noop = (noop if noop is not None else 1 << 62) if leader else 0
        new = self._ri_early
        self._ri_early = []
        while True:
            try:
                read = self._reads.get_nowait()
            except queue.Empty:
                break
            if not read.cancelled:
                new.append(read)
        if not leader:
            leader_at = self.leader_client_address()
            self._fail_reads(new, f"not the leader; leader is {leader_at or 'unknown'}")
            return
        if new:
            commit = self._SyncObj__raftCommitIndex
            if commit < self._ri_noop:                               # step (1)
                self._ri_early = [r for r in new if not r.cancelled]
            else:
                self._ri_round += 1                                  # steps (2) and (3)
                self._ri_confirming.append((self._ri_round, commit, new))
                if self.config.read_confirm:
                    for peer in self._SyncObj__otherNodes:
                        send_read_probe(self, peer, term, self._ri_round)
        # rounds whose every read gave up (a cut-off leader) need not be kept: later ones count alone
        while self._ri_confirming and all(r.cancelled for r in self._ri_confirming[0][2]):
            self._ri_confirming.pop(0)
        self._confirm_rounds()
        self._run_ready_reads()

    def _on_read_ack(self, peer: Any, term: int, round_: int) -> None:
        """A peer answered a probe (tick thread, from pysyncobj_fixes.install_read_probes)."""
        if term != self._ri_term or term != self.raftCurrentTerm or not self._isLeader():
            return
        key = getattr(peer, "id", peer)
        if round_ > self._ri_acks.get(key, 0):
            self._ri_acks[key] = round_
        self._confirm_rounds()
        self._run_ready_reads()

    def _confirm_rounds(self) -> None:
        if not self._ri_confirming:
            return
        peers = self._SyncObj__otherNodes
        majority = (len(peers) + 1) // 2 + 1
        while self._ri_confirming:
            round_, index, reads = self._ri_confirming[0]
            if self.config.read_confirm:
                votes = 1 + sum(1 for p in peers if self._ri_acks.get(getattr(p, "id", p), 0) >= round_)
                if votes < majority:
                    break                    # later rounds were sent later: none confirmed before this
            self._ri_confirming.pop(0)
            self.read_rounds += 1
            self._ri_ready.append((index, reads))

    def _run_ready_reads(self) -> None:
        applied = self._SyncObj__raftLastApplied
        while self._ri_ready and self._ri_ready[0][0] <= applied:   # step (4)
            _, reads = self._ri_ready.pop(0)
            for read in reads:
                if not read.cancelled:
                    read.finish(result=read.run())

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

    def _raft_status(self) -> dict:
        # pysyncobj builds it from the tick thread's dicts; a rare concurrent resize is retried
        for _ in range(3):
            try:
                return self.getStatus()
            except RuntimeError:
                continue
        return self.getStatus()

    def metrics_view(self) -> dict:
        """What /metrics shows, cheap enough for every scrape: no digest (it hashes the store)."""
        raft = self._raft_status()
        with self.lock:
            m = self.machine
            view = {"version": m.version, "tensors": len(m.tensors), "sessions": len(m.sessions),
                    "model_bytes": m.model_bytes(), "pushes": m.stats["pushes"], "rejected": m.stats["rejected"],
                    "duplicates": m.stats["duplicates"], "staleness": m.staleness_histogram()}
        prefix, link = "match_idx_server_", "partner_node_status_server_"
        return {**view, "role": ROLES.get(raft["state"], str(raft["state"])), "term": raft["raft_term"],
                "commit": raft["commit_idx"], "applied": raft["last_applied"], "log_len": raft["log_len"],
                "snapshot_index": self._snapshot_index,
                "has_quorum": 1 if raft["has_quorum"] else 0,
                "match": {k[len(prefix):]: v for k, v in raft.items() if k.startswith(prefix)},
                "connected": {k[len(link):]: 1 if v == 2 else 0 for k, v in raft.items() if k.startswith(link)}}

    def status(self, digest: bool = True) -> dict:
        """This node's row of ``raftps status``. ``digest=False`` skips hashing the store (a poller
        such as ``raftps top`` would otherwise hash it at every new version)."""
        raft = self._raft_status()
        with self.lock:
            version, model_bytes = self.machine.version, self.machine.model_bytes()
            digest = self.machine.digest() if digest else None
            staleness = self.machine.staleness_histogram()
            pushes = self.machine.stats["pushes"]
        return {
            "node": self.config.node_id,
            "address": self.config.address(self.config.node_id, self.config.client_offset),
            "role": ROLES.get(raft["state"], str(raft["state"])),
            "term": raft["raft_term"],
            "applied": raft["last_applied"],
            "commit": raft["commit_idx"],
            "version": version,
            "digest": digest,
            "leader": self.leader_client_address(),
            "log_len": raft["log_len"],
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
            "read_rounds": self.read_rounds,          # ReadIndex confirmation rounds completed
        }

    # ---- membership (raftps member ...) ----------------------------------------------------

    def change_members(self, action: str, address: str, timeout: float = 10.0) -> dict:
        """Add or remove one member (Raft single-server changes, through pysyncobj's dynamic
        membership: the change is a log entry, in force from the moment it is appended). On
        the leader only. Idempotent: adding a member or removing a non-member changes nothing.
        The leader cannot remove itself: it hands leadership to a caught-up follower and raises
        Outcome, so the client retries with the new leader."""
        if action == "add" and (address == self.config.raft_address or address in self._members) or \
                action == "remove" and address != self.config.raft_address and address not in self._members:
            return {"changed": False, "members": self.members}
        if action == "remove" and address == self.config.raft_address:
            if not self._members:
                raise InvalidRequest(f"{address} is the only member: a cluster cannot remove its last node")
            self._transfer_leadership(timeout)
            raise Outcome(f"{address} is the leader: leadership handed to another member; retry there", applied=False)
        done, box = threading.Event(), []

        def callback(_result: Any, error: int) -> None:
            box.append(error)
            done.set()
        change = self.addNodeToCluster if action == "add" else self.removeNodeFromCluster
        self._tick_jobs.put(lambda: change(address, callback) or True)
        self._wake_tick()
        if not done.wait(timeout):
            raise Outcome(f"membership change not committed within {timeout:.0f} s", applied=None)
        if box[0] != FAIL_REASON.SUCCESS:
            # REQUEST_DENIED: an earlier change is not committed yet, or this leader's first entry is not
            raise Outcome(f"membership change refused by Raft (code {box[0]}): another change may be "
                          "under way; retry", applied=False)
        return {"changed": True, "members": self.members}

    def _transfer_leadership(self, timeout: float) -> None:
        """Ask pysyncobj (in the tick thread) to hand leadership to the most caught-up connected
        follower; it refuses while that follower's log is behind, so try on every tick."""
        deadline = time.monotonic() + timeout
        sent = threading.Event()

        def attempt() -> bool:
            if sent.is_set() or time.monotonic() > deadline or not self._isLeader():
                sent.set()
                return True
            self.transferLeadership(None, lambda _r, error: error == FAIL_REASON.SUCCESS and sent.set())
            return sent.is_set()
        self._tick_jobs.put(attempt)
        self._wake_tick()
        sent.wait(timeout)
        end = time.monotonic() + min(timeout, 2 * self.config.election_timeout[1])
        while self._isLeader() and time.monotonic() < end:
            time.sleep(0.05)

    def is_connected(self, address: str) -> bool:
        return self.isNodeConnected(TCPNode(address))

    def stop(self, snapshot_timeout: float = 30.0) -> None:
        """Stop gracefully: first a snapshot, so the data dir alone restores this node."""
        target = self.raftLastApplied
        if self._snapshot_index < target - 1:
            self.forceLogCompaction()
            deadline = time.monotonic() + snapshot_timeout
            while self._snapshot_index < target - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        self._stopped = True
        self._missing_event.set()
        self.data_server.close()
        self.peers.close()
        self.destroy()
        self.payloads.drop_spares()
