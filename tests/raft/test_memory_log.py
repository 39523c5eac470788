"""The replica and the client server in one process, over the in-memory ReplicatedLog: the
store's contract without sockets between members or elections (the real log has its own tests)."""
from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest

from raftps.client.client import Client
from raftps.server.node import NodeConfig, RaftNode
from raftps.raft import NotApplied, NotReady, RaftSettings, SnapshotMeta
from raftps.raft.memory import MemoryLog
from raftps.server.server import ClientServer

BASE = 28400


class Recorder:
    """An Applier that keeps what it applied; entries b"wait" are NotReady until `ready` is set."""

    def __init__(self) -> None:
        self.applied: list[tuple[int, bytes]] = []
        self.ready = threading.Event()
        self.ticks = 0

    def apply(self, entry: bytes, index: int) -> int:
        if entry == b"wait" and not self.ready.is_set():
            raise NotReady("not yet")
        self.applied.append((index, entry))
        return index

    def save_snapshot(self, path: str, meta: SnapshotMeta) -> None:
        with open(path, "wb") as f:
            f.write(msgpack.packb([meta.index, self.applied]))

    def load_snapshot(self, path: str) -> SnapshotMeta:
        with open(path, "rb") as f:
            index, applied = msgpack.unpackb(f.read())
        self.applied = [tuple(e) for e in applied]
        return SnapshotMeta((b"", index, 1), (b"", index - 1, 1), [])

    def tick(self) -> None:
        self.ticks += 1


def propose(log: MemoryLog, entry: bytes) -> tuple[threading.Event, list]:
    done, box = threading.Event(), []
    log.propose(entry, lambda result, error: box.append((result, error)) or done.set())
    return done, box


def test_entries_apply_in_order_and_not_ready_holds_the_rest(tmp_path) -> None:
    rec = Recorder()
    log = MemoryLog(RaftSettings("mem:1", [], str(tmp_path), b""), rec)
    try:
        first, _ = propose(log, b"a")
        waiting, _ = propose(log, b"wait")
        after, box = propose(log, b"b")
        assert first.wait(2.0)
        assert not after.wait(0.3), "an entry after a NotReady one was applied first"
        assert rec.applied == [(1, b"a")]
        rec.ready.set()
        log.wake()
        assert after.wait(2.0) and box == [(3, None)]
        assert rec.applied == [(1, b"a"), (2, b"wait"), (3, b"b")]
        assert log.read_index(lambda: len(rec.applied), 2.0) == 3
        assert rec.ticks > 0
    finally:
        log.stop()


def test_snapshot_restores_on_restart(tmp_path) -> None:
    rec = Recorder()
    log = MemoryLog(RaftSettings("mem:1", [], str(tmp_path), b""), rec)
    for e in (b"x", b"y"):
        propose(log, e)[0].wait(2.0)
    log.compact()
    log.read_index(lambda: None, 2.0)
    log.stop()
    again = Recorder()
    log = MemoryLog(RaftSettings("mem:1", [], str(tmp_path), b""), again)
    try:
        assert again.applied == [(1, b"x"), (2, b"y")]
        done, box = propose(log, b"z")
        assert done.wait(2.0) and box == [(3, None)], "the log did not continue after its snapshot"
    finally:
        log.stop()


def test_stop_fails_pending_proposals(tmp_path) -> None:
    rec = Recorder()
    log = MemoryLog(RaftSettings("mem:1", [], str(tmp_path), b""), rec)
    done, box = propose(log, b"wait")
    log.stop()
    assert done.wait(2.0)
    assert isinstance(box[0][1], NotApplied) and box[0][1].applied is None


@pytest.fixture
def store(tmp_path):
    """A one-member store: RaftNode over a MemoryLog, served on a real client port."""
    config = NodeConfig(node_id=1, peers=[f"127.0.0.1:{BASE}"], data_dir=str(tmp_path / "n1"), secret=b"")
    node = RaftNode(config, log_factory=MemoryLog)
    server = ClientServer(node, *config.bind(config.client_offset))
    client = Client(config.address(1, config.client_offset), timeout=10.0)
    yield node, client
    client.close()
    server.close()
    node.stop()


def test_store_over_memory_log(store) -> None:
    node, client = store
    client.create("w", np.ones(4, np.float32), optimizer={"name": "sgd", "lr": 0.5})
    big = np.full((64, 1024), 2.0, np.float32)                     # 256 KiB: through the payload store
    client.create("big", np.zeros_like(big), optimizer={"name": "sgd", "lr": 1.0})
    client.push({"w": np.full(4, 2.0, np.float32), "big": big})
    tensors, version = client.pull(["w", "big"], linearizable=True)
    np.testing.assert_array_equal(tensors["w"], np.zeros(4, np.float32))
    np.testing.assert_array_equal(tensors["big"], -big)
    assert version == node.log.applied_index
    row = client.status()[0]
    assert row["role"] == "leader" and row["applied"] == version and row["digest"]


def test_store_restarts_from_its_snapshot_file(tmp_path) -> None:
    config = NodeConfig(node_id=1, peers=[f"127.0.0.1:{BASE + 1}"], data_dir=str(tmp_path / "n1"), secret=b"")
    node = RaftNode(config, log_factory=MemoryLog)
    server = ClientServer(node, *config.bind(config.client_offset))
    with Client(config.address(1, config.client_offset), timeout=10.0) as client:
        client.create("w", np.arange(8, dtype=np.float32), optimizer={"name": "adam", "lr": 0.1})
        client.push({"w": np.ones(8, np.float32)})
        before = client.status()[0]
    server.close()
    node.stop()                        # a graceful stop writes the snapshot file
    node = RaftNode(config, log_factory=MemoryLog)
    try:
        after = node.status()
        assert (after["version"], after["digest"]) == (before["version"], before["digest"])
        assert after["snapshot_index"] == before["applied"]
    finally:
        node.stop()


def _snapshot_after_pushes(tmp_path, port: int, extra_model: int) -> int:
    """snapshot_index after ten 64 KiB pushes (640 KiB of payload files) to a store of a 64 KiB
    tensor plus ``extra_model`` float32s, with a 256 KiB payload floor and the default budget."""
    config = NodeConfig(node_id=1, peers=[f"127.0.0.1:{port}"], data_dir=str(tmp_path / f"n{port}"), secret=b"",
                        payload_snapshot_floor=256 << 10)
    node = RaftNode(config, log_factory=MemoryLog)
    server = ClientServer(node, *config.bind(config.client_offset))
    try:
        with Client(config.address(1, config.client_offset), timeout=10.0) as client:
            client.create("w", np.zeros(1 << 14, np.float32), optimizer={"name": "sgd", "lr": 0.1})
            if extra_model:
                client.create("big", np.zeros(extra_model, np.float32), optimizer={"name": "sgd", "lr": 0.1})
            for step in range(10):
                client.push({"w": np.full(1 << 14, float(step + 1), np.float32)})
            deadline = time.monotonic() + 3.0                 # a tick or two after the last push
            while node.status()["snapshot_index"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            return node.status()["snapshot_index"]
    finally:
        server.close()
        node.stop()


def test_payload_files_call_for_a_snapshot_in_proportion_to_the_store(tmp_path) -> None:
    """A small store snapshots once its payload files pass max(floor, 4 x its bytes), long before
    the 512 MiB budget (so the files become spares early); a store four times the payloads'
    bytes does not."""
    assert _snapshot_after_pushes(tmp_path, BASE + 10, extra_model=0) > 0          # 640 KiB > 256 KiB
    assert _snapshot_after_pushes(tmp_path, BASE + 20, extra_model=1 << 18) == 0    # 640 KiB < 4 x 1.06 MiB
