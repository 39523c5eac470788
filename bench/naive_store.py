"""The baseline: a naive parameter store on pysyncobj that carries the payload in the log entry.

One node is ``python -m bench.naive_store --self H:P --partners H:P,H:P --client-port N``. Its
``@replicated push(blob)`` takes the msgpack'd gradient ``{"g": float32 bytes, "lr": float,
"step": int}`` and applies ``p -= lr * g`` with numpy, so the whole gradient goes through
pysyncobj's log, wire (pickle protocol 2 + zlib per follower + Fernet) and memory.

Tuned so 4-16 MiB entries commit (see shared/notes/pysyncobj.md 1.2): ``appendEntriesBatchSizeBytes``
above the largest pickled command (which avoids the broken chunked path), 4 MiB socket buffers,
Raft timeouts far above the per-tick CPU time. ``password`` and ``bindAddress`` are set.

Clients submit through a tiny socket of ours on each node (the simplest correct way: a read-only
pysyncobj node would receive the entire log). Frame: op (1 byte) | length (u32 BE) | body.
``P`` push body -> status byte + i64 store version; ``S`` status -> msgpack dict;
``B`` msgpack ``{n, size}`` -> the node itself submits n pipelined async pushes (pysyncobj's own
small-command rate, no client round trips) and answers ``{ok, seconds}``.
"""
from __future__ import annotations

import argparse
import os
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import msgpack
import numpy as np
from pysyncobj import SyncObj, SyncObjConf, replicated
from pysyncobj.syncobj import SyncObjException

from raftps.codec import recv_exactly

from .common import MiB, RssSampler, log, run_workers, size_label, stop_pid, summarize

HEAD = struct.Struct("!cI")
RESULT = struct.Struct("!Bq")
PASSWORD_ENV = "NAIVE_STORE_PASSWORD"


def tuned_conf(self_addr: str, max_payload: int, password: str) -> SyncObjConf:
    """pysyncobj settings under which entries of ``max_payload`` gradient bytes commit."""
    t_min = max(5.0, 0.6 * max_payload / MiB)      # 4 MiB: 5/10 s, 16 MiB: 9.6/19.2 s
    return SyncObjConf(
        password=password,
        bindAddress=self_addr,
        appendEntriesBatchSizeBytes=2 * max_payload + MiB,   # > pickled command (~1.51x payload)
        sendBufferSize=4 * MiB,
        recvBufferSize=4 * MiB,
        raftMinTimeout=t_min,
        raftMaxTimeout=2 * t_min,
        connectionTimeout=4 * t_min,
        leaderFallbackTimeout=max(30.0, 6 * t_min),
        commandsWaitLeader=True,
    )


class NaiveStore(SyncObj):
    def __init__(self, self_addr: str, partners: list[str], conf: SyncObjConf) -> None:
        super().__init__(self_addr, partners, conf)
        self._params: dict[int, np.ndarray] = {}
        self._version = 0

    @replicated
    def push(self, blob: bytes) -> int:
        try:
            msg = msgpack.unpackb(blob)
            grad = np.frombuffer(msg["g"], dtype=np.float32)
            param = self._params.get(grad.size)
            if param is None:
                param = self._params[grad.size] = np.zeros(grad.size, np.float32)
            param -= np.float32(msg["lr"]) * grad
        except Exception:            # never raise from an apply: pysyncobj would retry it forever
            return -1
        self._version += 1
        return self._version


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_exactly(sock, memoryview(buf))
    return buf


def _burst(store: NaiveStore, n: int, size: int, timeout: float) -> dict[str, Any]:
    rng = np.random.default_rng(12345)
    blobs = [msgpack.packb({"g": rng.standard_normal(size // 4, dtype=np.float32).tobytes(),
                            "lr": 0.01, "step": i}) for i in range(n)]
    done = threading.Event()
    lock = threading.Lock()
    state = {"left": n, "ok": 0}

    def callback(result: Any, err: Any) -> None:
        with lock:
            state["left"] -= 1
            state["ok"] += int(err == 0)
            if state["left"] == 0:
                done.set()

    t0 = time.perf_counter()
    for blob in blobs:
        store.push(blob, callback=callback)
    done.wait(timeout)
    return {"ok": state["ok"], "n": n, "seconds": time.perf_counter() - t0}


def serve(store: NaiveStore, port: int, push_timeout: float) -> socketserver.ThreadingTCPServer:
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock: socket.socket = self.request
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    op, length = HEAD.unpack(_recv_exactly(sock, HEAD.size))
                    body = _recv_exactly(sock, length) if length else b""
                except (ConnectionError, OSError):
                    return
                if op == b"P":
                    try:
                        res = store.push(bytes(body), sync=True, timeout=push_timeout)
                        sock.sendall(RESULT.pack(0 if res >= 0 else 2, res))
                    except SyncObjException as e:        # 'Timeout' or a FAIL_REASON code
                        code = e.errorCode if isinstance(e.errorCode, int) else -1
                        sock.sendall(RESULT.pack(1, code))
                elif op == b"S":
                    st = store.getStatus()
                    leader = store._getLeader()
                    reply = {"state": st["state"], "leader": getattr(leader, "address", None),
                             "applied": st["last_applied"], "version": store._version,
                             "term": st["raft_term"]}
                    out = msgpack.packb(reply)
                    sock.sendall(HEAD.pack(b"S", len(out)) + out)
                elif op == b"B":
                    req = msgpack.unpackb(body)
                    out = msgpack.packb(_burst(store, req["n"], req["size"], req.get("timeout", 120)))
                    sock.sendall(HEAD.pack(b"B", len(out)) + out)
                else:
                    return

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    server = socketserver.ThreadingTCPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class NaiveClient:
    """Blocking client of one naive node's client socket (point it at the leader)."""

    def __init__(self, address: str, timeout: float = 120.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _call(self, op: bytes, body: bytes) -> bytes:
        self.sock.sendall(HEAD.pack(op, len(body)))
        self.sock.sendall(body)
        if op == b"P":
            return bytes(_recv_exactly(self.sock, RESULT.size))
        _, length = HEAD.unpack(_recv_exactly(self.sock, HEAD.size))
        return bytes(_recv_exactly(self.sock, length))

    def push(self, blob: bytes) -> int:
        code, version = RESULT.unpack(self._call(b"P", blob))
        if code == 1:
            reason = "timeout" if version < 0 else f"pysyncobj FAIL_REASON {version}"
            raise RuntimeError(f"naive push not committed: {reason} "
                               "(3 DISCARDED, 5 LEADER_CHANGED, 7 UNKNOWN_OUTCOME: pysyncobj.config.FAIL_REASON)")
        if code != 0:
            raise RuntimeError("naive push rejected by the apply (undecodable gradient)")
        return version

    def status(self) -> dict[str, Any]:
        return msgpack.unpackb(self._call(b"S", b""))

    def burst(self, n: int, size: int, timeout: float = 120.0) -> dict[str, Any]:
        return msgpack.unpackb(self._call(b"B", msgpack.packb({"n": n, "size": size, "timeout": timeout})))

    def close(self) -> None:
        self.sock.close()


class NaiveCluster:
    """3 naive nodes as separate processes on 127.0.0.1: Raft base+1.., client ports base+11.. (9401-9403, 9411-9413)"""

    def __init__(self, run_dir: str, nodes: int = 3, base_port: int = 9400, max_payload: int = 4 * MiB) -> None:
        self.run_dir, self.n, self.base, self.max_payload = run_dir, nodes, base_port, max_payload
        self.procs: list[subprocess.Popen] = []
        self.raft = [f"127.0.0.1:{base_port + 1 + i}" for i in range(nodes)]
        self.addresses = [f"127.0.0.1:{base_port + 11 + i}" for i in range(nodes)]

    def start(self, timeout: float = 90.0) -> str:
        """Start the nodes and return the leader's client address once one is elected."""
        os.makedirs(self.run_dir, exist_ok=True)
        env = dict(os.environ, **{PASSWORD_ENV: os.urandom(16).hex()})
        for i in range(self.n):
            partners = ",".join(a for j, a in enumerate(self.raft) if j != i)
            cmd = [sys.executable, "-m", "bench.naive_store", "--self", self.raft[i], "--partners", partners,
                   "--client-port", str(self.base + 11 + i), "--max-payload", str(self.max_payload)]
            with open(os.path.join(self.run_dir, f"naive{i + 1}.log"), "ab") as out:
                self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
        return self.wait_leader(timeout)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_leader(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for addr in self.addresses:
                try:
                    c = NaiveClient(addr, timeout=2.0)
                    try:
                        if c.status()["state"] == 2:
                            return addr
                    finally:
                        c.close()
                except OSError:
                    pass
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a naive node exited; see {self.run_dir}/naive*.log")
            time.sleep(0.25)
        raise TimeoutError(f"no naive leader within {timeout} s")

    def stop(self) -> None:
        for p in self.procs:
            stop_pid(p)
        self.procs = []


def measure(run_dir: str, sizes: list[int], clients: list[int], duration: float, max_ops: int,
            base_port: int = 9400, burst: int = 0) -> list[dict[str, Any]]:
    """Push ``sizes`` x ``clients`` through a fresh tuned 3-node naive cluster; one record each.

    ``burst`` > 0 also measures pysyncobj's own pipelined small-command rate (1 KiB, on the leader).
    """
    cluster = NaiveCluster(run_dir, base_port=base_port, max_payload=max(sizes))
    out: list[dict[str, Any]] = []
    try:
        t0 = time.monotonic()
        leader = cluster.start()
        log(f"naive: leader {leader} after {time.monotonic() - t0:.1f} s")
        if burst:
            c = NaiveClient(leader)
            r = c.burst(burst, 1024)
            c.close()
            out.append({"system": "pysyncobj-pipelined", "op": "push", "size": 1024, "clients": 0,
                        "ok": r["ok"], "seconds": r["seconds"], "ops_per_s": r["ok"] / r["seconds"],
                        "MB_per_s": r["ok"] * 1024 / r["seconds"] / 1e6})
            log(f"naive: pysyncobj pipelined 1 KiB: {r['ok'] / r['seconds']:.0f} commands/s")
        for size in sizes:
            for n in clients:
                args = [{"kind": "naive", "op": "push", "addresses": leader, "size": size, "seed": 100 + k,
                         "duration": duration, "max_ops": max_ops, "timeout": 120.0} for k in range(n)]
                try:
                    with RssSampler(cluster.pids()) as rss:
                        res = run_workers(args, setup_timeout=180.0)   # n concurrent warm-up pushes
                except Exception as e:      # e.g. a leader change under 16 MiB entries: recorded, go on
                    log(f"naive {size_label(size)} x{n} failed: {e}")
                    out.append({"system": "naive", "op": "push-failed", "size": size, "clients": n, "error": str(e)})
                    continue
                rec = {"system": "naive", "op": "push", "size": size, "clients": n, **summarize(res, size),
                       "peak_rss_mb": max(rss.peak_rss_kb.values(), default=0) / 1024}
                out.append(rec)
                log(f"naive {size_label(size)} x{n}: {rec['ops_per_s']:.2f} pushes/s {rec['MB_per_s']:.1f} MB/s "
                    f"p50 {rec['p50_ms']:.0f} ms p99 {rec['p99_ms']:.0f} ms ({rec['errors']} errors)")
    finally:
        cluster.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--self", dest="self_addr", required=True)
    ap.add_argument("--partners", required=True)
    ap.add_argument("--client-port", type=int, required=True)
    ap.add_argument("--max-payload", type=int, default=4 * MiB)
    ap.add_argument("--push-timeout", type=float, default=120.0)
    a = ap.parse_args()
    password = os.environ.get(PASSWORD_ENV) or os.urandom(16).hex()
    store = NaiveStore(a.self_addr, a.partners.split(","), tuned_conf(a.self_addr, a.max_payload, password))
    serve(store, a.client_port, a.push_timeout)
    log(f"naive node {a.self_addr} client port {a.client_port} pid {os.getpid()}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
