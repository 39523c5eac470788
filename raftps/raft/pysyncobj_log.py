"""``SyncObjLog``: the ReplicatedLog on pysyncobj 0.3.17, the only module that drives pysyncobj.

pysyncobj orders our entries (opaque bytes) and calls the Applier in its tick thread. What we
change in pysyncobj lives here and in ``pysyncobj_fixes.py`` beside it:
* the apply loop stops before an entry whose Applier raises NotReady (pysyncobj's own loop would
  retry it from inside the tick, never reading the socket that brings the heartbeats);
* snapshots go through the Applier (pysyncobj's serializer hooks; no pickle, no fork);
* ReadIndex reads (Raft dissertation 6.4) with a confirmation round of our own probes, and
  leader leases on the same probes (a confirmed round lets reads skip the next rounds for a
  while, because every voter that confirmed it promised to withhold its vote that long), in
  ``read_index.py``;
* a one-member leader commits without waiting for its 50 ms tick;
* peer messages are signed with HMAC-SHA256 (peer_mac.py), not Fernet-encrypted.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated
from pysyncobj.node import TCPNode

from raftps.raft import (Applier, NotApplied, NotReady, RaftSettings, RaftStatus, ReplicatedLog, SnapshotMeta,
                         saved_hook, stored_zlib)
from raftps.raft.journal_hook import install_durable_journal, install_durable_snapshots
from raftps.raft.peer_mac import PeerMac
from raftps.raft.pysyncobj_fixes import install as install_fixes
from raftps.raft.pysyncobj_fixes import install_read_probes, limit_peer_reads, limit_unknown_connections
from raftps.raft.read_index import ReadIndex

log = logging.getLogger("raftps.raft")
ROLES = {0: "follower", 1: "candidate", 2: "leader"}
LEADER_LOG = "raft leader:"           # prefix of the line logged when a member becomes leader
# Outcomes after which the entry certainly was not applied; anything else is "unknown".
CERTAINLY_NOT = {FAIL_REASON.QUEUE_FULL, FAIL_REASON.MISSING_LEADER, FAIL_REASON.DISCARDED,
                 FAIL_REASON.NOT_LEADER, FAIL_REASON.REQUEST_DENIED}


class Core(SyncObj):
    """pysyncobj's SyncObj with our apply loop; everything else goes through SyncObjLog. The
    other modules of the adapter read pysyncobj's state through the narrow views below, in the
    tick thread (``read_index.py``), not through its name-mangled fields."""

    def __init__(self, applier: Applier, settings: RaftSettings, conf: SyncObjConf):
        self.applier = applier
        self.raft_address = settings.address
        self.installing: tuple[int, Callable[[], None]] | None = None
        # The tick thread starts inside SyncObj.__init__; it waits here until SyncObjLog has put
        # its pieces in place (the durable journal must be there before the first tick).
        self.ready = threading.Event()
        # Peer messages signed, not encrypted (peer_mac.py); no secret: `serve --insecure`, loopback only.
        self.peer_mac = PeerMac(settings.secret) if settings.secret else None
        # A learner is pysyncobj's read-only node (selfNode None): it dials every member, says
        # 'readonly' instead of its address, and the leader sends it the log and snapshots
        # without counting it (syncobj.py __onReadonlyNodeConnected, __sendAppendEntries).
        super().__init__(None if settings.learner else settings.address, sorted(settings.others), conf)
        # pysyncobj's tick thread ends once the thread that made the SyncObj has ended
        # (syncobj.py:587). A node starts a replica the hosts record gives it from whatever thread
        # read the record, a request's among them (hosting.refresh before a member change): the
        # replica stopped ticking when that request ended, and the node exited ("the raft tick
        # thread died"). The process's main thread instead: the tick thread lives as long as it.
        self._SyncObj__mainThread = threading.main_thread()

    # ---- pysyncobj's state, for the rest of the adapter (tick thread) -------------------------
    # Methods, not properties: SyncObj.__init__ reads every attribute of itself (dir + getattr)
    # to find the replicated methods, before all of its state exists.

    def is_leader(self) -> bool:
        return self._isLeader()

    def other_nodes(self) -> set:
        """pysyncobj's Node objects of every other member."""
        return self._SyncObj__otherNodes

    def noop_index(self) -> int | None:
        """The index of the no-op this leader appended when its term began (None: not a leader yet)."""
        return self._SyncObj__noopIDx

    @property
    def encryptor(self) -> PeerMac | None:
        """What pysyncobj's transport wraps peer messages with (its password's Fernet otherwise)."""
        return self.peer_mac

    def _onTick(self, timeToWait: float = 0.0) -> None:
        if not self.ready.is_set():
            self.ready.wait(10.0)
        super()._onTick(timeToWait)

    def _SyncObj__onBecomeLeader(self) -> None:
        SyncObj._SyncObj__onBecomeLeader(self)
        # One line per leadership, in this exact form: the power-cut tests read the nodes' logs
        # and check that no term ever had two leaders (Raft's election safety).
        log.warning("%s %s became leader of term %d", LEADER_LOG, self.raft_address, self.raftCurrentTerm)

    @replicated
    def _entry(self, entry: bytes) -> Any:
        return self.applier.apply(entry, self.raftLastApplied + 1)

    def _SyncObj__applyLogEntries(self) -> bool:
        """pysyncobj's apply loop, except that an entry the Applier is NotReady for ends the loop
        without being consumed."""
        if self.installing is not None:
            (index, restore), self.installing = self.installing, None
            if index > self._SyncObj__raftLastApplied:
                restore()
                self._SyncObj__raftLastApplied = index
        commit = self._SyncObj__raftCommitIndex
        if commit <= self._SyncObj__raftLastApplied:
            return False
        waiting = self._SyncObj__commandsWaitingCommit
        for command, index, term in self._SyncObj__getEntries(self._SyncObj__raftLastApplied + 1,
                                                               commit - self._SyncObj__raftLastApplied):
            try:
                result = self._SyncObj__doApplyCommand(command)
            except NotReady:
                break
            self._SyncObj__raftLastApplied += 1
            for subscriber_term, callback in waiting.pop(index, []):
                callback(*((result, FAIL_REASON.SUCCESS) if subscriber_term == term else (None, FAIL_REASON.DISCARDED)))
        return not self._SyncObj__conf.appendEntriesUseBatch


class SyncObjLog(ReplicatedLog):
    def __init__(self, settings: RaftSettings, applier: Applier):
        self.address = settings.address
        self.settings = settings
        self._applier = applier
        self._saving: SnapshotMeta | None = None  # the snapshot serialize() is writing
        self._jobs: queue.SimpleQueue[Callable[[], bool]] = queue.SimpleQueue()
        election = settings.election_timeout
        durability = settings.durability
        conf = SyncObjConf(
            password=None,          # peer messages are signed by PeerMac (below), not Fernet-encrypted
            bindAddress=settings.bind or settings.address,
            # durable: our DurableJournal is installed after __init__ (pysyncobj's own is never fsynced)
            journalFile=durability.plain_journal_file(settings.data_dir),
            fullDumpFile=f"{settings.data_dir}/raft.snapshot",
            dynamicMembershipChange=True,                  # raftps member add/remove/replace
            serializer=self._save_snapshot,
            deserializer=self._load_snapshot,
            appendEntriesUseBatch=False,                   # send at once, not at the next tick
            appendEntriesBatchSizeBytes=4 << 20,           # far above any entry: avoids the chunk-path bug
            appendEntriesPeriod=settings.heartbeat,
            raftMinTimeout=election[0],
            raftMaxTimeout=election[1],
            connectionTimeout=max(4.0, 2 * election[1]),
            connectionRetryTime=1.0,
            leaderFallbackTimeout=settings.leader_fallback,
            logCompactionMinEntries=settings.compaction_entries,
            logCompactionBatchSize=1 << 20,
            sendBufferSize=1 << 20,
            recvBufferSize=1 << 20,
            commandsQueueSize=10_000,
        )
        stored_zlib.install()                              # before SyncObj opens any peer connection
        limit_peer_reads()                                 # no 2 GiB buffers for strangers
        journal = durability.open_journal(settings.data_dir)
        self._core = core = Core(applier, settings, conf)
        if journal is not None:
            install_durable_journal(core, journal)
            install_durable_snapshots(core, durability.storage, fsync=durability.snapshot_fsync)
        self._tell_saved_snapshots(core)
        install_fixes(core)
        self._reads = ReadIndex(core, settings, self.leader, self.wake)
        install_read_probes(core, self._reads.on_ack, self._reads.promise)
        limit_unknown_connections(core)
        for every_tick in (self._commit_alone, self._run_jobs, self._reads.serve, applier.tick):
            core.addOnTickCallback(every_tick)
        core.ready.set()

    # ---- snapshots through the Applier ------------------------------------------------------

    def _save_snapshot(self, filename: str, raft_data: tuple) -> None:
        last, previous, cluster = raft_data
        # a learner's own snapshot: pysyncobj puts its selfNode, None, in the cluster; the members
        # are the others (the voter later started on these files is added by the log, as any)
        meta = SnapshotMeta(tuple(last), tuple(previous), sorted(node.address for node in cluster if node is not None))
        self._applier.save_snapshot(filename, meta)
        self._saving = meta                        # for _tell_saved_snapshots, once it is in place

    def _tell_saved_snapshots(self, core: Core) -> None:
        # pysyncobj says nothing once a snapshot file is in place; its serializer's state does
        # (pid -1: written and renamed; -2: failed). It never forks with a serializer callback,
        # so serialize() has finished the whole save when it returns.
        serializer = core._SyncObj__serializer
        serialize = serializer.serialize
        saved = saved_hook(self._applier)

        def serialize_then_tell(data: Any, serialize_id: int) -> None:
            self._saving = None
            serialize(data, serialize_id)
            meta, self._saving = self._saving, None
            if meta is not None and serializer._Serializer__pid == -1:
                saved(meta)

        serializer.serialize = serialize_then_tell

    def _load_snapshot(self, filename: str) -> tuple:
        meta = self._applier.load_snapshot(filename)
        # pysyncobj takes the membership from the snapshot; a seed without one (snapshot restore
        # without --peers) keeps the membership this member was started with.
        cluster = meta.members or [self.settings.address, *self.settings.others]
        return meta.last, meta.previous, {TCPNode(address) for address in cluster}

    # ---- ReplicatedLog ---------------------------------------------------------------------

    def propose(self, entry: bytes, done: Callable[[Any, NotApplied | None], None]) -> None:
        def callback(result: Any, error: int) -> None:
            if error == FAIL_REASON.SUCCESS:
                done(result, None)
            else:
                done(None, NotApplied(f"raft reported failure code {error}",
                                      applied=False if error in CERTAINLY_NOT else None))
        self._core._entry(entry, callback=callback)

    def is_leader(self) -> bool:
        return self._core.is_leader()

    def leader(self) -> str | None:
        node = self._core._getLeader()
        return None if node is None else node.address

    def others(self) -> list[str]:
        return sorted(node.address for node in self._core.other_nodes())

    @property
    def applied_index(self) -> int:
        return self._core.raftLastApplied

    @property
    def commit_index(self) -> int:
        return self._core.raftCommitIndex

    @property
    def term(self) -> int:
        return self._core.raftCurrentTerm

    def status(self) -> RaftStatus:
        raw = self._pysyncobj_status()
        match, link = "match_idx_server_", "partner_node_status_server_"
        leader = raw["leader"]
        return RaftStatus(role=ROLES.get(raw["state"], str(raw["state"])), term=raw["raft_term"],
                          commit=raw["commit_idx"], applied=raw["last_applied"], log_len=raw["log_len"],
                          has_quorum=bool(raw["has_quorum"]),
                          leader=None if leader is None else leader.address,
                          # members only: a learner connected to a leader has an entry too, by a
                          # counter (pysyncobj's read-only node id), not by an address
                          match={k[len(match):]: v for k, v in raw.items() if k.startswith(match) and ":" in k},
                          connected={k[len(link):]: 1 if v == 2 else 0 for k, v in raw.items() if k.startswith(link)},
                          read_rounds=self._reads.read_rounds, lease_reads=self._reads.lease_reads,
                          votes_withheld=self._reads.votes_withheld)

    def _pysyncobj_status(self) -> dict:
        # pysyncobj builds it from the tick thread's dicts; a rare concurrent resize is retried
        for _ in range(3):
            try:
                return self._core.getStatus()
            except RuntimeError:
                continue
        return self._core.getStatus()

    def compact(self) -> None:
        self._core.forceLogCompaction()

    def install(self, meta_index: int, restore: Callable[[], None]) -> None:
        self._core.installing = (meta_index, restore)
        self.wake()

    def wake(self) -> None:
        notifier = getattr(self._core, "_SyncObj__pipeNotifier", None)
        if notifier is not None:
            notifier.notify()

    def change_members(self, action: str, address: str, done: Callable[[bool, str], None]) -> None:
        def callback(_result: Any, error: int) -> None:
            # REQUEST_DENIED: an earlier change is not committed yet, or this leader's first entry is not
            done(error == FAIL_REASON.SUCCESS, f"code {error}")
        change = self._core.addNodeToCluster if action == "add" else self._core.removeNodeFromCluster
        self._in_tick(lambda: change(address, callback) or True)

    def transfer_leadership(self, timeout: float, to: str | None = None) -> None:
        """pysyncobj hands leadership (in the tick thread, Raft's TimeoutNow) to ``to`` or the most
        caught-up connected follower; it refuses while that follower's log is behind, so try on
        every tick."""
        deadline = time.monotonic() + timeout
        sent = threading.Event()

        def attempt() -> bool:
            if sent.is_set() or time.monotonic() > deadline or not self.is_leader():
                sent.set()
                return True
            self._reads.give_up_lease(timeout)
            self._core.transferLeadership(to, lambda _r, error: error == FAIL_REASON.SUCCESS and sent.set())
            return sent.is_set()
        self._in_tick(attempt)
        sent.wait(timeout)
        end = time.monotonic() + min(timeout, 2 * self.settings.election_timeout[1])
        while self.is_leader() and time.monotonic() < end:
            time.sleep(0.05)

    def _give_up_lease(self, seconds: float) -> None:
        """Tick thread: serve no read on the lease, take no new one and keep no promise for
        ``seconds``, so that the member leadership goes to can win the vote at once."""
        self._set_lease(0.0)
        self._lease_paused_until = lease_clock() + seconds
        self._promise.release()

    def is_connected(self, address: str) -> bool:
        return self._core.isNodeConnected(TCPNode(address))

    def alive(self) -> bool:
        return self._core.tick_thread_alive()

    def stop(self) -> None:
        self._reads.stop()
        self._core.destroy()

    # ---- tick-thread helpers ---------------------------------------------------------------

    def _in_tick(self, job: Callable[[], bool]) -> None:
        """Run ``job`` in the tick thread (pysyncobj is not thread-safe); False = again next tick."""
        self._jobs.put(job)
        self.wake()

    def _run_jobs(self) -> None:
        again = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if not job():
                again.append(job)
        for job in again:
            self._jobs.put(job)

    def _commit_alone(self) -> None:
        """A one-member leader commits what this tick appended on the next tick, at once.

        pysyncobj's tick computes the commit index before it appends new commands, then sleeps
        in poll() until a message arrives or its 50 ms tick ends. With peers, their replies wake
        it; alone, every write and linearizable read waited >= 50 ms for nothing."""
        core = self._core
        if (not core.other_nodes() and core.is_leader()
                and core._SyncObj__getCurrentLogIndex() > core.raftCommitIndex):
            self.wake()

    # ---- reads (raft/read_index.py) ----------------------------------------------------------

    def read_index(self, run: Callable[[], Any], timeout: float) -> Any:
        return self._reads.read(run, timeout)

    def lease_read_index(self) -> int | None:
        return self._reads.lease_read_index()
