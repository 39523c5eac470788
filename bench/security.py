"""What the security features cost on the hot path, each as a ratio against the same thing
without it, measured in the same run:

* per-frame HMAC (data plane): 4 MiB frames through a socket pair, with and without FrameMac;
* TLS on the client port: 4 MiB pushes from one client to a 3-node cluster, plain and TLS
  (two clusters up at once, taking turns in windows; medians);
* the hello: connect + hello + one status request, against connect + status as it was.

``python -m bench.security [--seconds S] [--base-port B]`` prints one line per figure and a
JSON record. Ports: clusters at B and B+10 (default 10400: helper sec's range), each using
+1..+3, +101..+103, +201..+203.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import tempfile
import threading
import time

import numpy as np

from raftps import codec
from raftps.tools.localcluster import LocalCluster

from .common import MiB, log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def frames_per_s(size: int, seconds: float, mac: bool) -> float:
    """4 MiB frames per second from one thread to another over a socket pair."""
    a, b = socket.socketpair()
    key_a, key_b = os.urandom(32), os.urandom(32)
    send_mac = codec.FrameMac(key_a, key_b) if mac else None
    recv_mac = codec.FrameMac(key_b, key_a) if mac else None
    message = {"tensors": {"w": np.ones(size // 4, np.float32)}}
    stop = threading.Event()
    count = [0]

    def receiver() -> None:
        while True:
            try:
                codec.recv_frame(b, mac=recv_mac)
            except (ConnectionError, OSError):
                return
            count[0] += 1

    t = threading.Thread(target=receiver, daemon=True)
    t.start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds and not stop.is_set():
        codec.send_frame(a, message, mac=send_mac)
    a.shutdown(socket.SHUT_WR)
    t.join()
    elapsed = time.perf_counter() - t0
    a.close()
    b.close()
    return count[0] / elapsed


def push_windows(clients: dict, size: int, seconds: float, rounds: int) -> dict[str, float]:
    """Median pushes/s per cluster over ``rounds`` windows, the clusters taking turns (so a
    change in the machine's load hits both alike)."""
    grad = np.full(size // 4, 1e-3, np.float32)
    for c in clients.values():
        c.create("sec.w", np.zeros(size // 4, np.float32), optimizer={"name": "sgd", "lr": 1e-6})
        for _ in range(3):
            c.push({"sec.w": grad})                       # warm: connections, leader known
    rates: dict[str, list[float]] = {name: [] for name in clients}
    for _ in range(rounds):
        for name, c in clients.items():
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                c.push({"sec.w": grad})
                n += 1
            rates[name].append(n / (time.perf_counter() - t0))
    return {name: float(np.median(r)) for name, r in rates.items()}


def hello_ms(cluster: LocalCluster, rounds: int = 200) -> tuple[float, float]:
    """Median ms of (connect + status) and (connect + hello + status) on node 1."""
    host, port = cluster.client_address(1).rsplit(":", 1)
    plain, hello = [], []
    for i in range(rounds):
        for with_hello, out in ((False, plain), (True, hello)):
            t0 = time.perf_counter()
            with socket.create_connection((host, int(port))) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if with_hello:
                    codec.send_frame(s, {"op": "hello", "token": cluster.token})
                    codec.recv_frame(s)
                codec.send_frame(s, {"op": "status"})
                codec.recv_frame(s)                       # (a refusal without the hello: same size)
            out.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(plain)), float(np.median(hello))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.security")
    ap.add_argument("--seconds", type=float, default=4.0, help="length of one measuring window")
    ap.add_argument("--rounds", type=int, default=3, help="windows per setting (medians are reported)")
    ap.add_argument("--base-port", type=int, default=10400)
    args = ap.parse_args(argv)
    size = 4 * MiB
    out: dict[str, float] = {}
    plain_fps = float(np.median([frames_per_s(size, args.seconds / 2, False) for _ in range(args.rounds)]))
    mac_fps = float(np.median([frames_per_s(size, args.seconds / 2, True) for _ in range(args.rounds)]))
    out.update(frame_plain_per_s=plain_fps, frame_hmac_per_s=mac_fps, frame_hmac_ratio=mac_fps / plain_fps)
    log(f"4 MiB frames over a socket pair: {plain_fps:.0f}/s plain, {mac_fps:.0f}/s with HMAC "
        f"(ratio {mac_fps / plain_fps:.2f})")
    with tempfile.TemporaryDirectory(prefix="raftps-bench-sec-") as tmp:
        certs = os.path.join(tmp, "certs")
        subprocess.run(["bash", os.path.join(ROOT, "cluster", "make-certs.sh"), certs], check=True,
                       capture_output=True)
        clusters = {"plain": LocalCluster(os.path.join(tmp, "plain"), nodes=3, base_port=args.base_port),
                    "tls": LocalCluster(os.path.join(tmp, "tls"), nodes=3, base_port=args.base_port + 10,
                                        tls_dir=certs)}
        try:
            for cl in clusters.values():
                cl.start(timeout=60)
            out["connect_status_ms"], out["connect_hello_status_ms"] = hello_ms(clusters["plain"])
            clients = {name: cl.client(timeout=30) for name, cl in clusters.items()}
            rates = push_windows(clients, size, args.seconds, args.rounds)
            for c in clients.values():
                c.close()
        finally:
            for cl in clusters.values():
                cl.wipe()
        out.update(push_plain_per_s=rates["plain"], push_tls_per_s=rates["tls"],
                   push_tls_ratio=rates["tls"] / rates["plain"])
        log(f"4 MiB pushes, 1 client, 3 nodes: {rates['plain']:.1f}/s plain, {rates['tls']:.1f}/s TLS "
            f"(ratio {rates['tls'] / rates['plain']:.2f})")
        log(f"connect + status {out['connect_status_ms']:.2f} ms; connect + hello + status "
            f"{out['connect_hello_status_ms']:.2f} ms (median)")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
