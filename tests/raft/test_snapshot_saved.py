"""The optional Applier.snapshot_saved: called once a snapshot file is in place, never when the
save failed. The node drops payload files only from then on; before, a failed rename left the
payloads collected that the older snapshot and the journal still needed."""
from __future__ import annotations

import os
import threading
import time

import pytest

from raftps.raft import RaftSettings
from raftps.raft.durability import Durability
from raftps.raft.memory import MemoryLog
from raftps.raft.pysyncobj_log import SyncObjLog
from raftps.raft.storage import OSStorage

from test_memory_log import Recorder, propose

PORT = 28420


class Saver(Recorder):
    """A Recorder that remembers which snapshots it was told are in place, and whether each file
    was there when it was told."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.saved: list[tuple[int, bool]] = []

    def snapshot_saved(self, meta) -> None:
        self.saved.append((meta.index, os.path.exists(self.path)))


class RenameFails(OSStorage):
    """The real disk, except that renaming a file onto ``target`` fails while ``failing`` is set."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.failing = threading.Event()

    def rename(self, src: str, dst: str) -> None:
        if self.failing.is_set() and os.path.abspath(dst) == os.path.abspath(self.target):
            raise OSError(28, "No space left on device (injected)")
        super().rename(src, dst)


def wait_until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def apply_entries(log, count: int) -> None:
    for i in range(count):
        done, box = propose(log, b"e%d" % i)
        assert done.wait(10) and box[0][1] is None, box


def test_memory_log_tells_after_the_rename(tmp_path) -> None:
    rec = Saver(str(tmp_path / "raft.snapshot"))
    log = MemoryLog(RaftSettings("mem:1", [], str(tmp_path), b""), rec)
    try:
        apply_entries(log, 3)
        log.compact()
        wait_until(lambda: rec.saved)
        assert rec.saved == [(3, True)]
    finally:
        log.stop()


@pytest.mark.parametrize("durability", ["fsync", "none"])
def test_syncobj_log_tells_only_once_the_snapshot_is_in_place(tmp_path, durability) -> None:
    path = str(tmp_path / "raft.snapshot")
    storage = RenameFails(path)
    rec = Saver(path)
    settings = RaftSettings(f"127.0.0.1:{PORT}", [], str(tmp_path), b"",
                            durability=Durability.for_mode(durability, storage=storage),
                            compaction_entries=1_000_000)
    log = SyncObjLog(settings, rec)
    try:
        wait_until(log.is_leader)
        apply_entries(log, 5)
        if durability == "fsync":                 # only the durable path writes through storage
            storage.failing.set()
            log.compact()
            wait_until(lambda: rec.ticks > 40)    # several compaction attempts, all failing
            assert rec.saved == [] and not os.path.exists(path)
            storage.failing.clear()
        log.compact()
        wait_until(lambda: rec.saved)
        index, present = rec.saved[0]
        assert present and index >= 5
    finally:
        log.stop()
