"""Kills and restarts of real node processes: nothing acknowledged is lost or applied twice."""
import socket
import time

import numpy as np
import pytest

from raftps import Unavailable, codec
from tests.conftest import wait_converged

N = 1 << 18          # 1 MiB float32: above the inline limit, so payloads take the data plane
FAST_COMPACTION = ["--compaction-entries", "20"]


def counter(client, name="ctr", n=N):
    client.create(name, np.zeros(n, np.float32), optimizer={"name": "sgd", "lr": 1.0})


def one_hot(k, n=N):
    g = np.zeros(n, np.float32)
    g[k] = -1.0       # sgd with lr=1 adds 1 at k: element k counts how often push k was applied
    return g


def test_retry_after_the_leader_dies_with_the_reply_unsent_is_applied_once(make_cluster):
    cl = make_cluster(6300)
    with cl.client(timeout=30) as c:
        counter(c)
        leader = cl.leader()
        request = {"op": "push", "client": c.client_id, "seq": 500, "ack": 500, "tensors": {"ctr": one_hot(7)}}
        host, port = cl.client_address(leader).rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            codec.send_frame(raw, {"op": "hello", "token": cl.token})
            assert codec.recv_frame(raw) == {"ok": True}
            codec.send_frame(raw, request)
            time.sleep(0.05)       # long enough to commit on loopback, too short to matter otherwise
            cl.kill(leader)        # the reply, if any, dies with the leader
        result = c._router.request(dict(request))            # the client's retry: same client id and seq
        tensors, _ = c.pull(["ctr"])
        assert tensors["ctr"][7] == 1.0 and tensors["ctr"].sum() == 1.0, result
        cl.start()
        wait_converged(c, 3)


def test_pushes_acknowledged_around_a_leader_kill_are_all_there_once(make_cluster):
    cl = make_cluster(6600)
    acked, unknown = [], []
    with cl.client(timeout=20) as c:
        counter(c)
        for k in range(40):
            if k == 15:
                cl.kill(cl.leader())
            try:
                c.push({"ctr": one_hot(k)})
                acked.append(k)
            except Unavailable:
                unknown.append(k)
        tensors, _ = c.pull(["ctr"])
        counts = tensors["ctr"][:40]
        assert all(counts[k] == 1.0 for k in acked), counts
        assert all(counts[k] <= 1.0 for k in unknown) and counts.max() <= 1.0
        assert len(acked) >= 35
        cl.start()
        wait_converged(c, 3)


def test_killed_follower_restarts_and_catches_up_through_a_snapshot(make_cluster):
    cl = make_cluster(6900, extra_args=FAST_COMPACTION)
    with cl.client(timeout=30) as c:
        counter(c)
        c.create("opt", np.ones(1000), optimizer={"name": "adam", "lr": 0.01})
        follower = next(r["node"] for r in c.status() if r["role"] == "follower")
        cl.kill(follower)
        for k in range(60):
            c.push({"ctr": one_hot(k), "opt": np.full(1000, 0.5)})
        leader_row = next(r for r in c.status() if r["role"] == "leader")
        assert leader_row["snapshot_index"] > 3, "the log should have been compacted while the follower was down"
        cl.start()
        rows = wait_converged(c, 3, timeout=60)
        assert rows[0]["version"] >= leader_row["version"]
        with cl.client([cl.client_address(follower)], timeout=10) as one:
            tensors, _ = one.pull(["ctr"], min_version=leader_row["version"], linearizable=False)
        assert tensors["ctr"][:60].tolist() == [1.0] * 60


def test_full_cluster_sigkill_and_restart_keeps_everything(make_cluster):
    cl = make_cluster(8400, extra_args=FAST_COMPACTION)
    with cl.client(timeout=30) as c:
        counter(c)
        c.create("mom", np.zeros(100), optimizer={"name": "momentum", "lr": 0.1})
        for k in range(45):             # past two compactions, and a journal tail after the last
            c.push({"ctr": one_hot(k), "mom": np.full(100, 1.0)})
        before = wait_converged(c, 3)
        for node in (1, 2, 3):
            cl.kill(node)
        cl.start()
        after = wait_converged(c, 3, timeout=60)
        assert after[0]["digest"] == before[0]["digest"] and after[0]["version"] == before[0]["version"]
        c.push({"mom": np.full(100, 1.0)})   # momentum state survived: the next step uses velocity
        tensors, _ = c.pull(["ctr", "mom"])
        assert tensors["ctr"][:45].tolist() == [1.0] * 45
        expected = -0.1 * sum(sum(0.9 ** i for i in range(t)) for t in range(1, 47))
        assert np.allclose(tensors["mom"], expected)


def test_two_nodes_down_fails_cleanly_then_recovers(make_cluster):
    cl = make_cluster(8100)
    with cl.client(timeout=5) as c:
        counter(c)
        c.push({"ctr": one_hot(0)})
        leader = cl.leader()
        others = [n for n in (1, 2, 3) if n != leader]
        cl.kill(others[0])
        cl.kill(others[1])
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            c.push({"ctr": one_hot(1)})
        assert time.monotonic() - t0 < 5 + 3       # the client's timeout, plus one attempt in flight
        cl.start_node(others[0])
        c.timeout = 30
        c.push({"ctr": one_hot(2)})
        tensors, _ = c.pull(["ctr"])
        assert tensors["ctr"][0] == 1 and tensors["ctr"][2] == 1 and tensors["ctr"][1] <= 1
        cl.start()
        wait_converged(c, 3)
