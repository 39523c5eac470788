"""Helpers of the security tests (raw sockets, node memory, cluster state)."""
import socket

from raftps import codec
from raftps.localcluster import LocalCluster


def start(run_dir, base_port: int, nodes: int = 3, **kwargs) -> LocalCluster:
    cluster = LocalCluster(str(run_dir), nodes=nodes, base_port=base_port, **kwargs)
    try:
        cluster.start(timeout=60)
    except BaseException:
        cluster.wipe()
        raise
    return cluster


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


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def state(cluster: LocalCluster) -> list[tuple]:
    """(node, applied, version, digest) of every node; asserts every node answers."""
    rows = cluster.status()
    assert all(r["role"] != "down" for r in rows), rows
    return [(r["node"], r["applied"], r["version"], r["digest"]) for r in rows]


def token_env(monkeypatch, **values: str) -> None:
    for var in ("RAFTPS_TOKEN", "RAFTPS_TOKEN_FILE", "RAFTPS_TLS_CA"):
        monkeypatch.delenv(var, raising=False)
    for var, value in values.items():
        monkeypatch.setenv(var, value)
