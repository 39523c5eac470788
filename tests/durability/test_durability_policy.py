"""raft/durability.py: one Durability per replica decides, for every writer of its files, whether
and how it is made durable; the test-only switches enter there and nowhere else."""
from __future__ import annotations

import os

import pytest

from raftps.chaos.simdisk import SimulatedDisk
from raftps.raft import storage
from raftps.raft.durability import JOURNAL_DIR, PLAIN_JOURNAL, Durability, default_payload_dir, unsafe_variable
from raftps.raft.storage import OSStorage


def test_none_writes_plainly_to_the_real_disk(tmp_path):
    d = Durability.for_mode("none", env={unsafe_variable("journal"): "1"})
    assert isinstance(d.storage, OSStorage) and not d.durable
    assert (d.journal_fsync, d.payload_fsync, d.snapshot_fsync) == (False, False, False)
    assert d.unsafe_no_fsync == frozenset()              # the switches only weaken a durable node
    data = str(tmp_path)
    assert d.plain_journal_file(data) == os.path.join(data, PLAIN_JOURNAL)
    assert d.open_journal(data) is None                  # pysyncobj's own journal
    assert d.payload_dir(data) == default_payload_dir(data)
    assert d.payload_spare_bytes(1 << 30) is None


def test_fsync_makes_every_writer_durable_through_the_process_storage(tmp_path):
    disk = SimulatedDisk(str(tmp_path / "state"))
    before = storage.process_storage()
    try:
        storage.use_storage(disk)
        d = Durability.for_mode("fsync", env={})
    finally:
        storage.use_storage(before)
    assert d.storage is disk and d.durable
    assert (d.journal_fsync, d.payload_fsync, d.snapshot_fsync) == (True, True, True)
    data = str(tmp_path / "data")
    assert d.plain_journal_file(data) is None
    assert d.payload_dir(data) == os.path.join(data, "payloads")
    assert d.payload_spare_bytes(1 << 30) == 1 << 30
    journal = d.open_journal(data)
    assert journal.storage is disk and journal.fsync
    journal._destroy()
    disk.close()


@pytest.mark.parametrize("writer", ["journal", "payload", "snapshot"])
def test_an_unsafe_switch_turns_off_one_writers_fsyncs_only(writer):
    d = Durability.for_mode("fsync", storage=OSStorage(), env={unsafe_variable(writer): "1"})
    fsyncs = {"journal": d.journal_fsync, "payload": d.payload_fsync, "snapshot": d.snapshot_fsync}
    assert fsyncs == {w: w != writer for w in fsyncs}
    assert unsafe_variable(writer) == f"RAFTPS_UNSAFE_{writer.upper()}_NO_FSYNC"


def test_a_bad_mode_or_writer_is_refused():
    with pytest.raises(ValueError, match="durability must be 'none' or 'fsync', not 'sometimes'"):
        Durability.for_mode("sometimes")
    with pytest.raises(ValueError, match="unknown writers"):
        Durability("fsync", OSStorage(), frozenset({"wal"}))


def test_a_data_dir_keeps_its_mode(tmp_path):
    data = str(tmp_path)
    os.makedirs(os.path.join(data, JOURNAL_DIR))
    with pytest.raises(ValueError, match="was run with --durability fsync"):
        Durability.for_mode("none").open_journal(data)


def test_a_plain_journal_is_carried_into_the_durable_one(tmp_path):
    from pysyncobj.journal import FileJournal
    data = str(tmp_path)
    plain = FileJournal(os.path.join(data, PLAIN_JOURNAL))
    for i in range(1, 4):
        plain.add(b"x%d" % i, i, 2)
    plain.setCurrentTerm(2, "peer")
    plain._destroy()
    journal = Durability.for_mode("fsync", storage=OSStorage(), env={}).open_journal(data)
    try:
        assert [e[1] for e in journal[:]] == [1, 2, 3] and journal.getCurrentTerm() == 2
        assert os.path.exists(os.path.join(data, PLAIN_JOURNAL + ".imported"))
    finally:
        journal._destroy()
