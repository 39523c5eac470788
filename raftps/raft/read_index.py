"""ReadIndex reads and leader leases on pysyncobj 0.3.17: the read path of ``SyncObjLog``.

In the tick thread (pysyncobj's state is only consistent there):
(1) the leader waits until an entry of its current term is committed: pysyncobj appends a
    no-op when it becomes leader (``__onBecomeLeader``) and commits only entries of the current
    term, so commitIndex >= that no-op's index means the commit index covers every entry any
    earlier leader committed;
(2) the read index is the commit index, read after the request arrived;
(3) one probe per peer carries a round number sent after (2); a peer answers with its current
    term. A round is confirmed when the leader plus peers that answered that round or a later
    one (sent later still) with our term make a majority: at those moments no majority node
    had moved past our term, so no later leader existed yet, and every write acknowledged
    before the read began is at or below the read index. All reads that arrived before a
    round was sent share it;
(4) once lastApplied >= the read index, run() runs, still leader of the same term.
No clocks: a paused or partitioned ex-leader gets no majority of acks in its term.

Leases (read mode "lease") add clocks, and skip step (3) for most reads. In lease mode every
probe asks for a promise and the leader sends a round at least every heartbeat, reads or
not. A voter that answers in our term promises to withhold its vote for its window W (its
minimum election timeout, pysyncobj_fixes.LeasePromise), counted from its answer, which
comes after the round was sent; the leader promises the same from the moment it sends.
When a round sent at t is confirmed by a majority that all promised, no other member can win
an election before t + W on the voters' clocks, so the leader holds a lease until
t + W * (1 - LEASE_CLOCK_DRIFT) on its own. A read that arrives inside the lease takes the
commit index as its read index at once (step 2) and waits only for step (4). Reads outside
it go through step (3), whose round renews the lease. The clock is CLOCK_BOOTTIME: a
suspended host's lease expires while it sleeps. A leadership transfer gives the lease up.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any, Callable

from raftps.raft import NotApplied, RaftSettings
from raftps.raft.pysyncobj_fixes import LeasePromise, lease_clock, send_read_probe

log = logging.getLogger("raftps.raft")
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


class ReadIndex:
    """A leader's linearizable reads without log entries. ``read`` and ``lease_read_index`` from any
    thread; everything else in the tick thread: ``serve`` on every tick, ``on_ack`` for each probe
    answer (pysyncobj_fixes.install_read_probes), ``give_up_lease`` before a leadership transfer."""

    def __init__(self, core: Any, settings: RaftSettings, leader: Callable[[], str | None],
                 wake: Callable[[], None]):
        self._core = core                         # pysyncobj_log.Core: its narrow views of pysyncobj's state
        self._settings = settings
        self._leader = leader
        self._wake = wake
        self._reads: queue.SimpleQueue[_Read] = queue.SimpleQueue()   # new ReadIndex reads, any thread
        # Tick-thread state of ReadIndex (see serve).
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
        # Leases. Every member keeps promises, whatever its own read mode.
        self.promise = LeasePromise(settings.election_timeout[0])
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

    @property
    def votes_withheld(self) -> int:
        """Vote requests refused under a lease promise."""
        return self.promise.votes_withheld

    def stop(self) -> None:
        for read in self._drain_reads():
            read.finish(error="the node is stopping")

    def give_up_lease(self, seconds: float) -> None:
        """Tick thread: serve no read on the lease, take no new one and keep no promise for
        ``seconds``, so that the member leadership goes to can win the vote at once."""
        self._set_lease(0.0)
        self._lease_paused_until = lease_clock() + seconds
        self.promise.release()

    def read(self, run: Callable[[], Any], timeout: float) -> Any:
        """Any thread: ``run()`` in the tick thread once the read may be served (ReplicatedLog.read_index)."""
        read = _Read(run)
        self._reads.put(read)
        self._wake()
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

    def serve(self) -> None:
        core = self._core
        leader = core.is_leader()
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
            noop = core.noop_index()
            self._ri_noop = (noop if noop is not None else 1 << 62) if leader else 0
        new = self._ri_early + self._drain_reads()
        self._ri_early = []
        if not leader:
            self._fail_reads(new, f"not the leader; leader is {self._leader() or 'unknown'}")
            return
        commit = core.raftCommitIndex
        now = lease_clock()
        if new:
            if commit < self._ri_noop:                               # step (1)
                self._ri_early = [r for r in new if not r.cancelled]
            elif self._lease and now < self._lease_until:            # step (2) on the lease
                self.lease_reads += len(new)
                self._ri_ready.append((commit, new))
            else:                                                    # steps (2) and (3)
                self._ri_confirming.append((self._send_round(term, now), commit, new))
        elif (self._lease and commit >= self._ri_noop and now - self._last_round_at >= self._settings.heartbeat
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
            self.promise.extend(core)            # the leader's own vote is part of the majority
        if self._settings.read_confirm:
            for peer in core.other_nodes():
                send_read_probe(core, peer, term, self._ri_round, lease)
        return self._ri_round

    def on_ack(self, peer: Any, term: int, round_: int, promised: float) -> None:
        """A peer answered a probe (tick thread, from pysyncobj_fixes.install_read_probes)."""
        if term != self._ri_term or term != self._core.raftCurrentTerm or not self._core.is_leader():
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
        if not self._settings.read_confirm:
            return self._ri_round, 0.0
        peers = [getattr(p, "id", p) for p in self._core.other_nodes()]
        needed = (len(peers) + 1) // 2              # peers besides this leader in a majority
        if needed == 0:
            return self._ri_round, self.promise.window
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
                window = min(promised, self.promise.window)
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
        if not self._lease or lease_clock() >= until or core.raftCurrentTerm != term or not core.is_leader():
            return None
        return core.raftCommitIndex

    def _run_ready_reads(self) -> None:
        applied = self._core.raftLastApplied
        while self._ri_ready and self._ri_ready[0][0] <= applied:   # step (4)
            _, reads = self._ri_ready.pop(0)
            for read in reads:
                if not read.cancelled:
                    read.finish(result=read.run())
