"""A real 3-node cluster on loopback: the API, exactly-once, and bad input answered and harmless."""
import socket
import struct

import numpy as np
import pytest

import raftps
from raftps import codec
from raftps.server.dataplane import PeerLink
from tests.conftest import start_cluster, wait_converged

BASE = 6000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("cluster"), BASE)
    yield cl
    cl.wipe()


@pytest.fixture
def client(cluster):
    with cluster.client(timeout=20) as c:
        yield c


def test_create_push_pull_roundtrip_large_and_small(client):
    big = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)   # 4 MiB: data plane
    small = np.arange(10, dtype=np.float64)                                         # inline in the entry
    client.create("api.big", big, optimizer={"name": "sgd", "lr": 0.5})
    client.create("api.small", small, optimizer={"name": "momentum", "lr": 0.1})
    v1 = client.push({"api.big": np.ones_like(big), "api.small": np.ones_like(small)})
    tensors, v = client.pull(["api.big", "api.small"])
    assert v >= v1
    assert np.array_equal(tensors["api.big"], big - np.float32(0.5))
    assert np.allclose(tensors["api.small"], small - 0.1)
    stale, v2 = client.pull(["api.big"], min_version=v1, linearizable=False)
    assert v2 >= v1 and np.array_equal(stale["api.big"], tensors["api.big"])
    meta = {t["name"]: t for t in client.tensors()}
    assert meta["api.big"]["version"] == 1 and meta["api.big"]["shape"] == [1 << 20]
    rows = wait_converged(client, 3)
    assert {r["role"] for r in rows} == {"leader", "follower"} and all(r["term"] >= 1 for r in rows)


def test_every_node_serves_reads_that_name_their_version(client, cluster):
    client.create("api.r", np.zeros(3), optimizer={"name": "sgd", "lr": 1.0})
    version = client.push({"api.r": -np.ones(3)})
    for address in cluster.addresses.split(","):
        with cluster.client([address], timeout=10) as one:
            tensors, v = one.pull(["api.r"], min_version=version, linearizable=False)
            assert v >= version and tensors["api.r"].tolist() == [1.0, 1.0, 1.0]
            tensors, v = one.pull(["api.r"])          # a follower redirects to the leader
            assert v >= version


def test_injected_duplicate_is_applied_once(client):
    client.create("api.dup", np.zeros(4), optimizer={"name": "sgd", "lr": 1.0})
    request = {"op": "push", "client": client.client_id, "seq": 10_000, "ack": 10_000,
               "tensors": {"api.dup": -np.ones(4)}}
    first = client._router.request(dict(request))
    second = client._router.request(dict(request))          # the same (client_id, seq) again
    assert second["duplicate"] and second["version"] == first["version"]
    tensors, _ = client.pull(["api.dup"])
    assert tensors["api.dup"].tolist() == [1.0] * 4


@pytest.mark.parametrize("grads, error, words", [
    ({"api.bad": np.ones(5, np.float32)}, raftps.ShapeMismatch, ["api.bad", "(5,)", "(4,)"]),
    ({"api.bad": np.ones(4, np.float64)}, raftps.DtypeMismatch, ["api.bad", "float64", "float32"]),
    ({"api.missing": np.ones(4, np.float32)}, raftps.UnknownTensor, ["api.missing"]),
    ({"api.bad": np.array([0, np.nan, 0, 0], np.float32)}, raftps.InvalidGradient, ["api.bad", "NaN"]),
    ({"api.bad": np.array([0, 0, np.inf, 0], np.float32)}, raftps.InvalidGradient, ["api.bad", "Inf"]),
    ({"no spaces": np.ones(4, np.float32)}, raftps.InvalidRequest, ["no spaces"]),
])
def test_bad_push_raises_its_error_and_changes_nothing(client, grads, error, words):
    client.create("api.bad", np.zeros(4, np.float32), optimizer={"name": "sgd", "lr": 1.0})
    before = {t["name"]: t["version"] for t in client.tensors()}
    with pytest.raises(error) as info:
        client.push(grads)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert {t["name"]: t["version"] for t in client.tensors()} == before


def test_bad_create_and_optimizer_specs(client):
    client.create("api.c", np.zeros(2, np.float32), optimizer={"name": "sgd", "lr": 1.0})
    client.create("api.c", np.zeros(2, np.float32), optimizer={"name": "sgd", "lr": 1.0})   # no-op
    with pytest.raises(raftps.TensorExists, match="api.c"):
        client.create("api.c", np.zeros(3, np.float32), optimizer={"name": "sgd", "lr": 1.0})
    with pytest.raises(raftps.InvalidOptimizer,
                       match=r"create: optimizer\['api.d'\].name: expected one of .*'sgd', got a string 'lbfgs'"):
        client.create("api.d", np.zeros(2), optimizer={"name": "lbfgs", "lr": 1.0})
    with pytest.raises(raftps.InvalidOptimizer,
                       match=r"optimizer\['api.d'\].lr: expected a finite number > 0, got a float 0.0"):
        client.create("api.d", np.zeros(2), optimizer={"name": "adam", "lr": 0.0})
    with pytest.raises(raftps.DtypeMismatch, match="int32"):
        client.create("api.d", np.zeros(2, np.int32), optimizer={"name": "sgd", "lr": 1.0})
    with pytest.raises(raftps.UnknownTensor, match="api.d"):
        client.pull(["api.d"])


def _raw_exchange(address: str, payload: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass              # the node already refused and closed: what we want to see
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, socket.timeout):
            pass
        return b"".join(chunks)


def test_garbage_on_every_port_is_refused_and_harmless(client, cluster):
    client.create("api.g", np.zeros(3), optimizer={"name": "sgd", "lr": 1.0})
    client.push({"api.g": np.ones(3)})
    before = wait_converged(client, 3)
    rng = np.random.default_rng(7)
    garbage = [b"", b"\x00", b"GET / HTTP/1.1\r\n\r\n", rng.bytes(4096),
               struct.pack("!4sIQ", b"RPS1", 0xFFFFFFFF, 0), struct.pack("!4sIQ", b"RPS1", 8, 1 << 62),
               struct.pack("!4sIQ", b"RPS1", 100, 0) + b"\x81",                 # truncated header
               codec.encode_bytes({"op": "push", "client": "x", "seq": 1, "tensors": {"api.g": [1, 2]}}),
               codec.encode_bytes({"op": "push", "client": "x" * 100, "seq": 1}),
               codec.encode_bytes([1, 2, 3]), codec.encode_bytes({"op": 5})]
    for i in range(1, 4):
        for port_offset in (0, 100, 200):            # Raft, client and data-plane ports
            address = f"127.0.0.1:{BASE + port_offset + i}"
            for g in garbage:
                reply = _raw_exchange(address, g)
                if port_offset == 100 and g:
                    assert reply, f"no error frame from {address} for {g[:20]!r}"
                    assert "error" in codec.decode(reply)
    after = wait_converged(client, 3)
    assert [(r["node"], r["role"]) for r in after] == [(r["node"], r["role"]) for r in before]
    assert {r["digest"] for r in after} == {before[0]["digest"]}


def test_data_plane_refuses_a_peer_without_the_secret(cluster):
    with pytest.raises(ConnectionError, match="authentication"):
        PeerLink(f"127.0.0.1:{BASE + 201}", b"not the cluster secret at all")
