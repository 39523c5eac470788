"""Sync steps aggregated on the leader (push_step, aggregate.py): one entry per step, the mean of
its contributions applied once, a dead worker given up after the step's timeout, contributions
sent again after a leader dies counted once. In one process over the in-memory log, and on a real
3-node cluster with the leader SIGKILLed while it holds a step's contributions."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import raftps
from raftps.client.client import Client
from raftps.server.node import NodeConfig, RaftNode
from raftps.raft.memory import MemoryLog
from raftps.server.server import ClientServer
from tests.conftest import wait_converged

BASE = 31000


@pytest.fixture
def store(tmp_path):
    """A one-member store over the in-memory log, served on a real client port."""
    config = NodeConfig(node_id=1, peers=[f"127.0.0.1:{BASE}"], data_dir=str(tmp_path / "n1"), secret=b"")
    node = RaftNode(config, log_factory=MemoryLog)
    server = ClientServer(node, *config.bind(config.client_offset))
    address = config.address(1, config.client_offset)
    yield node, address
    server.close()
    node.stop()


def contribute_all(address: str, grads: list[np.ndarray], step: int, workers: int, **kwargs) -> list[dict]:
    """Each grad from its own worker (a client of its own), all at once; their answers by rank."""
    answers: list = [None] * len(grads)

    def worker(rank: int) -> None:
        with Client(address, timeout=20.0) as c:
            answers[rank] = c.push_step({"w": grads[rank]}, step, workers, job="job", rank=rank, **kwargs)
    threads = [threading.Thread(target=worker, args=(r,)) for r in range(len(grads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert all(a is not None for a in answers), answers
    return answers


def test_a_step_is_one_entry_with_the_mean_of_its_contributions(store) -> None:
    node, address = store
    with Client(address, timeout=10.0) as c:
        c.create("w", np.zeros(6, np.float32), {"name": "sgd", "lr": 1.0})
        before = node.version
        grads = [np.full(6, float(r + 1), np.float32) for r in range(4)]
        answers = contribute_all(address, grads, 0, 4)
        assert {a["version"] for a in answers} == {before + 1}, "a step is one write, one version"
        assert all(a["applied"] and a["count"] == 4 and a["step"] == 0 for a in answers)
        assert node.version == before + 1 and node.stats()["pushes"] == 1
        np.testing.assert_array_equal(c.pull(["w"])[0]["w"], np.full(6, -2.5, np.float32))     # -(1+2+3+4)/4
        assert c.sync_applied("job") == 0
        assert c.status()[0]["open_steps"] == 0

        # pull=True: each answer carries the step's values as its entry left them
        answers = contribute_all(address, grads, 1, 4, pull=True)
        want = np.full(6, -5.0, np.float32)
        for a in answers:
            np.testing.assert_array_equal(a["tensors"]["w"], want)
            assert a["tensor_versions"]["w"] == 2 and a["version"] == before + 2
        np.testing.assert_array_equal(c.pull(["w"])[0]["w"], want)


def test_a_missing_worker_is_given_up_after_the_timeout_and_a_late_one_is_told(store) -> None:
    node, address = store
    with Client(address, timeout=10.0) as c:
        c.create("w", np.zeros(3, np.float64), {"name": "sgd", "lr": 1.0})
        answers = contribute_all(address, [np.ones(3), np.full(3, 3.0)], 0, 3, timeout=0.5)
        assert all(a["applied"] and a["count"] == 2 for a in answers)
        late = c.push_step({"w": np.full(3, 100.0)}, 0, 3, job="job", rank=2)
        assert late["late"] and late["applied"]
        np.testing.assert_array_equal(c.pull(["w"])[0]["w"], np.full(3, -2.0))   # the mean of 1 and 3, once


def test_a_contribution_sent_again_finds_its_answer_and_a_restarted_rank_counts_once(store) -> None:
    node, address = store
    with Client(address, timeout=10.0) as c:
        c.create("w", np.zeros(2, np.float32), {"name": "sgd", "lr": 1.0})
    request = {"op": "push_step", "client": "worker-0", "seq": 1, "ack": 1, "step": 0, "workers": 2, "rank": 0,
               "job": "job", "timeout": 10.0, "tensors": {"w": np.ones(2, np.float32)}}
    answers: dict[str, dict] = {}

    def send(key: str, message: dict) -> None:
        with Client(address, timeout=20.0) as c:
            answers[key] = c._router.request(message, attempt_timeout=20.0)
    first = threading.Thread(target=send, args=("first", request))
    first.start()
    # rank 0 again from a restarted worker (a new client id): it joins the step, uncounted
    again = threading.Thread(target=send, args=("restarted", {**request, "client": "worker-0b",
                                                               "tensors": {"w": np.full(2, 50.0, np.float32)}}))
    time.sleep(0.3)
    again.start()
    time.sleep(0.3)
    with Client(address, timeout=20.0) as c:
        other = c.push_step({"w": np.full(2, 3.0, np.float32)}, 0, 2, job="job", rank=1)
    first.join(20.0)
    again.join(20.0)
    assert other["count"] == 2 and answers["first"]["count"] == 2
    assert answers["restarted"].get("duplicate_rank"), answers["restarted"]
    # the first request sent again after its step applied: its session's answer, no second count
    with Client(address, timeout=20.0) as c:
        resent = c._router.request(request)
        assert resent.get("duplicate") and resent["version"] == answers["first"]["version"]
        np.testing.assert_array_equal(c.pull(["w"])[0]["w"], np.full(2, -2.0, np.float32))
    assert node.stats()["pushes"] == 1


def test_bad_contributions_are_refused_and_change_nothing(store) -> None:
    node, address = store
    with Client(address, timeout=10.0) as c:
        c.create("w", np.zeros(4, np.float32), {"name": "sgd", "lr": 1.0})
        version = node.version
        with pytest.raises(raftps.ShapeMismatch, match="gradient shape"):
            c.push_step({"w": np.ones(5, np.float32)}, 0, 2, timeout=0.2)
        with pytest.raises(raftps.DtypeMismatch):
            c.push_step({"w": np.ones(4, np.float64)}, 0, 2, timeout=0.2)
        with pytest.raises(raftps.UnknownTensor):
            c.push_step({"nope": np.ones(4, np.float32)}, 0, 2, timeout=0.2)
        with pytest.raises(raftps.InvalidGradient, match="NaN"):
            c.push_step({"w": np.array([1, np.nan, 0, 0], np.float32)}, 0, 2, timeout=0.2)
        with pytest.raises(raftps.InvalidRequest, match=r"rank: expected an int in \[0, workers=2\)"):
            c.push_step({"w": np.ones(4, np.float32)}, 0, 2, rank=2, timeout=0.2)
        with pytest.raises(ValueError, match="timeout"):
            c.push_step({"w": np.ones(4, np.float32)}, 0, 2, timeout=float("nan"))
        with pytest.raises(raftps.InvalidRequest, match="timeout"):     # the node checks it too
            c._router.request({"op": "push_step", "client": "x", "seq": 1, "step": 0, "workers": 2, "timeout": float("nan"),
                        "tensors": {"w": np.ones(4, np.float32)}})
        assert node.version == version and c.status()[0]["open_steps"] == 0

        # a contribution that does not match its step's first one is refused; the step goes on
        held = threading.Thread(target=lambda: c.push_step({"w": np.ones(4, np.float32)}, 1, 2, timeout=5.0))
        held.start()
        deadline = time.monotonic() + 5.0
        with Client(address, timeout=10.0) as other:
            while other.status()[0]["open_steps"] == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            with pytest.raises(raftps.InvalidRequest, match="does not match"):
                other.push_step({"w": np.ones(4, np.float32)}, 1, 3, timeout=5.0)
            assert other.push_step({"w": np.full(4, 3.0, np.float32)}, 1, 2, timeout=5.0)["count"] == 2
        held.join(10.0)
        np.testing.assert_array_equal(c.pull(["w"])[0]["w"], np.full(4, -2.0, np.float32))


def test_contributions_held_by_a_killed_leader_are_sent_again_and_count_once(make_cluster) -> None:
    cl = make_cluster(BASE + 100)
    big = 300_000                                 # 1.2 MB float32: through the payload store
    with cl.client(timeout=30) as c:
        c.create("w", np.zeros(big, np.float32), {"name": "sgd", "lr": 1.0})
        leader = cl.leader()
        answers: list = [None] * 3

        def worker(rank: int) -> None:
            with cl.client(timeout=60) as w:
                answers[rank] = w.push_step({"w": np.full(big, float(rank + 1), np.float32)}, 0, 3,
                                            job="job", rank=rank, timeout=20.0)
        early = [threading.Thread(target=worker, args=(r,)) for r in (0, 1)]
        for t in early:
            t.start()
        deadline = time.monotonic() + 10.0
        while not any(row.get("open_steps") for row in c.status()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(row.get("open_steps") for row in c.status()), "the leader never held the step"
        time.sleep(0.5)                            # both contributions in the leader's memory
        cl.kill(leader)
        last = threading.Thread(target=worker, args=(2,))
        last.start()
        for t in early + [last]:
            t.join(90.0)
        assert all(a is not None for a in answers), answers
        assert all(a["applied"] and a["count"] == 3 and not a.get("late") for a in answers), answers
        assert len({a["version"] for a in answers}) == 1
        tensors, _ = c.pull(["w"])
        np.testing.assert_array_equal(tensors["w"], np.full(big, -2.0, np.float32))   # the mean of 1, 2, 3, once
        assert c.sync_applied("job") == 0
        cl.start_node(leader)
        wait_converged(c, 3)


def test_fp16_contributions_are_decoded_by_the_leader_before_the_sum(store) -> None:
    """push_step's encoding: each contribution decoded (fp16 -> the tensor's dtype, / scale) on
    the leader, then summed as plain ones are; bad encodings refused before anything joins."""
    from raftps.compress import encode_fp16
    node, address = store
    rng = np.random.default_rng(3)
    with Client(address, timeout=10.0) as c:
        c.create("w", np.zeros(6, np.float32), {"name": "sgd", "lr": 1.0})
        grads = [rng.standard_normal(6).astype(np.float32) * np.float32(0.01) for _ in range(2)]
        sent = [encode_fp16(g) for g in grads]
        answers: list = [None, None]

        def worker(rank: int) -> None:
            values, enc = sent[rank]
            with Client(address, timeout=20.0) as w:
                answers[rank] = w.push_step({"w": values}, 0, 2, job="fp16", rank=rank, encoding={"w": enc})
        threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30.0)
        assert [a["count"] for a in answers] == [2, 2]
        decoded = [v.astype(np.float32) / np.float32(e["scale"]) for v, e in sent]
        want = np.zeros(6, np.float32) - (decoded[0] + decoded[1]) / np.float32(2)
        assert c.pull(["w"])[0]["w"].tobytes() == want.tobytes()
        version = node.version
        values, enc = sent[0]
        for encoding, tensors, error, match in (
                ({"w": {"kind": "topk"}}, {"w": values}, raftps.InvalidRequest, "takes fp16 or no encoding"),
                ({"w": enc}, {"w": grads[0]}, raftps.InvalidRequest, "needs float16 values"),
                ({"nope": enc}, {"nope": values}, raftps.UnknownTensor, "nope"),
                ({"w": {"kind": "fp16", "scale": -1.0}}, {"w": values}, raftps.InvalidRequest, "scale")):
            with pytest.raises(error, match=match):
                c.push_step(tensors, 1, 2, job="fp16", timeout=0.2, encoding=encoding)
        assert node.version == version and c.status()[0]["open_steps"] == 0
