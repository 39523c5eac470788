"""Group commit (raftps/server/group_commit.py): concurrent writes share log entries, each keeps its own
result and version, and nothing is lost or applied twice. Unit tests over the in-memory log and a
real 3-node cluster under concurrent pushes."""
from __future__ import annotations

import threading
import time

import msgpack
import numpy as np

from raftps.server.group_commit import GroupCommit, pack_batch
from raftps.tools.localcluster import LocalCluster
from raftps.raft import NotApplied, RaftSettings, SnapshotMeta
from raftps.raft.memory import MemoryLog


class Slow:
    """An Applier whose applies take 20 ms, so writes pile up behind the entries in flight."""

    def __init__(self) -> None:
        self.entries: list[bytes] = []
        self.writes: list[bytes] = []

    def apply(self, entry: bytes, index: int):
        time.sleep(0.02)
        self.entries.append(entry)
        cmd = msgpack.unpackb(entry)
        if isinstance(cmd, dict) and cmd.get("op") == "batch":
            self.writes += [msgpack.unpackb(w) for w in cmd["entries"]]
            return [f"r{msgpack.unpackb(w)}" for w in cmd["entries"]]
        self.writes.append(cmd)
        return f"r{cmd}"

    def save_snapshot(self, path: str, meta: SnapshotMeta) -> None: ...

    def load_snapshot(self, path: str) -> SnapshotMeta: ...

    def tick(self) -> None: ...


def test_writes_arriving_during_commits_share_entries_and_keep_their_results(tmp_path) -> None:
    applier = Slow()
    log = MemoryLog(RaftSettings("mem:1", [], str(tmp_path), b""), applier)
    group = GroupCommit(log, in_flight=1)
    results: dict[int, object] = {}
    done = threading.Event()

    def finish(i: int):
        def cb(result, error):
            results[i] = error or result
            if len(results) == 40:
                done.set()
        return cb
    for i in range(40):
        group.propose(msgpack.packb(i), finish(i), alone=(i == 20))
    assert done.wait(10.0)
    group.stop()
    log.stop()
    assert results == {i: f"r{i}" for i in range(40)}
    assert applier.writes == list(range(40)), "writes reordered or lost"
    assert len(applier.entries) < 20, "no write shared an entry"
    assert msgpack.packb(20) in applier.entries, "a write proposed alone was batched"
    assert group.writes == 40 and group.entries == len(applier.entries)


def test_stop_fails_queued_writes_as_not_applied(tmp_path) -> None:
    applier = Slow()
    log = MemoryLog(RaftSettings("mem:1", [], str(tmp_path), b""), applier)
    group = GroupCommit(log, in_flight=1)
    errors: list = []
    for i in range(30):
        group.propose(msgpack.packb(i), lambda r, e: errors.append(e))
    group.stop()
    time.sleep(1.0)
    log.stop()
    refused = [e for e in errors if isinstance(e, NotApplied) and e.applied is False]
    assert refused and len(applier.writes) + len(refused) <= 30


def test_pack_batch_round_trips() -> None:
    assert msgpack.unpackb(pack_batch([b"a", b"bc"])) == {"op": "batch", "entries": [b"a", b"bc"]}


def test_concurrent_pushes_share_entries_exactly_once(tmp_path) -> None:
    cl = LocalCluster(str(tmp_path), nodes=3, base_port=31600)
    try:
        cl.start(timeout=60.0)
        with cl.client(timeout=30.0) as c:
            c.create("ctr", np.zeros(16, np.float64), optimizer={"name": "sgd", "lr": 1.0})
        counts = [0] * 16
        versions: list[int] = []
        lock = threading.Lock()

        def pusher(k: int) -> None:
            grad = np.zeros(16)
            grad[k] = -1.0
            with cl.client(timeout=30.0) as c:
                for _ in range(40):
                    v = c.push({"ctr": grad})
                    with lock:
                        counts[k] += 1
                        versions.append(v)
        threads = [threading.Thread(target=pusher, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120.0)
        assert not any(t.is_alive() for t in threads)
        with cl.client(timeout=30.0) as c:
            tensors, _ = c.pull(["ctr"])
            rows = [r for r in c.status() if r["role"] == "leader"]
        np.testing.assert_array_equal(tensors["ctr"], np.array(counts, np.float64))
        assert len(set(versions)) == len(versions) == 640, "two writes acknowledged at one version"
        lead = rows[0]
        assert lead["writes_proposed"] > lead["entries_proposed"], "16 concurrent writers never shared an entry"
    finally:
        cl.stop()
        cl.drop_payloads()


def test_one_client_keeps_sixteen_pushes_in_flight(tmp_path) -> None:
    """push_async: 16 pushes on their way at once from one Client (each exactly-once with its own
    seq), mixed with plain pushes; the counts come out exact and versions unique."""
    cl = LocalCluster(str(tmp_path), nodes=3, base_port=31650)
    try:
        cl.start(timeout=60.0)
        with cl.client(timeout=30.0) as c:
            c.create("ctr", np.zeros(2, np.float64), optimizer={"name": "sgd", "lr": 1.0})
            entries0 = next(r for r in c.status() if r["role"] == "leader")["entries_proposed"]
            futures = [c.push_async({"ctr": np.array([-1.0, 0.0])}) for _ in range(300)]
            sync_versions = [c.push({"ctr": np.array([0.0, -1.0])}) for _ in range(5)]
            versions = [f.result(timeout=60.0)["version"] for f in futures] + sync_versions
            tensors, _ = c.pull(["ctr"])
            lead = next(r for r in c.status() if r["role"] == "leader")
        np.testing.assert_array_equal(tensors["ctr"], [300.0, 5.0])
        assert len(set(versions)) == 305
        assert lead["entries_proposed"] - entries0 < 305, "pipelined pushes never shared an entry"
    finally:
        cl.stop()
        cl.drop_payloads()
