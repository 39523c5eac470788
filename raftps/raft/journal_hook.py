"""Put a DurableJournal under a pysyncobj 0.3.17 SyncObj, with the fsyncs where Raft needs them.

Why each wrapper exists, and in which order pysyncobj runs them, is in the docstring of
``raftps/raft/journal.py`` ("Where pysyncobj 0.3.17 must call sync()" and "Integration plan").
Only pysyncobj's name-mangled attributes (``_SyncObj__...``) and ``_onTick`` are touched.

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

from .journal import DurableJournal
from .storage import Storage, StorageFile

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
