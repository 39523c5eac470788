"""Helpers of the security tests (raw sockets, node memory, cluster state)."""
import socket
import time

from raftps import codec
from raftps.tools.localcluster import LocalCluster
from tests.conftest import start_cluster as start     # noqa: F401 (the security tests' cluster maker)


def hello_connection(port: int, token: str, source: str | None = None) -> socket.socket:
    """A client-port connection past the hello. A loaded node may still count connections an
    earlier case closed against max_connections_per_ip: then it says so, and we try again (bounded)."""
    deadline = time.monotonic() + 10
    while True:
        s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0) if source else None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            codec.send_frame(s, {"op": "hello", "token": token})
        except OSError:
            pass
        reply = codec.recv_frame(s)
        if reply == {"ok": True}:
            return s
        s.close()
        assert "max_connections" in reply.get("message", "") and time.monotonic() < deadline, reply
        time.sleep(0.05)


def raw_request(address: str, *frames: dict, timeout: float = 5.0) -> list:
    """Send frames on one plain connection (no hello unless given) and decode every reply until EOF."""
    host, port = address.rsplit(":", 1)
    replies = []
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        try:
            for frame in frames:
                codec.send_frame(s, frame)
        except OSError:
            pass
        while True:
            try:
                replies.append(codec.recv_frame(s))
            except (ConnectionError, OSError):
                return replies


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of a process now (VmRSS) or at its peak so far (VmHWM), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def state(cluster: LocalCluster, settle: float = 10.0) -> list[tuple]:
    """(node, version, digest) of every node's state machine once all nodes agree (a follower may
    still be applying the last acknowledged write; bounded by ``settle`` s); asserts every node
    answers. (The Raft applied index also moves on an election's no-op entry, which applies nothing.)"""
    deadline = time.monotonic() + settle
    while True:
        rows = cluster.status()
        assert all(r["role"] != "down" for r in rows), rows
        if len({(r["version"], r["digest"]) for r in rows}) == 1 or time.monotonic() > deadline:
            return [(r["node"], r["version"], r["digest"]) for r in rows]
        time.sleep(0.05)


def raft_state(cluster: LocalCluster) -> list[tuple]:
    """(node, term, applied index) of every node."""
    return [(r["node"], r["term"], r["applied"]) for r in cluster.status()]


def assert_nothing_applied(before: list[tuple], after: list[tuple]) -> None:
    """Raft applied index unchanged on every node, unless an election (a new term, whose leader
    appends a no-op) explains it: a loaded 2-core machine can delay a heartbeat."""
    for (node, term, applied), (_, term2, applied2) in zip(before, after):
        assert applied2 == applied or term2 > term, f"node {node} applied {applied} -> {applied2} in term {term}"


def token_env(monkeypatch, **values: str) -> None:
    for var in ("RAFTPS_TOKEN", "RAFTPS_TOKEN_FILE", "RAFTPS_TLS_CA"):
        monkeypatch.delenv(var, raising=False)
    for var, value in values.items():
        monkeypatch.setenv(var, value)
