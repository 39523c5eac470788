"""The bytes of a DurableJournal's files: its records, its small files, and reading them back.

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

:func:`scan_segment` reads a segment's records back and says where and why it stops: at the first
record that is short, fails its CRC, or breaks the index sequence or the term chain.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

RECORD = struct.Struct("<QQQQI")         # command length, index, term, previous entry's term, crc32
SMALL_MAGIC = b"RPSJ"
SEGMENT_SUFFIX = ".seg"


class JournalCorrupt(Exception):
    """A small file (term, start) that is not what this journal writes: refuse to guess."""


def encode_record(command: bytes, idx: int, term: int, prev_term: int = 0) -> bytes:
    head = struct.pack("<QQQQ", len(command), idx, term, prev_term)
    return head + struct.pack("<I", zlib.crc32(command, zlib.crc32(head))) + command


def segment_name(first: int) -> str:
    """The file name of the segment whose first record has index ``first``."""
    return f"{first:020d}{SEGMENT_SUFFIX}"


def segment_firsts(names: list[str]) -> list[int]:
    """The first indices of the segments among a directory's ``names``, in order."""
    stems = (n[:-len(SEGMENT_SUFFIX)] for n in names if n.endswith(SEGMENT_SUFFIX))
    return sorted(int(stem) for stem in stems if stem.isdigit())


def pack_small(value: Any) -> bytes:
    body = json.dumps(value, separators=(",", ":")).encode()
    return SMALL_MAGIC + struct.pack("<I", zlib.crc32(body)) + body


def unpack_small(blob: bytes, what: str) -> Any:
    if len(blob) < 8 or blob[:4] != SMALL_MAGIC or struct.unpack("<I", blob[4:8])[0] != zlib.crc32(blob[8:]):
        raise JournalCorrupt(f"{what}: not a valid journal file ({len(blob)} bytes)")
    return json.loads(blob[8:])


@dataclass
class SegmentScan:
    """What :func:`scan_segment` read of one segment."""
    entries: list[tuple[bytes, int, int]] = field(default_factory=list)   # (command, index, term)
    offsets: list[int] = field(default_factory=list)   # each entry's offset in the segment
    end: int = 0                                        # where the last good record ends
    next_index: int = 0                                 # the index a next record would have
    last_term: int | None = None                        # the term of the last good record
    why: str | None = None                              # why it stopped before the end, if it did


def scan_segment(blob: bytes, first: int, last_term: int | None) -> SegmentScan:
    """The good records of a segment starting at index ``first``, whose previous entry had term
    ``last_term`` (None: not known, no chain check for the first record)."""
    scan = SegmentScan(next_index=first, last_term=last_term)
    pos = 0
    while pos < len(blob):
        if pos + RECORD.size > len(blob):
            scan.why = "short record header"
            break
        length, idx, term, prev_term, crc = RECORD.unpack_from(blob, pos)
        end = pos + RECORD.size + length
        if end > len(blob):
            scan.why = f"record of {length} bytes runs past the end"
            break
        command = blob[pos + RECORD.size:end]
        if zlib.crc32(command, zlib.crc32(blob[pos:pos + RECORD.size - 4])) != crc:
            scan.why = "bad crc32"
            break
        if idx != scan.next_index:
            scan.why = f"index {idx}, expected {scan.next_index}"
            break
        if scan.last_term is not None and prev_term != scan.last_term:
            scan.why = f"index {idx} follows a term {prev_term} entry, not this log's term {scan.last_term}"
            break
        scan.entries.append((bytes(command), idx, term))
        scan.offsets.append(pos)
        pos, scan.next_index, scan.last_term = end, scan.next_index + 1, term
    scan.end = pos
    return scan
