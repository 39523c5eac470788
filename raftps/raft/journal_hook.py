"""Put a DurableJournal under a pysyncobj 0.3.17 SyncObj, with the fsyncs where Raft needs them.

Only pysyncobj's name-mangled attributes (``_SyncObj__...``) and ``_onTick`` are touched.

Where pysyncobj 0.3.17 must call ``sync()`` (read from syncobj.py)
------------------------------------------------------------------
The tick (``SyncObj._onTick``) runs, in order: the election timeout (``__setCurrentTerm(term + 1,
self)``, then ``request_vote`` to every peer, and ``__onBecomeLeader`` at once if this node alone is
a majority); the leader's commit-index computation (for each index above the commit index it counts
**1 for itself, unconditionally, for every index up to its last log index**, plus each peer whose
``__raftMatchIndex`` reaches it); ``__applyLogEntries``; ``__sendAppendEntries``;
``_checkCommandsToApply`` (the leader ``add``s new commands to the log); log compaction
(``deleteEntriesTo`` once a snapshot is written); the on-tick callbacks; and last
``_poller.poll()``, which delivers every message that arrived, each to ``__onMessageReceived``.
``TcpConnection.send`` writes to the socket at once, so a reply leaves during that call.

(a) Follower acknowledgements: ``__onMessageReceived`` handles ``append_entries`` by
``deleteEntriesFrom`` + ``add`` of the new entries and, in the same call, ``__sendNextNodeIdx(node,
nextNodeIdx=..., success=True)``, the acknowledgement the leader turns into ``__raftMatchIndex``.
A snapshot install (``serialized``) does ``clear`` + 2 ``add``s, then ``__sendNextNodeIdx(node,
success=True)``. ``__sendNextNodeIdx`` is the only way a follower acknowledges log state, so every
call of it must wait for ``sync()``. To keep group commit, the acknowledgements are held back
(with their ``nextNodeIdx`` computed at once, as the original would) and sent after the tick's
``poll()`` returns, right after one ``sync()`` for all the messages of that poll.

(b) The leader's own vote in the commit count: the count of 1 for itself covers its whole log, so
its whole log must be durable when the computation runs. The leader appends in
``_checkCommandsToApply`` and in ``__onBecomeLeader`` (the no-op of its term); the former runs
after the computation, so a ``sync()`` at the end of each tick (after ``poll()``) makes it durable
before the next tick's computation; the latter may run in the same tick *before* the computation
(a one-node cluster elects itself in the election block), so ``__onBecomeLeader`` is followed by
``sync()``. A ``sync()`` at the start of each tick is a free guard (it does nothing when nothing
was written). Sending entries to followers before the leader's own fsync is allowed by Raft (the
leader's copy only counts once durable, dissertation 10.2.1): with ``appendEntriesUseBatch=False``
``_checkCommandsToApply`` sends each entry as it appends it, and a ``sync()`` right before
``poll()`` (which waits for the replies) runs the leader's fsync beside the followers'. Without
it the leader's fsync waited in the sync after the tick, until ``poll()`` returned with the first
reply: the two fsyncs ran one after the other.

Lines of pysyncobj 0.3.17's syncobj.py: ``_onTick`` L611-706 (new term L640, commit computation
L655-677 with ``count = 1`` at L660, ``_checkCommandsToApply()`` L699, ``poll`` L706); leader
appends L528 (``_checkCommandsToApply``) and L1227 (``__onBecomeLeader``); follower appends L1006
and its acks L1019 (entries) and L1025 (snapshot); failed/heartbeat replies L969-989; votes
L921/L937 then ``response_vote`` L941, L957; ``__sendNextNodeIdx`` L1098; ``__setCurrentTerm``
L1234; the journal clear of ``__loadDumpFile`` L1489-1495; tcp_connection.py ``send`` L141.

(c) Votes: ``request_vote`` is answered by ``__setCurrentTerm(term, node.id)`` and then a
``response_vote`` send; a candidate calls ``__setCurrentTerm(term + 1, self)`` before sending
``request_vote``; a higher term seen in any message goes through ``__setCurrentTerm`` before
anything is sent. All of them go through ``setCurrentTerm``, which here fsyncs before it returns,
so (c) needs no hook.

Integration plan (``raftps/raft/journal_hook.py``, ``install_durable_journal(syncobj, journal)``)
------------------------------------------------------------------------------------------------
1. Construct the ``SyncObj`` with ``journalFile=None`` (pysyncobj then makes a MemoryJournal; its
   FileJournal must not open the same files).
2. Right after ``SyncObj.__init__`` returns (pysyncobj's tick thread sleeps 0.1 s before its first
   tick; with ``autoTick=False``, before the first ``doTick``), call ``install_durable_journal``.
   It refuses if a tick has already run. It swaps ``_SyncObj__raftLog`` for the journal and redoes
   what ``__init__`` did with the old one (the first no-op entry of an empty log,
   ``_SyncObj__raftCurrentTerm = max(term, last log term)``, ``_SyncObj__votedForNodeId``,
   ``_SyncObj__raftCommitIndex``);
3. replaces ``_SyncObj__sendNextNodeIdx`` by a version that queues the acknowledgement;
4. replaces ``_SyncObj__onBecomeLeader`` by the original followed by ``journal.sync()``;
5. replaces ``_onTick`` by: ``sync()`` + send queued acks; the original tick; then (in a
   ``finally``) ``sync()`` + send queued acks: one fsync per tick for all appends (leader and
   follower) of that tick; and the poller's ``poll`` by ``sync()`` + send queued acks, then the
   original (the leader's fsync while its entries travel) (steps 3-5 only with ``fsync=True``:
   without, pysyncobj runs as before);
6. wraps the serializer's ``deserialize`` so that on start, if the journal still holds entries
   below a snapshot (compaction's ``start`` write lost, or an old journal), the prefix is dropped
   before pysyncobj compares the journal's first two entries with the snapshot's: pysyncobj
   otherwise *clears the journal*, losing every entry after the snapshot;
7. adds the new attribute names to ``_SyncObj__properies`` so pysyncobj's default serializer does
   not pickle them into snapshots.

In raftps (``raft/pysyncobj_log.py``): ``SyncObjConf(journalFile=None, ...)``, the journal from the
replica's ``Durability.open_journal`` (``raft/durability.py``, which also carries an existing
``raft.journal`` over once with ``import_file_journal``) before ``SyncObj.__init__``, and
``install_durable_journal(core, journal)`` as the first call after it (before
``install_pysyncobj_fixes``, which wraps the transport and is independent of these wrappers: its
``follower_hint`` rewrites the queued acks when they are finally sent); ``backup.NODE_FILES``
names the journal's directory.

If an fsync fails, ``journal.sync()`` raises ``JournalFailed`` from then on, so every later tick
fails at its start (pysyncobj logs it and retries): queued acknowledgements are never sent and the
node neither votes nor leads again. It has to be restarted; ``journal.failed`` says why.

``install_durable_snapshots`` does the same for the snapshot file: fsynced, renamed into place and
its directory fsynced before pysyncobj drops the log it covers.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pysyncobj import SyncObj
from pysyncobj.journal import MemoryJournal

from raftps.raft.journal import DurableJournal
from raftps.raft.storage import Storage, StorageFile

log = logging.getLogger("raftps.raft.journal_hook")

_NO_OP = b"\x01"          # pysyncobj's _COMMAND_TYPE.NO_OP, the first entry of every log
_ATTRS = ("_onTick", "_SyncObj__sendNextNodeIdx", "_SyncObj__onBecomeLeader", "_raftps_durable")


def install_durable_journal(syncobj: SyncObj, journal: DurableJournal) -> None:
    """Make ``syncobj`` keep its log, term and vote in ``journal``, fsynced before it counts.

    Call it right after ``SyncObj.__init__`` returns, with ``journalFile=None`` in the conf."""
    s = syncobj
    if getattr(s, "_raftps_durable", None) is not None:
        raise RuntimeError("install_durable_journal: already installed")
    if s._SyncObj__numOneSecondDumps or not s._SyncObj__needLoadDumpFile:
        raise RuntimeError("install_durable_journal: the SyncObj has ticked already; install it "
                           "right after SyncObj.__init__ (or before the first doTick)")
    old = s._SyncObj__raftLog
    if old is not journal:
        if not isinstance(old, MemoryJournal):
            raise RuntimeError("install_durable_journal: build the SyncObj with journalFile=None")
        # What SyncObj.__init__ did with its own journal.
        if len(journal) == 0:
            journal.add(_NO_OP, 1, 0)
            journal.sync()
        s._SyncObj__raftLog = journal
        s._SyncObj__raftCurrentTerm = max(journal.getCurrentTerm(), journal[-1][2])
        s._SyncObj__votedForNodeId = journal.getVotedForNodeId()
        s._SyncObj__raftCommitIndex = journal.getRaftCommitIndex()

    acks: list[tuple[Any, bool, int, bool]] = []
    send_ack = s._SyncObj__sendNextNodeIdx
    become_leader = s._SyncObj__onBecomeLeader
    tick = s._onTick

    def queue_ack(node: Any, reset: bool = False, nextNodeIdx: int | None = None,
                  success: bool = False) -> None:
        # (a): a follower's acknowledgement waits for the fsync of what it acknowledges.
        if nextNodeIdx is None:                  # what the original computes, as of now
            nextNodeIdx = s._SyncObj__getCurrentLogIndex() + 1
        acks.append((node, reset, nextNodeIdx, success))

    def flush() -> None:
        journal.sync()
        if acks:
            queued = acks[:]
            del acks[:]
            for node, reset, next_idx, success in queued:
                send_ack(node, reset=reset, nextNodeIdx=next_idx, success=success)

    def become_leader_durably() -> None:
        # (b): the no-op appended here may be counted by this very tick's commit computation.
        become_leader()
        journal.sync()

    def durable_tick(timeToWait: float = 0.0) -> None:
        # (b) and group commit: one sync for the appends of a whole tick, before the next tick's
        # commit computation counts the leader's log, and before queued acks leave.
        flush()
        try:
            tick(timeToWait)
        finally:
            flush()

    poll = s._poller.poll

    def sync_then_poll(timeout: float) -> None:
        # The leader's appends of this tick went out to the followers as they were made
        # (appendEntriesUseBatch=False); syncing them here, before poll() waits for the replies,
        # puts the leader's fsync beside the followers' instead of after the first reply (the
        # sync after the tick would wait for poll() to return). Dissertation 10.2.1.
        flush()
        poll(timeout)

    deserialize = s._SyncObj__serializer.deserialize

    def deserialize_keeping_log() -> Any:
        data = deserialize()
        _drop_below_snapshot(journal, data)
        return data

    if journal.fsync:                            # with fsync=False there is nothing to wait for
        s._SyncObj__sendNextNodeIdx = queue_ack
        s._SyncObj__onBecomeLeader = become_leader_durably
        s._onTick = durable_tick
        s._poller.poll = sync_then_poll
    s._SyncObj__serializer.deserialize = deserialize_keeping_log
    s._raftps_durable = journal
    s._SyncObj__properies.update(_ATTRS)         # not state: keep them out of default snapshots


def _drop_below_snapshot(journal: DurableJournal, data: Any) -> None:
    """Start the journal at the snapshot's entries if it holds them further in.

    pysyncobj's __loadDumpFile clears the journal (every entry after the snapshot with it) unless
    its first two entries are the snapshot's last two; a journal that still holds the log below
    the snapshot (compaction interrupted before its ``start`` write) must lose only that prefix."""
    try:
        last, before = data[1], data[2]
    except (TypeError, IndexError):
        return
    if len(journal) < 3 or journal[0] == before:
        return
    first = journal[0][1]
    pos = before[1] - first
    if 0 < pos < len(journal) - 1 and journal[pos] == before and journal[pos + 1] == last:
        log.warning("journal %s: dropping %d entries below the snapshot at index %d",
                    journal.path, pos, last[1])
        journal.deleteEntriesTo(pos)


def install_durable_snapshots(syncobj: SyncObj, storage: Storage, fsync: bool = True) -> None:
    """Make ``syncobj``'s snapshot file durable before anything relies on it.

    pysyncobj 0.3.17 (serializer.py) renames a snapshot into place without an fsync of the file
    or of its directory, both for its own (``serialize``: our serializer callback writes ``.tmp``)
    and for one a leader streams to it (``setTransmissionData``: chunks appended to ``.1.tmp``).
    Then it drops the log the snapshot covers: at its next compaction for its own, and at once,
    durably, for a received one (``__loadDumpFile(clearJournal=True)``). A power cut in between
    left the journal starting after a snapshot file that was empty, torn or the older one, so the
    node restarted without the entries in between. Here both paths write through ``storage`` and
    fsync the file, rename it and fsync the directory before pysyncobj goes on.

    ``fsync=False`` (tests only, UNSAFE): the same writes without the fsyncs."""
    serializer = syncobj._SyncObj__serializer
    path = os.path.abspath(serializer._Serializer__fileName)
    write = serializer._Serializer__serializer
    if write is None:
        raise RuntimeError("install_durable_snapshots: the SyncObj needs a serializer callback")
    incoming: list[StorageFile] = []             # the received snapshot being assembled

    def install(f: StorageFile) -> None:
        try:
            if fsync:
                f.fsync()
        finally:
            f.close()
        storage.rename(f.path, path)
        if fsync:
            storage.fsync_dir(os.path.dirname(path))

    def serialize(data: Any, serialize_id: int) -> None:
        if serializer._Serializer__pid != 0:
            return
        serializer._Serializer__currentID = serialize_id
        tmp = path + ".tmp"
        try:
            write(tmp, data[1:])
            install(storage.open(tmp, create=False))
            serializer._Serializer__pid = -1       # what pysyncobj's checkSerializing reads: done
        except Exception:
            log.exception("writing the snapshot %s failed", path)
            serializer._Serializer__pid = -2       # failed: the log is not compacted

    def set_transmission_data(data: Any) -> bool:
        if data is None:
            return False
        chunk, first, last = data
        try:
            if first:
                while incoming:
                    incoming.pop().close()
                f = storage.open(path + ".1.tmp")
                f.truncate(0)
                incoming.append(f)
            elif not incoming:
                return False
            incoming[0].append(chunk)
            if last:
                install(incoming.pop())
            return bool(last)
        except Exception:
            log.exception("receiving the snapshot %s failed", path)
            while incoming:
                incoming.pop().close()
            return False

    serializer.serialize = serialize
    serializer.setTransmissionData = set_transmission_data
