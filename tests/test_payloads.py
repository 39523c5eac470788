"""PayloadStore: files of collected payloads are reused, never read as payloads, bounded."""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from raftps.chaos.simdisk import SimulatedDisk
from raftps.server.payloads import SPARE_SUFFIX, PayloadStore, payload_id
from raftps.raft.storage import OSStorage


def payload(seq: int, n: int = 1 << 16) -> tuple[str, dict]:
    tensors = {"w": np.full(n, float(seq), np.float32)}
    return payload_id("c", seq, tensors), tensors


def spares(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(SPARE_SUFFIX))


def test_collected_payload_files_are_overwritten_by_new_payloads(tmp_path) -> None:
    store = PayloadStore(str(tmp_path))
    pid1, t1 = payload(1)
    store.put(pid1, t1)
    inode = os.stat(tmp_path / pid1).st_ino
    store.applied(pid1, index=5)
    assert store.collect(through_index=5) > 0
    assert not store.has(pid1) and store.get(pid1) is None
    assert len(spares(str(tmp_path))) == 1 and store.disk_bytes == 0

    pid2, t2 = payload(2, n=1000)                  # smaller than the spare: the tail is cut off
    store.put(pid2, t2)
    assert os.stat(tmp_path / pid2).st_ino == inode and spares(str(tmp_path)) == []
    assert store.spare_bytes_held == 0
    store.applied(pid2, index=6)                   # drops the copy in memory: read the file
    assert np.array_equal(store.get(pid2)["w"], t2["w"])
    assert store.disk_bytes == os.path.getsize(tmp_path / pid2)


def test_spares_stay_under_their_budget_and_do_not_survive_a_restart(tmp_path) -> None:
    pid, t = payload(1)
    size_guess = t["w"].nbytes
    store = PayloadStore(str(tmp_path), spare_bytes=int(2.5 * size_guess))
    for seq in range(1, 6):
        pid, t = payload(seq)
        store.put(pid, t)
        store.applied(pid, index=seq)
    store.collect(through_index=5)
    assert len(spares(str(tmp_path))) == 2          # the other three were deleted
    assert store.spare_bytes_held <= store.spare_bytes
    assert sorted(os.listdir(tmp_path)) == spares(str(tmp_path))

    restarted = PayloadStore(str(tmp_path))        # a spare may hold half a write: never kept
    assert spares(str(tmp_path)) == [] and restarted.disk_bytes == 0
    store.drop_spares()                             # the files are gone already: no error


def test_drop_spares_frees_them(tmp_path) -> None:
    store = PayloadStore(str(tmp_path))
    pid, t = payload(1)
    store.put(pid, t)
    store.applied(pid, index=1)
    store.collect(through_index=1)
    store.drop_spares()
    assert os.listdir(tmp_path) == [] and store.spare_bytes_held == 0


def test_sweep_keeps_a_dir_whose_owner_file_is_being_written(tmp_path) -> None:
    """A node starting while another sweeps: an OWNER still empty must not read as abandoned."""
    from raftps.server.node import sweep_abandoned_payload_dirs
    young = tmp_path / "raftps-payloads-young"
    young.mkdir()
    (young / "OWNER").write_text("")
    gone = tmp_path / "raftps-payloads-gone"
    gone.mkdir()
    (gone / "OWNER").write_text(str(tmp_path / "no-such-data-dir") + "\n")
    sweep_abandoned_payload_dirs(str(tmp_path))
    assert young.is_dir() and not gone.exists()


def test_a_payload_id_is_checked_with_the_digest_its_frame_mac_took() -> None:
    """One SHA-256 pass per node: the put frame's blob digest (what the MAC signs) checks the id."""
    from raftps import codec
    from raftps.server.payloads import digest_of, verify, verify_digest
    tensors = {"b": np.arange(6, dtype=np.float64).reshape(2, 3), "a": np.ones(5, np.float32)}
    ordered, digest, content = digest_of(tensors)
    pid = payload_id("c", 7, tensors)
    assert pid == f"c-7-{content}" and list(ordered) == ["a", "b"] and verify(pid, tensors)
    frame = codec.encode({"op": "put", "pid": pid, "tensors": ordered})
    assert codec.blob_digest(frame) == digest                     # what the leader's frame tags sign
    decoded = codec.decode(b"".join(frame))["tensors"]
    assert verify_digest(pid, decoded, digest)
    assert not verify_digest(pid[:-1] + ("0" if pid[-1] != "0" else "1"), decoded, digest)
    changed = {"a": ordered["a"], "b": ordered["b"] + 1}
    assert not verify(pid, changed)                               # other bytes, other id
    assert not verify_digest(pid, {"a": ordered["a"].reshape(5, 1), "b": ordered["b"]}, digest)   # other shape
    unsorted = {"b": ordered["b"], "a": ordered["a"]}             # not in sorted order: a full pass
    assert verify_digest(pid, unsorted, b"not the digest of this order")


def test_a_spare_of_the_right_size_is_chosen(tmp_path) -> None:
    """Of several spares, the smallest that holds the payload (written in place, no new blocks);
    with none big enough, the largest."""
    store = PayloadStore(str(tmp_path))
    sizes = {1: 1 << 10, 2: 1 << 16, 3: 1 << 14}
    for seq, n in sizes.items():
        pid, t = payload(seq, n)
        store.put(pid, t)
        store.applied(pid, index=seq)
    inodes = {seq: os.stat(tmp_path / payload(seq, n)[0]).st_ino for seq, n in sizes.items()}
    store.collect(through_index=3)
    pid, t = payload(4, 1 << 13)                     # fits the 1 << 14 spare, not the 1 << 10 one
    store.put(pid, t)
    assert os.stat(tmp_path / pid).st_ino == inodes[3]
    pid, t = payload(5, 1 << 17)                     # fits none: the largest is extended
    store.put(pid, t)
    assert os.stat(tmp_path / pid).st_ino == inodes[2]
    store.applied(pid, index=5)
    assert np.array_equal(store.get(pid)["w"], t["w"])


def test_durable_puts_share_directory_fsyncs(tmp_path) -> None:
    """A put returns only after a directory fsync that began after its rename; puts that renamed
    while one ran share the next."""
    started, release, synced = threading.Event(), threading.Event(), []

    class SlowDirSync(OSStorage):
        def fsync_dir(self, directory: str) -> None:
            synced.append(sorted(n for n in os.listdir(directory) if not n.endswith(".tmp")))
            if len(synced) == 1:
                started.set()
                release.wait(10)
    store = PayloadStore(str(tmp_path), fsync=True, storage=SlowDirSync())
    first = threading.Thread(target=store.put, args=payload(1))
    first.start()
    assert started.wait(10)                          # the first put's directory fsync is running
    others = [threading.Thread(target=store.put, args=payload(seq)) for seq in (2, 3, 4)]
    for t in others:
        t.start()
    deadline = time.monotonic() + 10
    while store._renames < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for t in [first, *others]:
        t.join(10)
    assert len(synced) == 2                          # one for the first put, one for the other three
    assert synced[1] == sorted(payload(seq)[0] for seq in (1, 2, 3, 4))


def test_durable_payloads_survive_a_power_cut_on_the_simulated_disk(tmp_path) -> None:
    """Every put that returned is there after a cut, into new files and into spares alike; a
    spare's old payload never shows under a new id. Without fsync the same cut loses them."""
    for fsync in (True, False):
        directory, disk = str(tmp_path / f"payloads{fsync}"), SimulatedDisk(str(tmp_path / f"disk{fsync}"))
        store = PayloadStore(directory, fsync=fsync, storage=disk, spare_bytes=1 << 30)
        written = [payload(seq, 1 << 12) for seq in range(1, 5)]
        for index, (pid, tensors) in enumerate(written, 1):
            store.put(pid, tensors)
            store.applied(pid, index)
        store.collect(2)                             # two spares, then overwritten by two new puts
        written += [payload(seq, 1 << 12) for seq in (5, 6)]
        for pid, tensors in written[4:]:
            store.put(pid, tensors)
        assert not spares(directory)
        disk.power_cut("synced")
        disk.close()
        after = PayloadStore(directory, fsync=fsync, storage=OSStorage())
        survived = [pid for pid, tensors in written[2:]
                    if (got := after.get(pid)) is not None and np.array_equal(got["w"], tensors["w"])]
        if fsync:
            assert survived == [pid for pid, _ in written[2:]]
        else:
            assert survived == []
