"""Whether and how a replica's files are made durable: decided here, once, and handed in.

A replica builds one :class:`Durability` from its ``--durability`` setting
(:meth:`Durability.for_mode`) and hands it to every writer of its files, which only obey it (as
hashicorp/raft hands its stores in; as etcd's raftexample keeps durability in one owner):

=================  ======================================  ==========================================
writer             ``none``                                ``fsync``
=================  ======================================  ==========================================
file layer         the real disk (:class:`OSStorage`)      this process's (:func:`process_storage`)
Raft log           pysyncobj's file journal, no fsync      DurableJournal (raft/journal.py), fsynced
term and vote      pysyncobj's meta file, no fsync         the journal's ``term`` file, fsynced
payloads           tmpfs where there is one, no fsync      the data dir, fdatasynced, directory
                                                           fsynced; spares up to the payload budget
snapshots          renamed into place, no fsync            fsynced, renamed, directory fsynced
=================  ======================================  ==========================================

A data dir keeps its mode: one that ran with ``fsync`` refuses to start without it; one that did
not is carried over into the durable journal once (:meth:`Durability.open_journal`).

Test-only overrides enter here and nowhere else: a test tool's simulated disk
(``raftps/chaos/simdisk_node.py`` makes it the process's storage before any node starts, so the
files of every Raft group a process hosts see one power cut), and
``RAFTPS_UNSAFE_<WRITER>_NO_FSYNC=1`` (journal, payload, snapshot), read once when the replica's
Durability is built, which turns off one writer's fsyncs so that a power-cut test can show that
its check catches what they protect (the twins in tests/durability/test_power_cut.py).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from raftps.raft.storage import OSStorage, Storage, process_storage

if TYPE_CHECKING:                                # the journal imports pysyncobj: only when opened
    from raftps.raft.journal import DurableJournal

log = logging.getLogger("raftps.raft.durability")

MODES = ("none", "fsync")
WRITERS = ("journal", "payload", "snapshot")     # the writers a test may run without fsyncs
PLAIN_JOURNAL = "raft.journal"                   # pysyncobj's own journal file, in the data dir
JOURNAL_DIR = "raft.journal.d"                   # the durable journal's directory in the data dir
TMPFS_PREFIX = "raftps-payloads-"                # a node's tmpfs payload dir: this + a hash of its data dir


@dataclass(frozen=True)
class Durability:
    """One replica's durability. Build it with :meth:`for_mode`."""
    mode: str = "none"
    storage: Storage = field(default_factory=OSStorage)    # the file layer of every writer
    unsafe_no_fsync: frozenset[str] = frozenset()          # tests only: writers never fsynced

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"durability must be 'none' or 'fsync', not {self.mode!r}")
        unknown = sorted(set(self.unsafe_no_fsync) - set(WRITERS))
        if unknown:
            raise ValueError(f"unsafe_no_fsync: unknown writers {unknown}; known: {', '.join(WRITERS)}")

    @classmethod
    def for_mode(cls, mode: str, storage: Storage | None = None,
                 env: Mapping[str, str] | None = None) -> Durability:
        """The durability of a replica run with ``--durability mode``. ``storage``: its file
        layer (default: this process's for ``fsync``, the real disk for ``none``). ``env``
        (default: this process's environment) holds the test-only switches."""
        if mode not in MODES:
            raise ValueError(f"durability must be 'none' or 'fsync', not {mode!r}")
        if mode == "none":
            return cls(mode, storage if storage is not None else OSStorage())
        env = os.environ if env is None else env
        unsafe = frozenset(w for w in WRITERS if env.get(unsafe_variable(w)) == "1")
        for writer in sorted(unsafe):
            log.warning("UNSAFE: %s files are never fsynced (%s, tests only)", writer, unsafe_variable(writer))
        return cls(mode, storage if storage is not None else process_storage(), unsafe)

    @property
    def durable(self) -> bool:
        """Whether what is acknowledged survives a power cut (the files are fsynced)."""
        return self.mode == "fsync"

    def _fsyncs(self, writer: str) -> bool:
        return self.durable and writer not in self.unsafe_no_fsync

    @property
    def journal_fsync(self) -> bool:
        return self._fsyncs("journal")

    @property
    def payload_fsync(self) -> bool:
        return self._fsyncs("payload")

    @property
    def snapshot_fsync(self) -> bool:
        return self._fsyncs("snapshot")

    # ---- where the files are ---------------------------------------------------------------

    def payload_dir(self, data_dir: str) -> str:
        """Durable: on the data dir's disk. Otherwise in tmpfs where there is one
        (:func:`default_payload_dir`)."""
        return os.path.join(data_dir, "payloads") if self.durable else default_payload_dir(data_dir)

    def payload_spare_bytes(self, budget: int) -> int | None:
        """Durable: every collected payload file is kept as a spare, up to the budget that forces
        a snapshot, so that new payloads overwrite allocated blocks (payloads.py). None: the
        payload store's default."""
        return budget if self.durable else None

    def plain_journal_file(self, data_dir: str) -> str | None:
        """pysyncobj's own journal file (its ``journalFile``), or None when the durable journal
        takes its place (pysyncobj's is never fsynced)."""
        return None if self.durable else os.path.join(data_dir, PLAIN_JOURNAL)

    def open_journal(self, data_dir: str) -> DurableJournal | None:
        """The durable journal (None: pysyncobj's own file journal). A data dir keeps its mode: one
        that ran durable refuses to start without it (its log is not in pysyncobj's file); one that
        did not is carried over into the durable journal, term and vote included."""
        from raftps.raft.journal import DurableJournal, import_file_journal
        plain, durable_dir = os.path.join(data_dir, PLAIN_JOURNAL), os.path.join(data_dir, JOURNAL_DIR)
        if not self.durable:
            if os.path.isdir(durable_dir):
                raise ValueError(f"{data_dir} was run with --durability fsync: its Raft log is in {durable_dir}; "
                                 "start it with --durability fsync")
            return None
        journal = DurableJournal(durable_dir, storage=self.storage, fsync=self.journal_fsync)
        if os.path.isfile(plain) and len(journal) == 0:
            copied = import_file_journal(plain, journal)
            os.replace(plain, plain + ".imported")
            log.warning("carried %d entries of %s into the durable journal", copied, plain)
        return journal


def unsafe_variable(writer: str) -> str:
    """The test-only switch that turns off ``writer``'s fsyncs."""
    return f"RAFTPS_UNSAFE_{writer.upper()}_NO_FSYNC"


def default_payload_dir(data_dir: str) -> str:
    """Payloads live in tmpfs where there is one: they survive a process crash (the guarantee
    pysyncobj's own unsynced journal gives) and need no disk bandwidth. Three nodes on one disk
    writing every payload measured 117 MB/s of pushes, disk-bound; tmpfs writes 2 GB/s here.
    A snapshot (taken every ``payload_budget`` bytes, and on graceful stop) makes the data dir
    self-contained again."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        tag = hashlib.sha256(os.path.abspath(data_dir).encode()).hexdigest()[:16]
        return f"/dev/shm/{TMPFS_PREFIX}{tag}"
    return os.path.join(data_dir, "payloads")


def sweep_abandoned_payload_dirs(root: str = "/dev/shm") -> None:
    """Remove tmpfs payload dirs whose node's data dir no longer exists (a wiped test run)."""
    try:
        names = [n for n in os.listdir(root) if n.startswith(TMPFS_PREFIX)]
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
