"""A synchronous step streamed in chunks (push_step's ``chunk_bytes``, job_steps.py): each Raft
group's part as chunks of whole tensors, each its own aggregation unit and entry. On a real
3-node cluster with two Raft groups: a chunked step leaves the same bits as the same step sent
whole; a contribution sent again (same client and seq) or by a restarted rank counts once; and
a leader SIGKILLed while it holds chunks loses nothing acknowledged."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from raftps import jobs
from raftps.client.client import Client
from raftps.client.job_steps import chunk_job, chunks
from raftps.raft.memory import MemoryLog
from raftps.server.node import NodeConfig, RaftNode
from raftps.server.server import ClientServer
from tests.conftest import start_cluster

BASE = 14000
SGD = {"name": "sgd", "lr": 1.0}
SIZES = {"a": 70_000, "b": 30_000, "c": 50_000, "d": 90_000, "e": 10_000}   # float32 elements
CHUNK = 420_000                     # bytes: whole tensors, up to three chunks per part


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("stream"), BASE, groups=2)
    yield cl
    cl.wipe()


def converged(c, timeout: float = 30.0) -> None:
    """Every node of every Raft group up, each group's members at one applied index and digest."""
    deadline = time.monotonic() + timeout
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = [r for r in c.status() if r["role"] != "down"]
        by_group = {g: [r for r in rows if r["group"] == g] for g in (0, 1)}
        if all(len(rs) == 3 and len({(r["version"], r["digest"]) for r in rs}) == 1
               and any(r["role"] == "leader" for r in rs) for rs in by_group.values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"replicas did not converge: {[(r['group'], r['node'], r['role'], r.get('version')) for r in rows]}")


def gradients(rank: int, seed: int) -> dict[str, np.ndarray]:
    """A rank's gradients: values whose float32 sums round differently by order."""
    rng = np.random.default_rng(seed * 10 + rank)
    return {k: (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32) for k, n in SIZES.items()}


def run_step(cl, prefix: str, job: str, step: int, workers: int, seed: int, answers: list,
             ranks: list[int] | None = None, **kwargs) -> None:
    """Each rank (of ``ranks``, default all) a client of its own, all at once; each answer into
    ``answers[rank]``."""
    def worker(rank: int) -> None:
        with cl.client(timeout=60) as w:
            grads = {f"{prefix}/{k}": v for k, v in gradients(rank, seed).items()}
            answers[rank] = w.push_step(grads, step, workers, job=job, rank=rank, timeout=20.0, pull=True, **kwargs)
    threads = [threading.Thread(target=worker, args=(r,)) for r in (range(workers) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90.0)


def create(c, prefix: str) -> list[str]:
    start = {f"{prefix}/{k}": np.linspace(-1, 1, n, dtype=np.float32) for k, n in SIZES.items()}
    c.create_many(start, {name: SGD for name in start})
    return sorted(start)


def test_chunks_are_whole_tensors_in_name_order_the_same_on_every_rank() -> None:
    part = {k: np.zeros(n, np.float32) for k, n in SIZES.items()}
    assert chunks(part, CHUNK) == [["a", "b"], ["c"], ["d", "e"]]
    assert chunks(part, 0) == [sorted(SIZES)]
    assert chunks(part, 1) == [[k] for k in sorted(SIZES)], "a tensor larger than a chunk goes alone"
    flag = jobs.skip_flag("p")
    assert chunks({**part, flag: np.zeros(1, np.float32)}, CHUNK) == [["a", "b", flag], ["c", flag], ["d", "e", flag]], \
        "a skip flag goes in every chunk"
    assert chunk_job("j", 0) == "j" and chunk_job("j", 2) == "j:chunk2" and chunk_job(None, 1) == ":chunk1"


def test_with_one_raft_group_a_chunked_steps_reply_is_one_groups(tmp_path) -> None:
    """A one-member store over the in-memory log on a real client port: the chunks' replies
    merge into the reply an unchunked step gets (plain values, not {group: value})."""
    config = NodeConfig(node_id=1, peers=[f"127.0.0.1:{BASE + 90}"], data_dir=str(tmp_path / "n1"), secret=b"")
    node = RaftNode(config, log_factory=MemoryLog)
    server = ClientServer(node, *config.bind(config.client_offset))
    address = config.address(1, config.client_offset)
    try:
        with Client(address, timeout=20.0) as c:
            names = {p: create(c, p) for p in ("one", "onec")}
            replies = {}
            for prefix, chunk in (("one", 0), ("onec", CHUNK)):
                grads = {f"{prefix}/{k}": v for k, v in gradients(0, 5).items()}
                replies[prefix] = c.push_step(grads, 0, 1, job=prefix, rank=0, pull=True, chunk_bytes=chunk)
            whole, chunked = replies["one"], replies["onec"]
            assert isinstance(chunked["version"], int) and chunked["count"] == 1 and chunked["applied"] is True
            assert set(whole) == set(chunked), (sorted(whole), sorted(chunked))
            assert sorted(chunked["tensors"]) == names["onec"]
            for k in SIZES:
                assert whole["tensors"][f"one/{k}"].tobytes() == chunked["tensors"][f"onec/{k}"].tobytes()
            assert c.wait_step(0, 5.0, job="onec") == chunked["version"]
    finally:
        server.close()
        node.stop()


def test_a_chunked_step_leaves_the_same_bits_as_the_step_sent_whole(cluster) -> None:
    with cluster.client(timeout=30) as c:
        names = {p: create(c, p) for p in ("whole", "stream")}
        for step in range(2):
            whole: list = [None] * 4
            chunked: list = [None] * 4
            run_step(cluster, "whole", "whole", step, 4, seed=step, answers=whole)
            run_step(cluster, "stream", "stream", step, 4, seed=step, answers=chunked, chunk_bytes=CHUNK)
            assert all(a and a["applied"] and a["count"] == 4 for a in whole + chunked), (whole, chunked)
            assert all(sorted(a["tensors"]) == names["stream"] for a in chunked), "every chunk's answer came back"
        got, _ = c.pull(names["whole"] + names["stream"])
        for k in SIZES:
            assert got[f"whole/{k}"].tobytes() == got[f"stream/{k}"].tobytes(), k
            assert chunked[0]["tensors"][f"stream/{k}"].tobytes() == got[f"stream/{k}"].tobytes()
        # an independent check that the steps applied: two SGD steps of lr 1 on the rank mean
        start = {k: np.linspace(-1, 1, n, dtype=np.float32) for k, n in SIZES.items()}
        for k in SIZES:
            mean = sum(sum(gradients(r, s)[k].astype(np.float64) for r in range(4)) / 4 for s in range(2))
            np.testing.assert_allclose(got[f"stream/{k}"], start[k] - mean, rtol=1e-4, atol=1e-3)
        assert c.sync_applied("stream") == 1 and c.sync_applied("stream:chunk1") == 1
        converged(c)


def test_a_rank_that_skips_a_chunked_step_skips_every_chunk(cluster) -> None:
    with cluster.client(timeout=30) as c:
        names = create(c, "stream2")
        flags = [jobs.skip_flag("stream2", g, 2) for g in range(2)]
        c.create_many({f: np.zeros(1, np.float32) for f in flags}, {f: {"name": "elastic"} for f in flags})
        before, _ = c.pull(names)
        answers: list = [None] * 2

        def worker(rank: int) -> None:
            with cluster.client(timeout=60) as w:
                grads = {f"stream2/{k}": v for k, v in gradients(rank, 3).items()}
                grads.update({f: np.array([float(rank == 1)], np.float32) for f in flags})
                answers[rank] = w.push_step(grads, 0, 2, job="stream2", rank=rank, timeout=20.0, chunk_bytes=CHUNK)
        threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60.0)
        assert all(a and a["applied"] and a["skipped"] for a in answers), answers
        after, _ = c.pull(names)
        for name in names:
            assert after[name].tobytes() == before[name].tobytes(), name


def test_a_resuming_rank_reads_the_lowest_step_every_chunk_applied(cluster) -> None:
    with cluster.client(timeout=30) as c:
        names = create(c, "stream3")
        grads = {f"stream3/{k}": v for k, v in gradients(0, 4).items()}
        c.push_step(grads, 0, 1, job="stream3", rank=0, chunk_bytes=CHUNK)
        # step 1 reaches each group's first chunk only (its rank died before the others)
        first = {n: grads[n] for g in (0, 1) for n in chunks({n: grads[n] for n in names if c.group_of(n) == g}, CHUNK)[0]}
        assert len(first) < len(names), "the test needs a second chunk"
        c.push_step(first, 1, 1, job="stream3", rank=0)
    with cluster.client(timeout=30) as fresh:
        assert fresh.sync_applied("stream3") == 1, "chunk 0's sequence alone"
        rows = {row["name"]: row for row in fresh.tensors("stream3/")}
        fresh.expect_chunks("stream3", {n: (tuple(rows[n]["shape"]), rows[n]["dtype"]) for n in names}, CHUNK)
        assert fresh.sync_applied("stream3") == 0
        assert fresh.wait_step(0, 5.0, job="stream3")


def test_a_contribution_sent_again_or_by_a_restarted_rank_counts_once(cluster) -> None:
    with cluster.client(timeout=30) as c:
        names = create(c, "again")
        with cluster.client(timeout=30) as w:
            grads = {f"again/{k}": v for k, v in gradients(0, 7).items()}
            first = w.push_step(grads, 0, 1, job="again", rank=0, timeout=5.0, chunk_bytes=CHUNK)
            assert first["applied"] and first["count"] == 1
            after, _ = c.pull(names)
            # A retry: the first chunk's request of group 0 sent again with its client id and seq
            # (this session's first write there: seq 1; a chunk's write starts once the one before
            # it has crossed the link, so chunk 0 took the first seq), other bytes this time.
            group0 = {n: v for n, v in grads.items() if w.group_of(n) == 0}
            chunk0 = chunks(group0, CHUNK)[0]
            request = {"op": "push_step", "client": w._router.session.client_id, "seq": 1, "ack": 1, "step": 0,
                       "workers": 1, "rank": 0, "job": "again", "timeout": 5.0,
                       "tensors": {n: group0[n] * 3 for n in chunk0}}
            resent = w._router.request(request, raft_group=0)
            assert resent.get("duplicate") or resent.get("late"), resent
        # rank 0 restarted (a new client) sends the same step again: late in every chunk
        with cluster.client(timeout=30) as w:
            again = w.push_step(grads, 0, 1, job="again", rank=0, timeout=5.0, chunk_bytes=CHUNK)
        assert again["late"], again
        unchanged, _ = c.pull(names)
        for name in names:
            assert unchanged[name].tobytes() == after[name].tobytes(), name
        converged(c)


def test_chunks_held_by_a_killed_leader_are_sent_again_and_count_once(cluster) -> None:
    with cluster.client(timeout=30) as c:
        names = create(c, "k2")
        start, _ = c.pull(names)
        leader = cluster.leader(0)
        answers: list = [None] * 3
        early = threading.Thread(target=run_step, args=(cluster, "k2", "k2", 0, 3, 9, answers, [0, 1]),
                                 kwargs={"chunk_bytes": CHUNK})
        early.start()          # ranks 0 and 1: their chunks wait in the leaders for rank 2's
        deadline = time.monotonic() + 10.0
        while sum(row.get("open_steps") or 0 for row in c.status() if row["group"] == 0) < 3 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(row.get("open_steps") or 0 for row in c.status() if row["group"] == 0) >= 2, \
            "group 0's leader never held the chunks"
        time.sleep(0.3)
        cluster.kill(leader)
        run_step(cluster, "k2", "k2", 0, 3, 9, answers, [2], chunk_bytes=CHUNK)
        early.join(120.0)
        assert all(a and a["applied"] and a["count"] == 3 for a in answers), answers
        got, _ = c.pull(names)
        for k in SIZES:     # one SGD step of lr 1 on the mean of the three ranks: applied once
            mean = sum(gradients(r, 9)[k].astype(np.float64) for r in range(3)) / 3
            np.testing.assert_allclose(got[f"k2/{k}"], start[f"k2/{k}"] - mean, rtol=1e-4, atol=1e-3)
        assert c.sync_applied("k2") == 0
        cluster.start_node(leader)
        converged(c)
