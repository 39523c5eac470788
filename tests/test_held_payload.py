"""A large write sent again after an attempt that may have reached a node goes first without its
arrays, naming their content (router.held_probe): a node that holds the payload (it took the
first attempt, or its leader sent it the payload) answers from its copy, so the bytes do not
cross the client's link twice; one that does not answers ``need_payload`` and the arrays follow.
On a real 3-node cluster: a reply lost after the write applied, a leader SIGKILLed while writes
are in flight, a node that never saw the payload, and requests that are refused."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from raftps import rbac
from raftps.client.router import held_probe
from raftps.client.transport import TcpTransport
from raftps.errors import InvalidRequest, PermissionDenied
from tests.conftest import start_cluster, wait_converged

BASE = 14700
N = 600_000                         # float32: 2.4 MB, over the 1 MiB above which a probe goes first
SGD = {"name": "sgd", "lr": 1.0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("held"), BASE)
    yield cl
    cl.wipe()


class Recording(TcpTransport):
    """The client's real TCP transport, recording every message it sends; ``lose_reply``: the
    next reply to a write is read and then thrown away (a connection that broke after the node
    answered), as an OSError."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.sent: list[dict] = []
        self.lose_reply = False

    def call(self, address: str, message: dict, timeout: float) -> dict:
        self.sent.append(message)
        reply = super().call(address, message, timeout)
        if self.lose_reply and "seq" in message:
            self.lose_reply = False
            self.drop(address)
            raise ConnectionResetError("the reply was lost")
        return reply


def test_a_write_whose_reply_was_lost_goes_again_without_its_bytes(cluster) -> None:
    transports: list[Recording] = []

    def factory(*args) -> Recording:
        transports.append(Recording(*args))
        return transports[-1]
    with cluster.client(timeout=30) as c:
        c.create("w", np.zeros(N, np.float32), SGD)
    with cluster.client(timeout=30, transport=factory) as c:
        transport = transports[0]
        transport.lose_reply = True
        version = c.push({"w": np.ones(N, np.float32)})
        writes = [m for m in transport.sent if m.get("op") == "push"]
        assert "tensors" in writes[0] and len(writes) == 2, [sorted(m) for m in writes]
        assert "tensors" not in writes[1] and writes[1]["seq"] == writes[0]["seq"], \
            "the second send named the payload instead of carrying it"
        tensors, now = c.pull(["w"])
    assert now >= version     # the write sent again is an entry of its own, answered from the session
    np.testing.assert_array_equal(tensors["w"], np.full(N, -1.0, np.float32))   # applied once


def test_a_node_without_the_payload_asks_for_it_and_nothing_applies(cluster) -> None:
    with cluster.client(timeout=30) as c:
        c.create("u", np.zeros(N, np.float32), SGD)
        message = {"op": "push", "client": "held-test-u", "seq": 1, "ack": 1,     # a session of its own
                   "tensors": {"u": np.ones(N, np.float32)}}
        probe = held_probe(message)
        assert probe is not None and "tensors" not in probe and probe["held_names"] == ["u"]
        reply = c._router.transport.call(cluster.client_address(cluster.leader()), probe, 10.0)
        assert reply.get("need_payload") and reply.get("retry"), reply
        # the whole write, then: applied once
        assert c._router.request(message)["version"] > 0
        again = c._router.request(probe)          # now held: answered from the session, nothing twice
        assert again.get("duplicate"), again
        tensors, _ = c.pull(["u"])
    np.testing.assert_array_equal(tensors["u"], np.full(N, -1.0, np.float32))


def test_a_probe_that_names_other_tensors_or_lacks_its_names_is_refused(cluster) -> None:
    with cluster.client(timeout=30) as c:
        c.create("v", np.zeros(N, np.float32), SGD)
        message = {"op": "push", "client": "held-test-v", "seq": 1, "ack": 1,
                   "tensors": {"v": np.ones(N, np.float32)}}
        c._router.request(message)
        probe = held_probe(message)
        with pytest.raises(InvalidRequest, match="held_names"):
            c._router.request({**probe, "held_names": ["w"]})
        with pytest.raises(InvalidRequest, match="held_names"):
            c._router.request({k: v for k, v in probe.items() if k != "held_names"})
        with pytest.raises(InvalidRequest, match="tensors"):
            c._router.request({**probe, "tensors": message["tensors"]})
        tensors, _ = c.pull(["v"])
    np.testing.assert_array_equal(tensors["v"], np.full(N, -1.0, np.float32))


def test_writes_in_flight_when_the_leader_is_killed_apply_once(cluster) -> None:
    with cluster.client(timeout=60) as c:
        c.create("k", np.zeros(N, np.float32), SGD)
        leader = cluster.leader()
        done: list = []

        def writer(i: int) -> None:
            with cluster.client(timeout=60) as w:
                for _ in range(3):
                    w.push({"k": np.full(N, float(i + 1), np.float32)})
                    done.append(i)
        threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        while len(done) < 1 and any(t.is_alive() for t in threads):
            threads[0].join(0.05)
        cluster.kill(leader)
        for t in threads:
            t.join(90.0)
        assert sorted(done) == [0, 0, 0, 1, 1, 1]
        tensors, _ = c.pull(["k"])
        np.testing.assert_array_equal(tensors["k"], np.full(N, -9.0, np.float32))   # 3 x 1 + 3 x 2, once each
        cluster.start_node(leader)
        wait_converged(c, 3)


def test_a_probe_needs_the_role_on_every_name_it_holds() -> None:
    """held_names stand for the arrays a probe leaves out: the roles are checked on them."""
    ident = rbac.Identity("jobA", b"x" * 32, (rbac.Grant("jobA/", "write"),))
    probe = {"op": "push", "client": "c", "seq": 2, "held": "0123abcd", "held_names": ["jobA/w"]}
    rbac.authorize(ident, probe)
    with pytest.raises(PermissionDenied, match="jobB/w"):
        rbac.authorize(ident, {**probe, "held_names": ["jobA/w", "jobB/w"]})
