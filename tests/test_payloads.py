"""PayloadStore: files of collected payloads are reused, never read as payloads, bounded."""
from __future__ import annotations

import os

import numpy as np

from raftps.payloads import SPARE_SUFFIX, PayloadStore, payload_id


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


def _received(store: PayloadStore, seq: int, n: int = 1 << 16) -> tuple[str, dict]:
    """A payload the way the data plane receives one: into a reserved file, then committed."""
    import msgpack
    from raftps import codec
    pid, tensors = payload(seq, n)
    buffers = codec.encode({"tensors": tensors})
    header = msgpack.packb({"tensors": {"w": msgpack.ExtType(codec.ARRAY_EXT, msgpack.packb(["float32", [n]]))}},
                           use_bin_type=True)
    assert header == bytes(buffers[1])                  # the file's frame is the one put would write
    r = store.reserve(header, tensors["w"].nbytes)
    r.blob[:] = memoryview(tensors["w"]).cast("B")
    view = codec.decode(r.mm, codec.Limits())["tensors"]
    store.commit(r, pid, view)
    return pid, view


def test_a_payload_received_into_its_file_is_a_normal_payload(tmp_path) -> None:
    store = PayloadStore(str(tmp_path))
    pid, view = _received(store, 1)
    assert store.has(pid) and store.get(pid) is view
    store.applied(pid, index=1)
    assert np.array_equal(store.get(pid)["w"], np.full(1 << 16, 1.0, np.float32))    # from the file
    assert store.disk_bytes == os.path.getsize(tmp_path / pid)
    del view
    store.collect(through_index=1)
    assert len(spares(str(tmp_path))) == 1              # nothing views its mapping: reused
    pid2, _ = payload(2)
    store.put(pid2, payload(2)[1])
    assert spares(str(tmp_path)) == []


def test_a_mapped_payload_file_still_viewed_is_never_reused(tmp_path) -> None:
    store = PayloadStore(str(tmp_path))
    pid, view = _received(store, 1)
    kept = view["w"]                                    # e.g. an array someone still holds
    store.applied(pid, index=1)
    store.collect(through_index=1)
    assert spares(str(tmp_path)) == [] and not store.has(pid)   # unlinked, not a spare
    for seq in range(2, 5):
        p, t = payload(seq)
        store.put(p, t)
    assert np.array_equal(kept, np.full(1 << 16, 1.0, np.float32))   # never overwritten


def test_an_aborted_reservation_leaves_no_payload(tmp_path) -> None:
    store = PayloadStore(str(tmp_path))
    r = store.reserve(b"\x80", 16)
    store.abort(r)
    store.abort(r)                                      # twice is harmless
    assert [n for n in os.listdir(tmp_path) if not n.endswith(SPARE_SUFFIX)] == [] and store.disk_bytes == 0
