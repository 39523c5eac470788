"""DurableJournal on real files: round trips, torn tails, compaction, segments, group commit, term/vote."""

from __future__ import annotations

import logging
import os
import random
import shutil

import pytest
from pysyncobj.journal import Journal

from raftps.raft.journal import RECORD, DurableJournal, JournalCorrupt, encode_record
from raftps.chaos.simdisk import SimulatedDisk


def entries(n: int, first: int = 1, term: int = 1, size: int = 40) -> list[tuple[bytes, int, int]]:
    rng = random.Random(first * 7919 + n)
    return [(bytes(rng.getrandbits(8) for _ in range(size)), i, term) for i in range(first, first + n)]


def fill(j: DurableJournal, items) -> None:
    for e in items:
        j.add(*e)


def segments(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".seg"))


@pytest.fixture
def disk(tmp_path):
    d = SimulatedDisk(str(tmp_path / "state"))
    yield d
    d.close()


def test_implements_pysyncobjs_journal_interface():
    names = [n for n in vars(Journal) if not n.startswith("__") or n in ("__getitem__", "__len__")]
    for name in names:
        assert getattr(DurableJournal, name) is not getattr(Journal, name) or name == "onOneSecondTimer", name


def test_round_trip_and_indexing(tmp_path):
    items = entries(50)
    j = DurableJournal(str(tmp_path / "j"))
    fill(j, items)
    j.setCurrentTerm(4, "127.0.0.1:1")
    j.setRaftCommitIndex(30)
    j._destroy()
    j = DurableJournal(str(tmp_path / "j"))
    assert len(j) == 50 and list(j[:]) == items
    assert j[-1] == items[-1] and j[3:7] == items[3:7] and j[0] == items[0]
    assert (j.getCurrentTerm(), j.getVotedForNodeId(), j.getRaftCommitIndex()) == (4, "127.0.0.1:1", 30)
    assert j.durable_index == 50


def test_empty_journal_defaults(tmp_path):
    j = DurableJournal(str(tmp_path / "j"))
    assert (len(j), j.getCurrentTerm(), j.getVotedForNodeId(), j.getRaftCommitIndex()) == (0, 0, None, 1)


def test_add_refuses_a_gap(tmp_path):
    j = DurableJournal(str(tmp_path / "j"))
    fill(j, entries(3))
    with pytest.raises(ValueError):
        j.add(b"x", 5, 1)


def test_torn_tail_at_every_byte_offset_of_the_last_record(tmp_path, caplog):
    """Cut (and separately corrupt) the last record at every byte: reopening drops exactly it."""
    src = str(tmp_path / "src")
    j = DurableJournal(src)
    items = entries(5, size=30)
    fill(j, items)
    j._destroy()
    seg = os.path.join(src, segments(src)[0])
    whole = os.path.getsize(seg)
    last = len(encode_record(*items[-1]))
    assert last == RECORD.size + 30
    for cut in range(whole - last, whole):
        for damage in ("truncate", "flip"):
            case = str(tmp_path / f"{damage}{cut}")
            shutil.copytree(src, case)
            path = os.path.join(case, segments(case)[0])
            with open(path, "r+b") as f:
                if damage == "truncate":
                    f.truncate(cut)
                else:
                    f.seek(cut)
                    byte = f.read(1)
                    f.seek(cut)
                    f.write(bytes([byte[0] ^ 0x40]))
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="raftps.raft.journal"):
                j = DurableJournal(case)
            assert list(j[:]) == items[:4], (damage, cut)
            dropped = whole - (whole - last)
            assert any(f"dropping {dropped if damage == 'flip' else cut - (whole - last)} bytes" in r.message
                       for r in caplog.records) or (damage == "truncate" and cut == whole - last), \
                (damage, cut, [r.message for r in caplog.records])
            assert os.path.getsize(path) == whole - last        # the bad tail is gone from the file
            j.add(b"again", 5, 2)                                # and the log carries on
            j._destroy()
            assert DurableJournal(case)[-1] == (b"again", 5, 2)


def test_damage_in_an_earlier_segment_drops_the_later_ones(tmp_path, caplog):
    path = str(tmp_path / "j")
    j = DurableJournal(path, segment_size=200)
    items = entries(20, size=30)
    fill(j, items)
    j._destroy()
    names = segments(path)
    assert len(names) >= 4
    with open(os.path.join(path, names[1]), "r+b") as f:
        f.truncate(os.path.getsize(f.name) - 1)
    with caplog.at_level(logging.WARNING, logger="raftps.raft.journal"):
        j = DurableJournal(path, segment_size=200)
    first_lost = int(names[2][:-4]) - 1
    assert list(j[:]) == items[:first_lost - 1]
    assert segments(path) == names[:2]
    assert any("dropping segment" in r.message for r in caplog.records)


def test_many_segments_instead_of_a_4_gib_offset(tmp_path):
    """pysyncobj's FileJournal stores u32 offsets: 4 GiB at most. Here a segment ends at
    ``segment_size`` (tiny here, to cross hundreds of boundaries cheaply) and offsets are per
    segment, so the log's size has no limit; reopening reads across every boundary."""
    path = str(tmp_path / "j")
    j = DurableJournal(path, segment_size=1024)
    items = entries(2000, size=100)
    fill(j, items)
    j.sync()
    assert len(segments(path)) >= 200
    j.deleteEntriesFrom(1500)                    # truncation across segments
    fill(j, entries(10, first=1501, term=2))
    j._destroy()
    j = DurableJournal(path, segment_size=1024)
    assert list(j[:]) == items[:1500] + entries(10, first=1501, term=2)


def test_restart_after_compaction_keeps_untouched_segments(tmp_path):
    path = str(tmp_path / "j")
    j = DurableJournal(path, segment_size=500)
    items = entries(100, size=30)
    fill(j, items)
    j.sync()
    before = {n: os.stat(os.path.join(path, n)) for n in segments(path)}
    j.deleteEntriesTo(60)                        # compaction: keep entries 61..100
    assert j[0] == items[60] and len(j) == 40
    after = segments(path)
    assert len(after) < len(before)
    for name in after:                           # dropped whole or left alone, never rewritten
        st = os.stat(os.path.join(path, name))
        assert (st.st_ino, st.st_size, st.st_mtime_ns) == \
            (before[name].st_ino, before[name].st_size, before[name].st_mtime_ns)
    fill(j, entries(5, first=101))
    j._destroy()
    j = DurableJournal(path, segment_size=500)
    assert list(j[:]) == items[60:] + entries(5, first=101)


def test_compaction_survives_a_power_cut(disk, tmp_path):
    path = str(tmp_path / "j")
    j = DurableJournal(path, storage=disk, segment_size=500)
    items = entries(100, size=30)
    fill(j, items)
    j.sync()
    j.deleteEntriesTo(60)
    disk.power_cut("synced")
    j = DurableJournal(path, storage=disk, segment_size=500)
    assert list(j[:]) == items[60:]


def test_clear_then_snapshot_entries_survive_a_restart(disk, tmp_path):
    """pysyncobj's snapshot install: clear() and the snapshot's two entries, far above the log."""
    path = str(tmp_path / "j")
    j = DurableJournal(path, storage=disk, segment_size=300)
    fill(j, entries(30))
    j.sync()
    j.clear()
    snap = entries(2, first=500, term=3)
    fill(j, snap)
    j.sync()
    disk.power_cut("synced")
    j = DurableJournal(path, storage=disk, segment_size=300)
    assert list(j[:]) == snap


def test_group_commit_one_fsync_for_many_appends(disk, tmp_path):
    j = DurableJournal(str(tmp_path / "j"), storage=disk)
    fill(j, entries(1))                          # the first entry also writes the start file
    start_fsyncs, start_dir = disk.fsyncs, disk.dir_fsyncs
    j.sync()                                     # the first segment: its file and its name
    assert (disk.fsyncs - start_fsyncs, disk.dir_fsyncs - start_dir) == (1, 1)
    for n in (1, 16, 64):
        before = disk.fsyncs
        fill(j, entries(n, first=len(j) + 1))
        assert j.durable_index == len(j) - n
        assert j.sync() == len(j) == j.durable_index
        assert disk.fsyncs - before == 1, n
    before = (disk.fsyncs, disk.dir_fsyncs)
    j.sync()                                     # nothing new: nothing to do
    assert (disk.fsyncs, disk.dir_fsyncs) == before


def test_unsynced_appends_are_lost_synced_ones_kept(disk, tmp_path):
    path = str(tmp_path / "j")
    j = DurableJournal(path, storage=disk)
    items = entries(20)
    fill(j, items[:12])
    j.sync()
    fill(j, items[12:])
    disk.power_cut("synced")
    assert list(DurableJournal(path, storage=disk)[:]) == items[:12]


@pytest.mark.parametrize("seed", range(25))
def test_torn_cut_leaves_a_prefix_at_least_as_long_as_the_durable_one(tmp_path, seed):
    disk = SimulatedDisk(str(tmp_path / "state"), seed=seed)
    path = str(tmp_path / "j")
    rng = random.Random(seed)
    j = DurableJournal(path, storage=disk, segment_size=rng.choice([200, 1000, 1 << 20]))
    items = entries(60, size=rng.randint(1, 50))
    synced = 0
    for e in items:
        j.add(*e)
        if rng.random() < 0.15:
            synced = j.sync()
    disk.power_cut("torn")
    got = list(DurableJournal(path, storage=disk)[:])
    assert got == items[:len(got)] and len(got) >= synced
    disk.close()


def test_truncation_not_synced_comes_back_whole(disk, tmp_path):
    """A follower's unsynced overwrite of a conflicting suffix: a cut restores the old log, a
    state it had and acknowledged, never a mix."""
    path = str(tmp_path / "j")
    j = DurableJournal(path, storage=disk, segment_size=400)
    old = entries(30, term=1)
    fill(j, old)
    j.sync()
    j.deleteEntriesFrom(10)
    new = entries(5, first=11, term=2)
    fill(j, new)
    assert j.durable_index == 10
    disk.power_cut("synced")
    j = DurableJournal(path, storage=disk, segment_size=400)
    assert list(j[:]) == old
    j.deleteEntriesFrom(10)
    fill(j, new)
    j.sync()
    disk.power_cut("synced")
    assert list(DurableJournal(path, storage=disk, segment_size=400)[:]) == old[:10] + new


def test_term_and_vote_are_durable_when_set_current_term_returns(disk, tmp_path):
    path = str(tmp_path / "j")
    j = DurableJournal(path, storage=disk)
    j.setCurrentTerm(7, "node-b")
    disk.power_cut("synced")
    j = DurableJournal(path, storage=disk)
    assert (j.getCurrentTerm(), j.getVotedForNodeId()) == (7, "node-b")


def test_term_and_vote_without_fsync_are_lost(disk, tmp_path):
    path = str(tmp_path / "j")
    j = DurableJournal(path, storage=disk, fsync=False)
    j.setCurrentTerm(7, "node-b")
    disk.power_cut("synced")
    j = DurableJournal(path, storage=disk, fsync=False)
    assert (j.getCurrentTerm(), j.getVotedForNodeId()) == (0, None)


class DiesAfter(SimulatedDisk):
    """A disk whose power fails after its first ``budget`` logged operations (mid-setCurrentTerm)."""

    budget = 10 ** 9

    def _log(self, header, data=b""):
        if self.budget <= 0:
            raise OSError("power failed")
        self.budget -= 1
        super()._log(header, data)


@pytest.mark.parametrize("mode", ["synced", "torn"])
def test_term_and_vote_are_atomic_under_a_cut_at_every_step(tmp_path, mode):
    """A cut after each operation of setCurrentTerm: the old pair or the new one, never a mix."""
    outcomes = set()
    for step in range(12):
        disk = DiesAfter(str(tmp_path / f"state{step}"), seed=step)
        path = str(tmp_path / f"j{step}")
        j = DurableJournal(path, storage=disk)
        j.setCurrentTerm(3, "old")
        disk.budget = step
        try:
            j.setCurrentTerm(4, "new")
            finished = True
        except OSError:
            finished = False
        disk.budget = 10 ** 9
        disk.power_cut(mode)
        j = DurableJournal(path, storage=disk)
        pair = (j.getCurrentTerm(), j.getVotedForNodeId())
        assert pair in {(3, "old"), (4, "new")}, (step, pair)
        if finished:
            assert pair == (4, "new"), step
        outcomes.add(pair)
        disk.close()
    assert outcomes == {(3, "old"), (4, "new")}


def test_a_corrupt_term_file_is_refused(tmp_path):
    path = str(tmp_path / "j")
    DurableJournal(path).setCurrentTerm(2, None)
    with open(os.path.join(path, "term"), "r+b") as f:
        f.seek(9)
        f.write(b"X")
    with pytest.raises(JournalCorrupt):
        DurableJournal(path)


def test_no_fsync_mode_never_fsyncs(disk, tmp_path):
    path = str(tmp_path / "j")
    j = DurableJournal(path, storage=disk, fsync=False, segment_size=300)
    fill(j, entries(40))
    j.setCurrentTerm(2, "x")
    j.sync()
    j.deleteEntriesTo(20)
    j.onOneSecondTimer()
    assert (disk.fsyncs, disk.dir_fsyncs) == (0, 0)
    assert j.durable_index == 40
    j._destroy()
    assert list(DurableJournal(path, storage=disk, fsync=False)[:]) == entries(40)[20:]


def test_commit_hint_never_passes_the_durable_log(disk, tmp_path):
    from raftps.raft.journal_format import unpack_small
    path = str(tmp_path / "j")
    j = DurableJournal(path, storage=disk)
    fill(j, entries(10))
    j.sync()
    fill(j, entries(10, first=11))
    j.setRaftCommitIndex(18)
    j.onOneSecondTimer()                         # 18 is not durable here: the hint says 10
    with open(os.path.join(path, "commit"), "rb") as f:
        assert unpack_small(f.read(), "commit") == {"commit": 10}
    j.sync()
    j.onOneSecondTimer()
    assert DurableJournal(path, storage=disk).getRaftCommitIndex() == 18
    for seed in range(10):                       # never past the log that survives a cut
        j = DurableJournal(path, storage=disk)
        fill(j, entries(5, first=len(j) + 1))
        j.setRaftCommitIndex(len(j))
        j.onOneSecondTimer()
        disk.power_cut("torn", seed=seed)
        j = DurableJournal(path, storage=disk)
        assert 1 <= j.getRaftCommitIndex() <= len(j)


def test_import_of_a_pysyncobj_file_journal(tmp_path):
    from pysyncobj.journal import FileJournal

    from raftps.raft.journal import import_file_journal
    old_path = str(tmp_path / "raft.journal")
    old = FileJournal(old_path)
    items = entries(30)
    for e in items:
        old.add(*e)
    old.setCurrentTerm(5, "127.0.0.1:9")
    old.setRaftCommitIndex(25)
    old.onOneSecondTimer()
    old._destroy()
    j = DurableJournal(str(tmp_path / "j"))
    assert import_file_journal(old_path, j) == 30
    j._destroy()
    j = DurableJournal(str(tmp_path / "j"))
    assert list(j[:]) == items
    assert (j.getCurrentTerm(), j.getVotedForNodeId(), j.getRaftCommitIndex()) == (5, "127.0.0.1:9", 25)
    with pytest.raises(ValueError):
        import_file_journal(old_path, j)


class FailingFsync(SimulatedDisk):
    fail = False

    def _log(self, header, data=b""):
        if self.fail and header[0] == "fsync":
            raise OSError(5, "Input/output error")
        super()._log(header, data)


def test_a_failed_fsync_stops_the_journal_for_good(tmp_path):
    from raftps.raft.journal import JournalFailed
    disk = FailingFsync(str(tmp_path / "state"))
    j = DurableJournal(str(tmp_path / "j"), storage=disk)
    fill(j, entries(5))
    assert j.sync() == 5
    fill(j, entries(5, first=6))
    disk.fail = True
    with pytest.raises(JournalFailed):
        j.sync()
    disk.fail = False                            # the disk "recovers": a retry must not pass
    with pytest.raises(JournalFailed):
        j.sync()
    assert j.durable_index == 5 and j.failed is not None
    disk.close()


def test_old_segments_left_by_clear_do_not_hide_the_new_log(tmp_path):
    """clear() + snapshot entries far above: if the old segments' removal is lost but the start
    record is not, reopening skips them instead of calling the new log a gap."""
    path = str(tmp_path / "j")
    j = DurableJournal(path, segment_size=300)
    fill(j, entries(30))
    j._destroy()
    saved = {n: open(os.path.join(path, n), "rb").read() for n in segments(path)}
    j = DurableJournal(path, segment_size=300)
    j.clear()
    snap = entries(3, first=500, term=3)
    fill(j, snap)
    j._destroy()
    for name, blob in saved.items():             # the old segments reappear (an undone unlink)
        with open(os.path.join(path, name), "wb") as f:
            f.write(blob[:len(blob) - 3] if name == max(saved) else blob)   # one of them torn
    j = DurableJournal(path, segment_size=300)
    assert list(j[:]) == snap
    assert segments(path) == [f"{500:020d}.seg"]


def test_a_resurrected_old_segment_is_not_joined_to_a_rewritten_one(tmp_path):
    """deleteEntriesFrom removes a later segment and the log is rewritten up to exactly where that
    segment began; a cut that undoes the removal (the old file reappears, indices following on)
    must not give the mixed log: the term chain breaks at the junction."""
    path = str(tmp_path / "j")
    old = entries(20, term=5, size=30)
    record = len(encode_record(*old[0]))
    j = DurableJournal(path, segment_size=10 * record)   # 10 records a segment
    fill(j, old)
    j._destroy()
    second = f"{11:020d}.seg"
    saved = open(os.path.join(path, second), "rb").read()
    j = DurableJournal(path, segment_size=10 * record)
    j.deleteEntriesFrom(4)                               # keep 1..4, drop 5..20 (and segment 11)
    new = entries(6, first=5, term=6, size=30)           # 5..10: the first segment is full again
    fill(j, new)
    j._destroy()
    assert segments(path) == [f"{1:020d}.seg"]
    with open(os.path.join(path, second), "wb") as f:    # the undone unlink
        f.write(saved)
    j = DurableJournal(path, segment_size=10 * record)
    assert list(j[:]) == old[:4] + new


@pytest.mark.parametrize("seed", range(int(os.environ.get("RANDOM_CUT_SEEDS", "40"))))
def test_random_operations_and_cuts(tmp_path, seed):
    """Random appends, syncs, truncations (with a new term, as after a leader change), compactions,
    snapshot installs (clear + two entries far above) and term changes, with a power cut (synced or
    torn) every few dozen operations. After each cut the reopened log must be a window of a log this
    journal really held (never a mix), keep everything synced if nothing was truncated since, and
    the term must be at least the last one set."""
    rng = random.Random(seed)
    disk = SimulatedDisk(str(tmp_path / "state"), seed=seed)
    path = str(tmp_path / "j")
    size = rng.choice([150, 400, 1 << 20])
    j = DurableJournal(path, storage=disk, segment_size=size)
    term, set_term = 1, 0

    def entry(idx: int, t: int) -> tuple[bytes, int, int]:
        return (f"{idx}:{t}".encode() * rng.randint(1, 3), idx, t)   # same (idx, term): same entry

    for _ in range(4):
        held: list[dict[int, tuple]] = [{e[1]: e for e in j[:]}]
        synced_last, truncated = j.durable_index, False
        for _ in range(rng.randint(10, 60)):
            op = rng.random()
            last = j[-1][1] if len(j) else 0
            if op < 0.45:
                for _ in range(rng.randint(1, 5)):
                    last += 1
                    cmd, _, t = entry(last, term)
                    j.add(f"{last}:{t}".encode(), last, t)
            elif op < 0.65:
                synced_last, truncated = j.sync(), False
            elif op < 0.75 and len(j) > 1:
                j.deleteEntriesFrom(rng.randint(1, len(j) - 1))
                term += 1
                truncated = True
            elif op < 0.82 and len(j) > 2:
                j.deleteEntriesTo(rng.randint(1, len(j) - 2))
            elif op < 0.86:
                j.clear()
                term += 1
                base = last + rng.randint(1, 50)
                j.add(f"{base}:{term}".encode(), base, term)
                j.add(f"{base + 1}:{term}".encode(), base + 1, term)
                truncated = True
            else:
                term += 1
                j.setCurrentTerm(term, rng.choice([None, "a", "b"]))
                set_term = term
            held.append({e[1]: e for e in j[:]})
        mode = rng.choice(["synced", "torn"])
        disk.power_cut(mode, seed=rng.randint(0, 10 ** 6))
        j = DurableJournal(path, storage=disk, segment_size=size)
        got = list(j[:])
        assert [e[1] for e in got] == list(range(got[0][1], got[0][1] + len(got))) if got else True
        assert any(all(state.get(e[1]) == e for e in got) for state in held), (mode, got[:3], got[-3:])
        if mode == "synced" and not truncated and synced_last:
            assert got and got[-1][1] >= synced_last, (synced_last, got[-1:] if got else None)
        assert j.getCurrentTerm() >= set_term
    disk.close()
