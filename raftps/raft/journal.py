"""DurableJournal: pysyncobj's journal, fsynced with group commit, checksummed, without size limits.

What pysyncobj 0.3.17's FileJournal lacks (issue 15): it never fsyncs the log, it stores records
without a checksum (a torn tail after a power cut is read back as entries), its offsets are 32-bit
(4 GiB cap), its prefix deletion rewrites the whole file, and its term/vote file is renamed into
place without an fsync. This journal implements the same interface (``pysyncobj.journal.Journal``:
add, clear, deleteEntriesFrom, deleteEntriesTo, __getitem__, __len__, _destroy, setRaftCommitIndex,
getRaftCommitIndex, setCurrentTerm, getCurrentTerm, getVotedForNodeId, onOneSecondTimer) and adds
``sync()`` and ``durable_index``.

On disk: one directory of segments and small files (``raft/journal_format.py``).

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

Where pysyncobj must call ``sync()``, and how the journal is put under a SyncObj:
``raft/journal_hook.py``.
Whether a node has a DurableJournal, and whether it fsyncs: ``raft/durability.py``.
"""

from __future__ import annotations

import bisect
import logging
import os
from typing import Any

from pysyncobj.journal import FileJournal, Journal

from raftps.raft.journal_format import (RECORD, JournalCorrupt, encode_record,  # noqa: F401 (RECORD re-exported)
                             pack_small, scan_segment, segment_firsts, segment_name, unpack_small)
from raftps.raft.storage import OSStorage, Storage, StorageFile, write_atomic

log = logging.getLogger("raftps.raft.journal")

DEFAULT_SEGMENT_SIZE = 64 << 20


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
            return unpack_small(self.storage.read_file(self._file(name)), self._file(name))
        except JournalCorrupt:
            # Only unsynced writes can tear: the commit hint always, everything with fsync=False.
            # A torn term or start file of a durable journal is real corruption: refuse to guess.
            if self.fsync and name != "commit":
                raise
            log.warning("journal %s: %s is torn (written without fsync); using %r", self.path, name, default)
            return default

    def _open_segments(self, start: int) -> None:
        expected: int | None = None              # the index the next record must have
        last_term: int | None = None             # the term of the record before it
        broken = False
        for first in segment_firsts(self.storage.listdir(self.path)):
            path = self._file(segment_name(first))
            if broken or (expected is not None and first != expected):
                why = "after a damaged segment" if broken else f"starts at {first}, expected {expected}"
                log.warning("journal %s: dropping segment %s (%d bytes): %s", self.path, path,
                            len(self.storage.read_file(path)), why)
                self._remove(path)
                broken = True
                continue
            blob = self.storage.read_file(path)
            scan = scan_segment(blob, first, last_term)
            pos, nxt, why = scan.end, scan.next_index, scan.why
            if first < start and nxt <= start:
                # Wholly below the start: compaction or clear() left it (its removal was not
                # durable yet). It says nothing about the log above the start: no sequence check.
                self._remove(path)
                last_term = None
                continue
            last_term = scan.last_term
            if why is not None:
                log.warning("journal %s: dropping %d bytes at offset %d of %s (index %d on): %s",
                            self.path, len(blob) - pos, pos, path, nxt, why)
                broken = True
            kept = [i for i, e in enumerate(scan.entries) if e[1] >= start]
            f = self.storage.open(path)
            if why is not None:
                f.truncate(pos)
            segment = _Segment(first, path, f, pos)
            if why is not None:
                self._mark(segment)
            self._segments.append(segment)
            self._entries.extend(scan.entries[i] for i in kept)
            self._offsets.extend(scan.offsets[i] for i in kept)
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
        write_atomic(self.storage, self._file(name), pack_small(value), fsync=fsync and self.fsync)

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
            tail = _Segment(idx, self._file(segment_name(idx)), None, 0)
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
