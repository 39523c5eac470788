"""Every limit of the client port, hit on a real 3-node cluster started with small limits: each
refusal names its limit, changes nothing, and the node goes on serving everyone else."""
import socket
import struct
import time

import numpy as np
import pytest

from raftps import LimitExceeded, codec
from security_helpers import hello_connection, start, state

BASE = 10050
LIMITS = ["--max-frame-mb", "2", "--max-tensor-mb", "1", "--max-tensors-per-push", "4",
          "--max-connections", "8", "--max-connections-per-ip", "5", "--frame-timeout", "1.5"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start(tmp_path_factory.mktemp("limits"), BASE, extra_args=LIMITS)
    with cl.client(timeout=10) as c:
        c.create("lim.w", np.zeros(4, np.float32), optimizer={"name": "sgd", "lr": 1.0})
    yield cl
    cl.wipe()


@pytest.fixture
def client(cluster):
    with cluster.client(timeout=10) as c:
        yield c


def _still_serving(cluster, before) -> None:
    assert state(cluster) == before           # nothing applied by the refused request
    with cluster.client(timeout=10) as c:     # and a well-behaved client is served
        assert c.pull(["lim.w"])[0]["lim.w"].shape == (4,)


def _refused(cluster, source: str | None = None) -> dict:
    """A hello to node 1 that the node refuses at accept: its refusal (sent before it reads)."""
    s = socket.create_connection(("127.0.0.1", BASE + 101), timeout=5, source_address=(source, 0) if source else None)
    try:
        codec.send_frame(s, {"op": "hello", "token": cluster.token})
    except OSError:
        pass                          # closed already; its refusal is still there to read
    try:
        return codec.recv_frame(s)
    finally:
        s.close()


def _hello(cluster, node: int = 1, source: str | None = None) -> socket.socket:
    return hello_connection(BASE + 100 + node, cluster.token, source)


@pytest.mark.parametrize("grads, limit", [
    ({"lim.w": np.zeros((1 << 18) + 1, np.float32)}, "max_tensor_bytes=1048576"),
    ({f"lim.{i}": np.zeros(1 << 18, np.float32) for i in range(3)}, "max_blob_bytes=2097152"),
    ({f"lim.{i}": np.zeros(4, np.float32) for i in range(5)}, "max_tensors_per_push=4"),
])
def test_push_over_a_limit_is_refused_by_name(cluster, client, grads, limit):
    before = state(cluster)
    with pytest.raises(LimitExceeded, match=limit):
        client.push(grads)
    _still_serving(cluster, before)


def test_header_over_max_header_bytes(cluster, client):
    before = state(cluster)
    with pytest.raises(LimitExceeded, match="max_header_bytes=1048576"):
        client.delete(["x" * (1 << 20)])
    _still_serving(cluster, before)


def test_connection_limits_per_ip_and_in_total(cluster):
    before = state(cluster)
    held = [_hello(cluster) for _ in range(5)]
    try:
        refusal = _refused(cluster)
        assert refusal["error"] == "LimitExceeded" and "max_connections_per_ip=5" in refusal["message"]
        held += [_hello(cluster, source="127.0.0.2") for _ in range(3)]     # 8 = max_connections
        refusal = _refused(cluster, source="127.0.0.3")
        assert refusal.get("retry") and "max_connections=8" in refusal["message"]
        # Node 1 is full; the other nodes serve, and a client that tries node 1 first moves on.
        with cluster.client([cluster.client_address(1), cluster.client_address(2)], timeout=10) as c:
            assert c.pull(["lim.w"], linearizable=False)[1] >= 1
    finally:
        for s in held:
            s.close()
    _hello(cluster).close()          # the slots come back once the node has seen the closes
    _still_serving(cluster, before)


def test_a_half_sent_frame_is_cut_at_frame_timeout(cluster):
    before = state(cluster)
    s = _hello(cluster)
    s.sendall(struct.pack("!4sIQ", b"RPS1", 100, 0) + b"\x81")      # 100-byte header, 1 byte of it
    reply = codec.recv_frame(s)
    assert reply["error"] == "LimitExceeded" and "frame_timeout=1.5" in reply["message"]
    s.close()
    _still_serving(cluster, before)


def test_slowloris_trickle_is_cut_and_others_are_served_meanwhile(cluster):
    before = state(cluster)
    s = _hello(cluster, node=2)
    frame = codec.encode_bytes({"op": "status", "pad": "x" * 200})
    started = time.monotonic()
    cut = None
    with cluster.client([cluster.client_address(2)], timeout=10) as other:
        for i, byte in enumerate(frame):           # one byte every 0.1 s would take 20+ s
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            if i % 5 == 0:
                assert other.status()[0]["role"] != "down"      # node 2 serves others meanwhile
            s.settimeout(0.1)
            try:
                cut = codec.recv_frame(s)
                break
            except socket.timeout:
                continue
    s.close()
    assert cut is not None and "frame_timeout=1.5" in cut["message"]
    assert time.monotonic() - started < 0.1 * len(frame) / 2          # cut long before the trickle ended
    _still_serving(cluster, before)


def test_a_connection_that_never_says_hello_is_closed(cluster):
    s = socket.create_connection(("127.0.0.1", BASE + 103), timeout=10)
    assert s.recv(1) == b""                    # closed by the node after frame_timeout
    s.close()
