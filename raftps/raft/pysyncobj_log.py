"""``SyncObjLog``: the ReplicatedLog on pysyncobj 0.3.17, the only module that drives pysyncobj.

pysyncobj orders our entries (opaque bytes) and calls the Applier in its tick thread. What we
change in pysyncobj lives here and in ``pysyncobj_fixes.py`` beside it:
* the apply loop stops before an entry whose Applier raises NotReady (pysyncobj's own loop would
  retry it from inside the tick, never reading the socket that brings the heartbeats);
* snapshots go through the Applier (pysyncobj's serializer hooks; no pickle, no fork);
* ReadIndex reads (Raft dissertation 6.4) with a confirmation round of our own probes, and
  leader leases on the same probes (a confirmed round lets reads skip the next rounds for a
  while, because every voter that confirmed it promised to withhold its vote that long);
* a one-member leader commits without waiting for its 50 ms tick;
* peer messages are signed with HMAC-SHA256 (peer_mac.py), not Fernet-encrypted.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Callable

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated
from pysyncobj.node import TCPNode

from . import (Applier, NotApplied, NotReady, RaftSettings, RaftStatus, ReplicatedLog, SnapshotMeta,
               saved_hook, stored_zlib)
from .journal import DurableJournal, import_file_journal
from .journal_hook import install_durable_journal, install_durable_snapshots
from .peer_mac import PeerMac
from .pysyncobj_fixes import install as install_fixes
from .storage import Storage, process_storage, unsafe_skip_fsync
from .pysyncobj_fixes import (LeasePromise, install_read_probes, lease_clock, limit_peer_reads,
                              limit_unknown_connections, send_read_probe)

log = logging.getLogger("raftps.raft")
JOURNAL_DIR = "raft.journal.d"        # the durable journal's directory in the data dir
ROLES = {0: "follower", 1: "candidate", 2: "leader"}
LEADER_LOG = "raft leader:"           # prefix of the line logged when a member becomes leader
# Outcomes after which the entry certainly was not applied; anything else is "unknown".
CERTAINLY_NOT = {FAIL_REASON.QUEUE_FULL, FAIL_REASON.MISSING_LEADER, FAIL_REASON.DISCARDED,
                 FAIL_REASON.NOT_LEADER, FAIL_REASON.REQUEST_DENIED}
# A lease lasts this fraction of the shortest promise it rests on: the clocks of the leader and of
# the voters may run this much apart in rate (not in offset: only durations are compared).
LEASE_CLOCK_DRIFT = 0.1


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


class _Core(SyncObj):
    """pysyncobj's SyncObj with our apply loop; everything else goes through SyncObjLog."""

    def __init__(self, applier: Applier, settings: RaftSettings, conf: SyncObjConf):
        self.applier = applier
        self.raft_address = settings.address
        self.installing: tuple[int, Callable[[], None]] | None = None
        # The tick thread starts inside SyncObj.__init__; it waits here until SyncObjLog has put
        # its pieces in place (the durable journal must be there before the first tick).
        self.ready = threading.Event()
        # Peer messages signed, not encrypted (peer_mac.py); no secret: `serve --insecure`, loopback only.
        self.peer_mac = PeerMac(settings.secret) if settings.secret else None
        super().__init__(settings.address, sorted(settings.others), conf)

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


def _open_journal(data_dir: str, durable: bool, storage: Storage | None) -> DurableJournal | None:
    """The durable journal (None: pysyncobj's own file journal). A data dir keeps its mode: one
    that ran durable refuses to start without it (its log is not in pysyncobj's file); one that
    did not is carried over into the durable journal, term and vote included."""
    plain, durable_dir = os.path.join(data_dir, "raft.journal"), os.path.join(data_dir, JOURNAL_DIR)
    if not durable:
        if os.path.isdir(durable_dir):
            raise ValueError(f"{data_dir} was run with --durability fsync: its Raft log is in {durable_dir}; "
                             "start it with --durability fsync")
        return None
    # RAFTPS_UNSAFE_JOURNAL_NO_FSYNC=1 (tests only): the durable journal's format, never fsynced, so
    # the power-cut test shows what it catches (tests/durability/test_power_cut.py)
    journal = DurableJournal(durable_dir, storage=storage or process_storage(), fsync=not unsafe_skip_fsync("journal"))
    if os.path.isfile(plain) and len(journal) == 0:
        copied = import_file_journal(plain, journal)
        os.replace(plain, plain + ".imported")
        log.warning("carried %d entries of %s into the durable journal", copied, plain)
    return journal


class SyncObjLog(ReplicatedLog):
    def __init__(self, settings: RaftSettings, applier: Applier):
        self.address = settings.address
        self.settings = settings
        self._applier = applier
        self._saving: SnapshotMeta | None = None  # the snapshot serialize() is writing
        self._jobs: queue.SimpleQueue[Callable[[], bool]] = queue.SimpleQueue()
        self._reads: queue.SimpleQueue[_Read] = queue.SimpleQueue()   # new ReadIndex reads, any thread
        # Tick-thread state of ReadIndex (see _serve_reads).
        self._ri_term: int | None = None          # the term these rounds belong to (we lead it)
        self._ri_noop = 0                         # index of that term's first entry (pysyncobj's no-op)
        self._ri_round = 0                        # last confirmation round sent (never reset)
        self._ri_acks: dict[Any, int] = {}        # peer id -> highest round it acknowledged in _ri_term
        self._ri_early: list[_Read] = []          # reads waiting for this term's first commit
        self._ri_confirming: list[tuple[int, int, list[_Read]]] = []   # (round, read index, reads)
        self._ri_ready: list[tuple[int, list[_Read]]] = []             # (read index, reads)
        self._ri_sent: dict[int, float] = {}      # round -> lease_clock() when it was sent
        self._ri_promise: dict[Any, float] = {}   # peer id -> seconds its latest ack promised (lease)
        self.read_rounds = 0                      # confirmation rounds completed (status/metrics)
        if not settings.read_confirm:
            log.warning("UNSAFE: ReadIndex reads skip the leadership confirmation round (tests only)")
        election = settings.election_timeout
        # Leases (see "ReadIndex" below). Every member keeps promises, whatever its own read mode.
        self._promise = LeasePromise(election[0])
        self._lease = settings.read_lease and settings.read_confirm
        self._lease_until = 0.0                   # lease_clock(): reads before this skip the round
        self._lease_state = (0, 0.0)              # (term, _lease_until) for other threads, one object
        self._lease_paused_until = 0.0            # lease_clock(): no lease during a leadership transfer
        self._last_round_at = 0.0                 # lease_clock() of the last round sent
        self.lease_reads = 0                      # reads served on the lease in the tick thread
        self._lease_seconds = None                # tests only: a lease that outlives every promise
        unsafe = os.environ.get("RAFTPS_UNSAFE_LEASE_SECONDS")
        if unsafe:
            self._lease_seconds = float(unsafe)
            log.warning("UNSAFE: leases last %s s, past the voters' promises (tests only)", unsafe)
        if settings.durability not in ("none", "fsync"):
            raise ValueError(f"durability must be 'none' or 'fsync', not {settings.durability!r}")
        durable = settings.durability == "fsync"
        conf = SyncObjConf(
            password=None,          # peer messages are signed by PeerMac (below), not Fernet-encrypted
            bindAddress=settings.bind or settings.address,
            # durable: our DurableJournal is installed after __init__ (pysyncobj's own is never fsynced)
            journalFile=None if durable else f"{settings.data_dir}/raft.journal",
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
        journal = _open_journal(settings.data_dir, durable, settings.storage)
        self._core = core = _Core(applier, settings, conf)
        if journal is not None:
            install_durable_journal(core, journal)
            install_durable_snapshots(core, journal.storage, fsync=not unsafe_skip_fsync("snapshot"))
        self._tell_saved_snapshots(core)
        install_fixes(core)
        install_read_probes(core, self._on_read_ack, self._promise)
        limit_unknown_connections(core)
        for every_tick in (self._commit_alone, self._run_jobs, self._serve_reads, applier.tick):
            core.addOnTickCallback(every_tick)
        core.ready.set()

    # ---- snapshots through the Applier ------------------------------------------------------

    def _save_snapshot(self, filename: str, raft_data: tuple) -> None:
        last, previous, cluster = raft_data
        meta = SnapshotMeta(tuple(last), tuple(previous), sorted(node.address for node in cluster))
        self._applier.save_snapshot(filename, meta)
        self._saving = meta                        # for _tell_saved_snapshots, once it is in place

    def _tell_saved_snapshots(self, core: _Core) -> None:
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
        return self._core._isLeader()

    def leader(self) -> str | None:
        node = self._core._getLeader()
        return None if node is None else node.address

    def others(self) -> list[str]:
        return sorted(node.address for node in self._core._SyncObj__otherNodes)

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
                          match={k[len(match):]: v for k, v in raw.items() if k.startswith(match)},
                          connected={k[len(link):]: 1 if v == 2 else 0 for k, v in raw.items() if k.startswith(link)},
                          read_rounds=self.read_rounds, lease_reads=self.lease_reads,
                          votes_withheld=self._promise.votes_withheld)

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
            self._give_up_lease(timeout)
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
        for read in self._drain_reads():
            read.finish(error="the node is stopping")
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
        if (not core._SyncObj__otherNodes and core._isLeader()
                and core._SyncObj__getCurrentLogIndex() > core._SyncObj__raftCommitIndex):
            self.wake()

    # ---- ReadIndex -------------------------------------------------------------------------
    # In the tick thread (pysyncobj's state is only consistent there):
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
    # (4) once lastApplied >= the read index, run() runs, still leader of the same term.
    # No clocks: a paused or partitioned ex-leader gets no majority of acks in its term.
    #
    # Leases (read mode "lease") add clocks, and skip step (3) for most reads. In lease mode every
    # probe asks for a promise and the leader sends a round at least every heartbeat, reads or
    # not. A voter that answers in our term promises to withhold its vote for its window W (its
    # minimum election timeout, pysyncobj_fixes.LeasePromise), counted from its answer, which
    # comes after the round was sent; the leader promises the same from the moment it sends.
    # When a round sent at t is confirmed by a majority that all promised, no other member can win
    # an election before t + W on the voters' clocks, so the leader holds a lease until
    # t + W * (1 - LEASE_CLOCK_DRIFT) on its own. A read that arrives inside the lease takes the
    # commit index as its read index at once (step 2) and waits only for step (4). Reads outside
    # it go through step (3), whose round renews the lease. The clock is CLOCK_BOOTTIME: a
    # suspended host's lease expires while it sleeps. A leadership transfer gives the lease up.

    def read_index(self, run: Callable[[], Any], timeout: float) -> Any:
        read = _Read(run)
        self._reads.put(read)
        self.wake()
        if not read.done.wait(timeout):
            read.cancelled = True            # the tick thread drops it; nothing was changed anywhere
            raise NotApplied("leadership not confirmed by a majority before the request timeout", applied=False)
        if read.error is not None:
            raise NotApplied(read.error, applied=False)
        return read.result

    def _drain_reads(self) -> list[_Read]:
        new = []
        while True:
            try:
                read = self._reads.get_nowait()
            except queue.Empty:
                return new
            if not read.cancelled:
                new.append(read)

    @staticmethod
    def _fail_reads(reads: list[_Read], why: str) -> None:
        for read in reads:
            read.finish(error=why)

    def _serve_reads(self) -> None:
        core = self._core
        leader = core._isLeader()
        term = core.raftCurrentTerm
        if not leader or term != self._ri_term:
            why = "not the leader any more" if not leader else "a new term began before the read was served"
            self._fail_reads(self._ri_early, why)
            for _, _, reads in self._ri_confirming:
                self._fail_reads(reads, why)
            for _, reads in self._ri_ready:
                self._fail_reads(reads, why)
            self._ri_early, self._ri_confirming, self._ri_ready = [], [], []
            self._ri_acks, self._ri_promise, self._ri_sent = {}, {}, {}
            self._set_lease(0.0)
            self._ri_term = term if leader else None
            # __onBecomeLeader set it in this thread before this term could be seen as ours
            noop = core._SyncObj__noopIDx
            self._ri_noop = (noop if noop is not None else 1 << 62) if leader else 0
        new = self._ri_early + self._drain_reads()
        self._ri_early = []
        if not leader:
            self._fail_reads(new, f"not the leader; leader is {self.leader() or 'unknown'}")
            return
        commit = core._SyncObj__raftCommitIndex
        now = lease_clock()
        if new:
            if commit < self._ri_noop:                               # step (1)
                self._ri_early = [r for r in new if not r.cancelled]
            elif self._lease and now < self._lease_until:            # step (2) on the lease
                self.lease_reads += len(new)
                self._ri_ready.append((commit, new))
            else:                                                    # steps (2) and (3)
                self._ri_confirming.append((self._send_round(term, now), commit, new))
        elif (self._lease and commit >= self._ri_noop and now - self._last_round_at >= self.settings.heartbeat
              and now >= self._lease_paused_until):
            self._send_round(term, now)                              # keeps the lease
        # rounds whose every read gave up (a cut-off leader) need not be kept: later ones count alone
        while self._ri_confirming and all(r.cancelled for r in self._ri_confirming[0][2]):
            self._ri_confirming.pop(0)
        self._confirm_rounds()
        self._run_ready_reads()

    def _send_round(self, term: int, now: float) -> int:
        """Step (3): one probe per peer with a new round number; returns it."""
        core = self._core
        self._ri_round += 1
        self._last_round_at = now
        lease = self._lease and now >= self._lease_paused_until
        if lease:
            self._ri_sent[self._ri_round] = now
            while len(self._ri_sent) > 1000:      # a cut-off leader: rounds that will never be confirmed
                del self._ri_sent[next(iter(self._ri_sent))]
            self._promise.extend(core)            # the leader's own vote is part of the majority
        if self.settings.read_confirm:
            for peer in core._SyncObj__otherNodes:
                send_read_probe(core, peer, term, self._ri_round, lease)
        return self._ri_round

    def _on_read_ack(self, peer: Any, term: int, round_: int, promised: float) -> None:
        """A peer answered a probe (tick thread, from pysyncobj_fixes.install_read_probes)."""
        if term != self._ri_term or term != self._core.raftCurrentTerm or not self._core._isLeader():
            return
        key = getattr(peer, "id", peer)
        if round_ > self._ri_acks.get(key, 0):
            self._ri_acks[key] = round_
            self._ri_promise[key] = promised
        self._confirm_rounds()
        self._run_ready_reads()

    def _confirmed_round(self) -> tuple[int, float]:
        """The last round a majority (this leader and peers that acked it or a later round) has
        confirmed, and the shortest promise among those peers (0: some did not promise)."""
        if not self.settings.read_confirm:
            return self._ri_round, 0.0
        peers = [getattr(p, "id", p) for p in self._core._SyncObj__otherNodes]
        needed = (len(peers) + 1) // 2              # peers besides this leader in a majority
        if needed == 0:
            return self._ri_round, self._promise.window
        best = sorted(peers, key=lambda p: self._ri_acks.get(p, 0), reverse=True)[:needed]
        return self._ri_acks.get(best[-1], 0), min(self._ri_promise.get(p, 0.0) for p in best)

    def _confirm_rounds(self) -> None:
        confirmed, promised = self._confirmed_round()
        while self._ri_confirming and self._ri_confirming[0][0] <= confirmed:
            _, index, reads = self._ri_confirming.pop(0)   # later rounds were sent later
            self.read_rounds += 1
            self._ri_ready.append((index, reads))
        sent = [r for r in self._ri_sent if r <= confirmed]
        if sent:
            at = self._ri_sent[sent[-1]]
            for r in sent:
                del self._ri_sent[r]
            if promised > 0 and at >= self._lease_paused_until:
                window = min(promised, self._promise.window)
                seconds = window * (1 - LEASE_CLOCK_DRIFT) if self._lease_seconds is None else self._lease_seconds
                self._set_lease(max(self._lease_until, at + seconds))

    def _set_lease(self, until: float) -> None:
        self._lease_until = until
        self._lease_state = (self._ri_term or 0, until)

    def lease_read_index(self) -> int | None:
        """The lease checked from the caller's thread, without the tick thread's hand-off. The
        lease is read first, as one tuple the tick thread replaces whole; the commit index after
        it. While the lease holds no other member can lead, so this member's commit index, read
        after the check, covers every write acknowledged before the call (a pause between the
        two reads only makes the index newer)."""
        term, until = self._lease_state
        core = self._core
        if not self._lease or lease_clock() >= until or core.raftCurrentTerm != term or not core._isLeader():
            return None
        return core._SyncObj__raftCommitIndex

    def _run_ready_reads(self) -> None:
        applied = self._core._SyncObj__raftLastApplied
        while self._ri_ready and self._ri_ready[0][0] <= applied:   # step (4)
            _, reads = self._ri_ready.pop(0)
            for read in reads:
                if not read.cancelled:
                    read.finish(result=read.run())
