"""Seeded fuzz of the client port and the data-plane port of a real 3-node cluster: 20,000 cases
of random bytes, truncated and oversized length prefixes, undecodable headers, huge or lying array
descriptors, well-formed frames of the wrong shape, and authenticated-but-malformed requests.

Every reply must be a refusal (never "Internal", never a success); afterwards every node is
alive and answers status, its RSS did not balloon, and no node applied anything.
"""
import os
import random
import socket
import struct
import time

import msgpack
import numpy as np

from raftps import auth, codec

from raftps.server import dataplane
from raftps.server.dataplane import PeerLink
from security_helpers import hello_connection, rss_kib, state

BASE = 10060
SEED = int(os.environ.get("RAFTPS_FUZZ_SEED", "20261203"))
PLAN = {                     # cases per kind: 20,000 in all
    "client, before hello: garbage": 2500,
    "client, after hello: garbage": 2500,
    "client, after hello: malformed requests": 9000,
    "data plane, before auth: garbage": 2000,
    "data plane, after auth: garbage": 1000,
    "data plane, after auth: malformed requests": 3000,
}
WRITES = ["create", "push", "assign", "push_sync", "delete", "close_step"]
ANY = [None, True, -1, 0, 2 ** 63 - 1, -2 ** 63, 1.5, float("nan"), float("inf"), "", "x" * 300, b"\x00" * 9,
       [], [1, "a"], {}, {"a": None}, {1: 2}]


# ---- generators ---------------------------------------------------------------------------------

def _ext(meta) -> msgpack.ExtType:
    return msgpack.ExtType(codec.ARRAY_EXT, msgpack.packb(meta))


def garbage_frame(rng: random.Random) -> bytes:
    """Bytes that are not a complete valid frame: each kind fails a different check."""
    kind = rng.randrange(9)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 2048))
    if kind == 1:                                         # oversized prefix (beyond every limit)
        return struct.pack("!4sIQ", b"RPS1", rng.choice([(1 << 20) + 1, 2 ** 32 - 1, 10]),
                           rng.choice([(1 << 30) + 1, 2 ** 64 - 1, 2 ** 40])) + rng.randbytes(rng.randrange(64))
    if kind == 2:                                         # large but allowed declarations, then EOF
        if rng.random() < 0.5:                            # ... in the header
            return struct.pack("!4sIQ", b"RPS1", rng.randrange(1 << 20), rng.randrange(1 << 30)) + rng.randbytes(100)
        header = msgpack.packb({"op": "push", "tensors": {"w": _ext(["float32", [1 << 28]])}})
        return struct.pack("!4sIQ", b"RPS1", len(header), rng.randrange(64 << 20, 1 << 30)) + header + bytes(64)
    if kind == 3:                                         # bad magic
        return rng.randbytes(4) + struct.pack("!IQ", 5, 0) + b"\x80" * 5
    if kind == 4:                                         # undecodable header
        body = rng.randbytes(rng.randrange(1, 300))
        return struct.pack("!4sIQ", b"RPS1", len(body), 0) + body
    if kind == 5:                                         # array descriptors that lie or are absurd
        meta = rng.choice([["float32", [1 << 40]], ["float32", [-1]], ["float32", [2] * 9], ["object", [1]],
                           ["complex128", [1]], ["<U8", [1]], ["float32"], "float32", ["float32", "3"],
                           ["float64", [3, 1 << 62]], ["int64", [rng.randrange(1, 64)]]])
        header = msgpack.packb({"op": "push", "tensors": {"w": _ext(meta)}})
        blob = rng.randbytes(rng.randrange(0, 40))
        return struct.pack("!4sIQ", b"RPS1", len(header), len(blob)) + header + blob
    if kind == 6:                                         # an unknown extension type
        header = msgpack.packb({"op": "status", "x": msgpack.ExtType(rng.randrange(2, 120), b"abc")})
        return struct.pack("!4sIQ", b"RPS1", len(header), 0) + header
    if kind == 7:                                         # a valid request, truncated
        frame = codec.encode_bytes({"op": "push", "client": "fz", "seq": 1,
                                    "tensors": {"w": np.ones(rng.randrange(1, 64), np.float32)}})
        return frame[:rng.randrange(1, len(frame))]
    header = msgpack.packb([1, 2])                        # 8: blob longer than its arrays use
    return struct.pack("!4sIQ", b"RPS1", len(header), 8) + header + bytes(8)


def bad_value(rng: random.Random, valid):
    return rng.choice([v for v in ANY if type(v) is not type(valid)])


def malformed_request(rng: random.Random) -> dict | object:
    """A well-formed frame whose request the client port must refuse before it reaches Raft."""
    kind = rng.randrange(8)
    if kind == 0:
        return rng.choice([1, "push", [1, 2], None, b"op", 2.5, [{"op": "push"}]])
    if kind == 1:
        return {"op": bad_value(rng, "s"), "client": "c"}
    if kind == 2:
        return {"op": "".join(rng.choice("abcxyz_") for _ in range(rng.randrange(1, 12))) + "!"}
    client, seq = "fuzz", rng.randrange(1, 1000)
    req = {"op": rng.choice(WRITES), "client": client, "seq": seq, "ack": seq}
    fault = rng.randrange(3) if req["op"] not in ("delete", "close_step") else rng.randrange(2)
    if kind in (3, 4, 5):
        if fault == 0:
            req["client"] = rng.choice([bad_value(rng, ""), "", "a" * 65, "bad id", "é", "../x"])
        elif fault == 1:
            req[rng.choice(["seq", "ack"])] = rng.choice([0, -1, 1.0, "1", None, True, []])
            if type(req["seq"]) is int and type(req["ack"]) is int and 1 <= req["ack"] <= req["seq"]:
                req["ack"] = req["seq"] + 1
        else:
            bad = rng.randrange(5)
            n = rng.randrange(1, 16)
            req["tensors"] = (
                rng.choice([[], "t", 3, {}, 2.5]) if bad == 0 else       # (None = no tensors: a valid request)
                {rng.choice(["", "a b", "x" * 201, "ü", "a\x00"]): np.zeros(n, np.float32)} if bad == 1 else
                {"w": rng.choice([[1.0, 2.0], 1.0, "abc", {"a": 1}])} if bad == 2 else
                {"w": np.full(n, rng.choice([np.nan, np.inf, -np.inf]), np.float32)} if bad == 3 else
                {f"w{i}": np.zeros(1, np.float32) for i in range(1025)}          # max_tensors_per_push
            )
        for _ in range(rng.randrange(3)):
            req[rng.choice(["names", "optimizer", "step", "workers", "base_version", "junk"])] = rng.choice(ANY)
        return req
    if kind == 6:
        return rng.choice([{"op": "pull", "names": rng.choice(["w", 1, {"a": 1}, b"x", True, 2.5])},
                           {"op": "pull", "names": [rng.choice([1, None, b"x", []])]},
                           {"op": "pull", "linearizable": False, "min_version": rng.choice(["1", 1.5, [1], True, b"x"])},
                           {"op": "pull", "linearizable": False, "min_version": 1, "wait": rng.choice(
                               [float("nan"), -1, "2", float("inf"), None])}])
    return {"op": "wait_step", "step": bad_value(rng, 1), "timeout": rng.choice([float("nan"), -1, "x", 1])} \
        if rng.random() < 0.5 else {"op": "wait_step", "step": 1, "timeout": rng.choice([float("nan"), -5, "x"])}


def malformed_data_op(rng: random.Random):
    """An authenticated data-plane frame that must be refused (and store nothing)."""
    kind = rng.randrange(7)
    tensors = {"w": np.arange(rng.randrange(1, 32), dtype=np.float32)}
    if kind == 0:
        return rng.choice([1, "put", [1], None, {"op": None}, {"op": "put"}, {"op": "zap", "pid": "a-1-00000000"}])
    if kind == 1:
        return {"op": rng.choice(["put", "get"]), "pid": rng.choice(["../../etc/passwd", "", "a" * 100, "x-1-zz",
                                                                     "a/b-1-00000000", 7, None, b"pid"]),
                "tensors": tensors}
    if kind == 2:                                          # checksum that does not match its content
        return {"op": "put", "pid": f"fz-{rng.randrange(10 ** 6)}-{rng.randrange(1 << 32):08x}", "tensors": tensors}
    if kind == 3:
        return {"op": "put", "pid": "fz-1-00000000", "tensors": rng.choice([None, [1], {"w": [1.0]}, "t", {1: 2}])}
    if kind == 4:
        return {"op": "get_range", "first": bad_value(rng, 1), "last": rng.choice(ANY)}
    if kind == 5:
        return {"op": "get", "pid": f"fz-{rng.randrange(10 ** 6)}-{rng.randrange(1 << 32):08x}"}
    return {"op": "get_range", "first": 10 ** 12, "last": 10 ** 12 + 5}


# ---- drivers ------------------------------------------------------------------------------------

def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _peer_link(port: int, secret: bytes) -> PeerLink:
    """An authenticated data-plane link; retried while the node still holds closed links' slots."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return PeerLink(f"127.0.0.1:{port}", secret)
        except (ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _drain(s: socket.socket, payload: bytes) -> bytes:
    """Send, half-close, read whatever comes back until the node closes."""
    try:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except OSError:
        pass
    s.close()
    return out


def _check_refusal(raw: bytes, where: str) -> None:
    if not raw:
        return                                   # closed without a word: a refusal too
    reply = codec.decode(raw[:codec.PREFIX.size + struct.unpack("!4sIQ", raw[:16])[1]])
    assert isinstance(reply, dict) and (reply.get("error") or reply.get("ok") is False), (where, reply)
    assert reply.get("error") != "Internal", (where, reply)


def fuzz_client_garbage(cluster, rng, cases: int, hello: bool) -> None:
    for i in range(cases):
        node = i % 3 + 1
        s = hello_connection(BASE + 100 + node, cluster.token) if hello else _connect(BASE + 100 + node)
        _check_refusal(_drain(s, garbage_frame(rng)), f"client node {node}")


def fuzz_client_requests(cluster, rng, cases: int) -> None:
    conns = []
    for node in (1, 2, 3):
        conns.append(hello_connection(BASE + 100 + node, cluster.token))
    try:
        for i in range(cases):
            s = conns[i % 3]
            request = malformed_request(rng)
            codec.send_frame(s, request)
            reply = codec.recv_frame(s)
            assert isinstance(reply, dict) and (reply.get("error") or reply.get("retry")), (request, reply)
            assert reply.get("error") != "Internal", (request, reply)
    finally:
        for s in conns:
            s.close()


def fuzz_data_garbage(cluster, rng, cases: int, authenticated: bool) -> None:
    secret = auth.read_secret_file(cluster.secret_file).encode()
    for i in range(cases):
        port = BASE + 200 + i % 3 + 1
        if authenticated:
            link = _peer_link(port, secret)
            if rng.random() < 0.5:                        # a valid frame with a wrong tag
                payload = codec.encode_bytes(malformed_data_op(rng)) + rng.randbytes(32)
            else:
                payload = garbage_frame(rng)
            raw = _drain(link.sock, payload)
        else:
            payload = rng.choice([garbage_frame(rng), codec.encode_bytes({"nonce": rng.randbytes(rng.randrange(20))}),
                                  codec.encode_bytes({"nonce": os.urandom(16), "version": dataplane.VERSION}) + codec.encode_bytes(
                                      {"proof": rng.randbytes(32)})])
            raw = _drain(_connect(port), payload)
        # The data plane never answers garbage with data: at most a handshake step or a refusal.
        assert b"payloads" not in raw and b"snapshot" not in raw


def fuzz_data_requests(cluster, rng, cases: int) -> None:
    secret = auth.read_secret_file(cluster.secret_file).encode()
    links = [_peer_link(BASE + 200 + n, secret) for n in (1, 2, 3)]
    try:
        for i in range(cases):
            msg = malformed_data_op(rng)
            reply = links[i % 3].call(msg)
            assert isinstance(reply, dict), (msg, reply)
            if isinstance(msg, dict) and msg.get("op") == "get":
                assert reply.get("found") is not True, (msg, reply)
            elif isinstance(msg, dict) and msg.get("op") == "get_range" and reply.get("ok"):
                assert reply["payloads"] == {}, msg
            else:
                assert reply.get("ok") is False, (msg, reply)
    finally:
        for link in links:
            link.close()


def test_fuzz_20000_cases_change_nothing_and_crash_nothing(module_cluster):
    cluster = module_cluster
    with cluster.client(timeout=10) as c:
        c.create("fz.w", np.zeros(1024, np.float32), optimizer={"name": "adam", "lr": 0.01})
        c.push({"fz.w": np.ones(1024, np.float32)})
    time.sleep(0.5)                                      # followers apply the last entries
    before = state(cluster)
    pids = [cluster.pid(n) for n in (1, 2, 3)]
    rss_before = [rss_kib(p) for p in pids]
    peak_before = [rss_kib(p, "VmHWM") for p in pids]
    payload_files = {n: sorted(os.listdir(_payload_dir(cluster, n))) for n in (1, 2, 3)}
    rng = random.Random(SEED)
    started = time.monotonic()
    fuzz_client_garbage(cluster, rng, PLAN["client, before hello: garbage"], hello=False)
    fuzz_client_garbage(cluster, rng, PLAN["client, after hello: garbage"], hello=True)
    fuzz_client_requests(cluster, rng, PLAN["client, after hello: malformed requests"])
    fuzz_data_garbage(cluster, rng, PLAN["data plane, before auth: garbage"], authenticated=False)
    fuzz_data_garbage(cluster, rng, PLAN["data plane, after auth: garbage"], authenticated=True)
    fuzz_data_requests(cluster, rng, PLAN["data plane, after auth: malformed requests"])
    elapsed = time.monotonic() - started
    assert [cluster.pid(n) for n in (1, 2, 3)] == pids and all(cluster.is_up(n) for n in (1, 2, 3))
    assert state(cluster) == before                      # every node answers; nothing applied
    rss_after = [rss_kib(p) for p in pids]
    peak_after = [rss_kib(p, "VmHWM") for p in pids]
    for b, a, pb, pa in zip(rss_before, rss_after, peak_before, peak_after):
        assert a < b + 100 * 1024, f"RSS grew from {b} to {a} KiB (before {rss_before}, after {rss_after})"
        # The peak too: a frame that declares 1 GiB must not cost 1 GiB, even for a moment.
        assert pa < max(pb, b) + 200 * 1024, f"peak RSS grew from {pb} to {pa} KiB"
    assert {n: sorted(os.listdir(_payload_dir(cluster, n))) for n in (1, 2, 3)} == payload_files
    print(f"fuzz: {sum(PLAN.values())} cases in {elapsed:.1f} s (seed {SEED}); RSS KiB {rss_before} -> {rss_after}, "
          f"peak {peak_before} -> {peak_after}")


def _payload_dir(cluster, node: int) -> str:
    from raftps.server.node import default_payload_dir
    return default_payload_dir(cluster.data_dir(node))
