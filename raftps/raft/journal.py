"""DurableJournal: pysyncobj's journal, fsynced with group commit, checksummed, without size limits.

What pysyncobj 0.3.17's FileJournal lacks (issue 15): it never fsyncs the log, it stores records
without a checksum (a torn tail after a power cut is read back as entries), its offsets are 32-bit
(4 GiB cap), its prefix deletion rewrites the whole file, and its term/vote file is renamed into
place without an fsync. This journal implements the same interface (``pysyncobj.journal.Journal``:
add, clear, deleteEntriesFrom, deleteEntriesTo, __getitem__, __len__, _destroy, setRaftCommitIndex,
getRaftCommitIndex, setCurrentTerm, getCurrentTerm, getVotedForNodeId, onOneSecondTimer) and adds
``sync()`` and ``durable_index``.

On disk (one directory)
-----------------------
* ``<first index, 20 digits>.seg``: segments of records ``<u64 length><u64 index><u64 term><u64
  previous entry's term><u32 crc32>`` + command, the CRC over the other fields and the command. A
  new segment starts when the current one reaches ``segment_size``; offsets are per segment and
  Python ints, so there is no 4 GiB limit on the log (nor on a segment). The previous term chains
  the records as Raft's prevLogTerm does: if a cut keeps a truncated-and-rewritten segment but
  undoes the removal of the next one (the old suffix reappears, its indices following on), the
  chain breaks at the junction and the old suffix is dropped, instead of a log that never
  existed, whose old tail could later match a leader's prevLogTerm above entries that differ
  from the leader's.
* ``start``: the first index kept (written by ``deleteEntriesTo`` and by the first ``add`` to an
  empty log, e.g. after ``clear``); whole segments below it are deleted, records below it in the
  first segment are skipped on open. So log compaction costs a sync and one small atomic write,
  never a rewrite of the log.
* ``term``: current term and vote, replaced atomically (temporary file, fsync, rename, fsync of the
  directory) before ``setCurrentTerm`` returns.
* ``commit``: the commit index, a hint written lazily by ``onOneSecondTimer`` (pysyncobj applies up
  to it on start). It never exceeds ``durable_index``: a commit index past the durable log could,
  after a power cut, make a node apply stale entries that a truncation had replaced.

Small files (``start``, ``term``, ``commit``) are ``b"RPSJ"`` + crc32 + JSON.

Opening reads every segment in index order and stops at the first record that is short, fails its
CRC or breaks the index sequence or the term chain: that segment is truncated there and later
segments are deleted, and what was dropped (file, offset, bytes, why) is logged at WARNING. Then
everything read is fsynced once (a process crash leaves unsynced data in the page cache, which we
must not count as durable until it is), so ``durable_index`` starts at the last index.

Appends (``add``) and truncations (``deleteEntriesFrom``) are written without fsync; ``sync()``
fsyncs every segment written since the last sync, and the directory if segments were created or
deleted: one fsync for all the appends of a tick (group commit). ``durable_index`` is the last
index known fsynced. With ``fsync=False`` nothing is ever fsynced (pysyncobj's behaviour: survives
a process crash, not a power loss) and ``durable_index`` follows the last index.

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

For raftps/node.py: ``SyncObjConf(journalFile=None, ...)``; ``journal = DurableJournal(
os.path.join(data_dir, "raft.wal"), storage=process_storage(), fsync=durability == "fsync")``
before ``super().__init__``; ``install_durable_journal(self, journal)`` as the first call after it
(before ``install_pysyncobj_fixes``, which wraps the transport and is independent of these
wrappers: its ``follower_hint`` rewrites the queued acks when they are finally sent); an existing
``raft.journal`` is carried over once with ``import_file_journal`` before the SyncObj is built;
``backup.NODE_FILES`` must name the new directory.

Not covered here: the snapshot file (``fullDumpFile`` or raftps's own serializer) must be fsynced
(file, then directory) before pysyncobj's serializer reports success, because compaction deletes
the log below it right after; pysyncobj's own ``Serializer`` does not fsync.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import struct
import zlib
from typing import Any

from pysyncobj.journal import FileJournal, Journal

from .storage import OSStorage, Storage, StorageFile, write_atomic

log = logging.getLogger("raftps.raft.journal")

RECORD = struct.Struct("<QQQQI")         # command length, index, term, previous entry's term, crc32
_SMALL_MAGIC = b"RPSJ"
SEGMENT_SUFFIX = ".seg"
DEFAULT_SEGMENT_SIZE = 64 << 20


class JournalCorrupt(Exception):
    """A small file (term, start) that is not what this journal writes: refuse to guess."""


def encode_record(command: bytes, idx: int, term: int, prev_term: int = 0) -> bytes:
    head = struct.pack("<QQQQ", len(command), idx, term, prev_term)
    return head + struct.pack("<I", zlib.crc32(command, zlib.crc32(head))) + command


def _pack_small(value: Any) -> bytes:
    body = json.dumps(value, separators=(",", ":")).encode()
    return _SMALL_MAGIC + struct.pack("<I", zlib.crc32(body)) + body


def _unpack_small(blob: bytes, what: str) -> Any:
    if len(blob) < 8 or blob[:4] != _SMALL_MAGIC or struct.unpack("<I", blob[4:8])[0] != zlib.crc32(blob[8:]):
        raise JournalCorrupt(f"{what}: not a valid journal file ({len(blob)} bytes)")
    return json.loads(blob[8:])


class JournalFailed(OSError):
    """An fsync of the journal failed: it can no longer tell what is durable (see sync())."""


class _Segment:
    __slots__ = ("first", "path", "file", "size", "dirty")

    def __init__(self, first: int, path: str, file: StorageFile | None, size: int):
        self.first, self.path, self.file, self.size = first, path, file, size
        self.dirty = False


class DurableJournal(Journal):
    """pysyncobj's journal interface on checksummed, segmented, group-committed files."""

    def __init__(self, path: str, *, storage: Storage | None = None, fsync: bool = True,
                 segment_size: int = DEFAULT_SEGMENT_SIZE):
        self.path = os.path.abspath(path)
        self.storage = storage if storage is not None else OSStorage()
        self.fsync = fsync
        self.segment_size = segment_size
        self.fsync_count = 0                     # file + directory fsyncs of the log (group commit)
        self._entries: list[tuple[bytes, int, int]] = []
        self._offsets: list[int] = []            # each entry's offset in its segment
        self._segments: list[_Segment] = []
        self._dirty: list[_Segment] = []         # segments written since the last sync
        self._dir_dirty = False                  # segments created or removed since the last sync
        self._start = 0                          # what the ``start`` file says
        self._durable_index = 0
        self.failed: OSError | None = None       # the fsync error that stopped this journal
        self.storage.makedirs(self.path)
        meta = self._read_small("term", {"term": 0, "vote": None})
        self._term: int = meta["term"]
        self._vote: Any = meta["vote"]
        self._commit_saved: int = self._read_small("commit", {"commit": 1})["commit"]
        self._commit = self._commit_saved
        self._start = self._read_small("start", {"start": 0})["start"]
        self._open_segments(self._start)
        if self.fsync:
            for segment in self._segments:       # read back from the page cache != durable
                self._mark(segment)
            self._dir_dirty = True
        self.sync()

    # ---- opening ---------------------------------------------------------------------------------

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _read_small(self, name: str, default: Any) -> Any:
        if not self.storage.exists(self._file(name)):
            return default
        try:
            return _unpack_small(self.storage.read_file(self._file(name)), self._file(name))
        except JournalCorrupt:
            # Only unsynced writes can tear: the commit hint always, everything with fsync=False.
            # A torn term or start file of a durable journal is real corruption: refuse to guess.
            if self.fsync and name != "commit":
                raise
            log.warning("journal %s: %s is torn (written without fsync); using %r", self.path, name, default)
            return default

    def _open_segments(self, start: int) -> None:
        names = [n for n in self.storage.listdir(self.path) if n.endswith(SEGMENT_SUFFIX)]
        firsts = sorted(int(n[:-len(SEGMENT_SUFFIX)]) for n in names if n[:-len(SEGMENT_SUFFIX)].isdigit())
        expected: int | None = None              # the index the next record must have
        last_term: int | None = None             # the term of the record before it
        broken = False
        for first in firsts:
            path = self._file(f"{first:020d}{SEGMENT_SUFFIX}")
            if broken or (expected is not None and first != expected):
                why = "after a damaged segment" if broken else f"starts at {first}, expected {expected}"
                log.warning("journal %s: dropping segment %s (%d bytes): %s", self.path, path,
                            len(self.storage.read_file(path)), why)
                self._remove(path)
                broken = True
                continue
            blob = self.storage.read_file(path)
            pos, nxt, entries, offsets, why = 0, first, [], [], None
            while pos < len(blob):
                if pos + RECORD.size > len(blob):
                    why = "short record header"
                    break
                length, idx, term, prev_term, crc = RECORD.unpack_from(blob, pos)
                end = pos + RECORD.size + length
                if end > len(blob):
                    why = f"record of {length} bytes runs past the end"
                    break
                command = blob[pos + RECORD.size:end]
                if zlib.crc32(command, zlib.crc32(blob[pos:pos + RECORD.size - 4])) != crc:
                    why = "bad crc32"
                    break
                if idx != nxt:
                    why = f"index {idx}, expected {nxt}"
                    break
                if last_term is not None and prev_term != last_term:
                    why = f"index {idx} follows a term {prev_term} entry, not this log's term {last_term}"
                    break
                entries.append((bytes(command), idx, term))
                offsets.append(pos)
                pos, nxt, last_term = end, nxt + 1, term
            if first < start and nxt <= start:
                # Wholly below the start: compaction or clear() left it (its removal was not
                # durable yet). It says nothing about the log above the start: no sequence check.
                self._remove(path)
                last_term = None
                continue
            if why is not None:
                log.warning("journal %s: dropping %d bytes at offset %d of %s (index %d on): %s",
                            self.path, len(blob) - pos, pos, path, nxt, why)
                broken = True
            kept = [i for i, e in enumerate(entries) if e[1] >= start]
            f = self.storage.open(path)
            if why is not None:
                f.truncate(pos)
            segment = _Segment(first, path, f, pos)
            if why is not None:
                self._mark(segment)
            self._segments.append(segment)
            self._entries.extend(entries[i] for i in kept)
            self._offsets.extend(offsets[i] for i in kept)
            expected = nxt
        for segment in self._segments[:-1]:      # only the last one is appended to
            segment.file.close()
            segment.file = None

    # ---- durability ------------------------------------------------------------------------------

    def sync(self) -> int:
        """Make every append and truncation so far durable, with one fsync per file written.

        Called at least twice per tick by the hook: nothing to do must cost nothing. A failed
        fsync is final (``JournalFailed`` now and on every later call): the kernel may have dropped
        the pages it could not write and a retry may then report success without them, so nothing
        written since the last good sync can ever be called durable; restart the node."""
        if self.failed is not None:
            raise JournalFailed(f"journal {self.path}: an earlier fsync failed") from self.failed
        if self._dirty or self._dir_dirty:
            tail = self._segments[-1] if self._segments else None
            try:
                for segment in self._dirty:
                    if segment.dirty:            # else removed since it was written
                        if self.fsync:
                            self._segment_file(segment).fsync()
                            self.fsync_count += 1
                        segment.dirty = False
                        if segment is not tail and segment.file is not None:
                            segment.file.close()     # full: never written again
                            segment.file = None
                if self._dir_dirty and self.fsync:
                    self.storage.fsync_dir(self.path)
                    self.fsync_count += 1
            except OSError as exc:
                self.failed = exc
                log.critical("journal %s: fsync failed, nothing more will be made durable: %s",
                             self.path, exc)
                raise JournalFailed(f"journal {self.path}: fsync failed") from exc
            self._dirty.clear()
            self._dir_dirty = False
        self._durable_index = self._entries[-1][1] if self._entries else 0
        return self._durable_index

    def _mark(self, segment: _Segment) -> None:
        if not segment.dirty:
            segment.dirty = True
            self._dirty.append(segment)

    @property
    def durable_index(self) -> int:
        """The last index known fsynced (0: none). With fsync=False, the last index."""
        if not self.fsync:
            return self._entries[-1][1] if self._entries else 0
        return self._durable_index

    @property
    def pending(self) -> bool:
        """Whether sync() has anything to do."""
        return self._dir_dirty or bool(self._dirty)

    def _segment_file(self, segment: _Segment) -> StorageFile:
        if segment.file is None:
            segment.file = self.storage.open(segment.path, create=False)
        return segment.file

    def _drop(self, segment: _Segment) -> None:
        if segment.file is not None:
            segment.file.close()
            segment.file = None
        segment.dirty = False                    # nothing of it to fsync any more
        self._remove(segment.path)

    def _remove(self, path: str) -> None:
        self.storage.remove(path)
        self._dir_dirty = True

    def _write_small(self, name: str, value: Any, fsync: bool) -> None:
        write_atomic(self.storage, self._file(name), _pack_small(value), fsync=fsync and self.fsync)

    # ---- pysyncobj's Journal interface -----------------------------------------------------------

    def add(self, command: bytes, idx: int, term: int) -> None:
        command = bytes(command)
        if not self._entries:
            # The first entry of a new log (after clear(), or of an empty one): it may be anywhere
            # above or below the old log. Its start is recorded, durably, before the entry, so that
            # leftovers of the old log surviving a cut are skipped, not joined, and so that this
            # entry is not skipped as below an older start; an empty leftover segment goes too.
            for segment in self._segments:
                self._drop(segment)
            self._segments = []
            if idx != self._start:
                self._write_small("start", {"start": idx}, fsync=True)
                self._start = idx
        if self._entries and idx != self._entries[-1][1] + 1:
            raise ValueError(f"journal {self.path}: add of index {idx} after {self._entries[-1][1]}")
        record = encode_record(command, idx, term, self._entries[-1][2] if self._entries else 0)
        tail = self._segments[-1] if self._segments else None
        if tail is None or (tail.size > 0 and tail.size + len(record) > self.segment_size):
            tail = _Segment(idx, self._file(f"{idx:020d}{SEGMENT_SUFFIX}"), None, 0)
            tail.file = self.storage.open(tail.path)
            tail.file.truncate(0)                # a leftover file of that name is not ours
            self._segments.append(tail)
            self._dir_dirty = True
        offset = tail.size
        self._segment_file(tail).write(offset, record)
        tail.size += len(record)
        self._mark(tail)
        self._entries.append((command, idx, term))
        self._offsets.append(offset)

    def clear(self) -> None:
        for segment in self._segments:
            self._drop(segment)
        self._segments, self._entries, self._offsets = [], [], []
        self._durable_index = 0

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        if entryFrom >= len(self._entries):
            return
        if entryFrom <= 0:
            self.clear()
            return
        idx = self._entries[entryFrom][1]
        k = self._segment_of(idx)
        for segment in self._segments[k + 1:]:
            self._drop(segment)
        del self._segments[k + 1:]
        tail = self._segments[k]
        tail.size = self._offsets[entryFrom]
        self._segment_file(tail).truncate(tail.size)
        self._mark(tail)
        del self._entries[entryFrom:]
        del self._offsets[entryFrom:]
        self._durable_index = min(self._durable_index, idx - 1)

    def deleteEntriesTo(self, entryTo: int) -> None:
        if entryTo <= 0:
            return
        if entryTo >= len(self._entries):
            self.clear()
            return
        first = self._entries[entryTo][1]
        # The log first: a follower may compact past its durable index (its commit index follows
        # the leader's), and a start above what survives a cut would leave it an empty log.
        self.sync()
        # Then the start, durable at once: pysyncobj deletes the log below a snapshot it has just
        # written, and it clears a journal that starts below its snapshot on restart.
        self._write_small("start", {"start": first}, fsync=True)
        self._start = first
        k = self._segment_of(first)
        for segment in self._segments[:k]:
            self._drop(segment)
        del self._segments[:k]
        del self._entries[:entryTo]
        del self._offsets[:entryTo]

    def _segment_of(self, idx: int) -> int:
        return bisect.bisect_right([s.first for s in self._segments], idx) - 1

    def __getitem__(self, item: Any) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        self.sync()
        self._save_commit()
        for segment in self._segments:
            if segment.file is not None:
                segment.file.close()
                segment.file = None

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:
        self._commit = raftCommitIndex

    def getRaftCommitIndex(self) -> int:
        last = self._entries[-1][1] if self._entries else 1
        return max(1, min(self._commit, last))

    def setCurrentTerm(self, term: int, votedForNodeId: Any) -> None:
        # Before returning: pysyncobj sends the vote (or the request for votes) right after.
        self._write_small("term", {"term": term, "vote": votedForNodeId}, fsync=True)
        self._term, self._vote = term, votedForNodeId

    def getCurrentTerm(self) -> int:
        return self._term

    def getVotedForNodeId(self) -> Any:
        return self._vote

    def onOneSecondTimer(self) -> None:
        self._save_commit()

    def _save_commit(self) -> None:
        commit = min(self._commit, self.durable_index)
        if commit > self._commit_saved:
            self._write_small("commit", {"commit": commit}, fsync=False)   # a hint: no fsync
            self._commit_saved = commit


def import_file_journal(path: str, journal: DurableJournal) -> int:
    """Copy pysyncobj's FileJournal at ``path`` (with its ``.meta``) into an empty journal, durably.

    For a node switching journals in place: its log, term and vote must carry over, or it could
    vote twice in a term or lose entries it acknowledged. Returns the number of entries copied."""
    if len(journal):
        raise ValueError(f"journal {journal.path} is not empty")
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    old = FileJournal(path)
    try:
        for i in range(len(old)):
            journal.add(*old[i])
        journal.setRaftCommitIndex(old.getRaftCommitIndex())
        journal.setCurrentTerm(old.getCurrentTerm(), old.getVotedForNodeId())
        journal.sync()
        journal.onOneSecondTimer()
        return len(old)
    finally:
        old._destroy()
