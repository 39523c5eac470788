"""etcd 3.4 as the comparison store: a 3-member cluster on loopback, puts through its JSON gateway.

The benchmark starts the cluster itself (Debian's ``etcd-server``; ``bench/setup.sh`` installs
it): member k listens for clients on BASE+k and for peers on BASE+10+k, data dirs under the run
dir, ``--max-request-bytes`` raised so a 16 MiB value fits (default 1.5 MiB), the backend quota
at 8 GiB, default Raft settings (100 ms heartbeat, 1 s election timeout). etcd fsyncs its WAL
(and bbolt its backend) before it acknowledges a put: it is durable against power loss,
which raftps on tmpfs payloads and an unsynced pysyncobj journal is not.

Puts go through the v3 JSON gateway (``POST /v3/kv/put``, base64 key and value), one persistent
``http.client`` connection per client process, every client on the leader (followers would
forward each proposal to it: one more hop). Each client puts the same float32 gradient bytes as
raftps pushes, always to the same key per size, as raftps pushes into one tensor per size. After
each (size, clients) run the history is compacted so the backend does not fill up.
"""
from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import subprocess
import time
from typing import Any

from .common import MiB, RssSampler, log, run_workers, seconds_for, size_label, stop_pid, summarize

PEER_OFFSET = 10
QUOTA_BYTES = 8 * 2**30


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def etcd_version() -> str:
    out = subprocess.run([etcd_binary() or "etcd", "--version"], capture_output=True, text=True, timeout=10).stdout
    return out.splitlines()[0].split(":", 1)[-1].strip() if out else "?"


class EtcdError(RuntimeError):
    pass


class EtcdKV:
    """Minimal v3 JSON-gateway client on one persistent HTTP connection to one member."""

    def __init__(self, address: str, timeout: float = 30.0):
        self.address = address
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _post(self, path: str, body: bytes, timeout: float | None = None) -> dict[str, Any]:
        if self._conn is None:
            host, port = self.address.rsplit(":", 1)
            self._conn = http.client.HTTPConnection(host, int(port), timeout=timeout or self.timeout)
        try:
            self._conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            resp = self._conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            self.close()            # the next call reconnects
            raise
        reply = json.loads(data) if data else {}
        if resp.status != 200 or "error" in reply:
            raise EtcdError(f"etcd {self.address} {path}: HTTP {resp.status} {reply.get('error', data[:200])!r}")
        return reply

    def put(self, key: str, value: bytes) -> int:
        """Put one value; returns the store revision etcd committed it at."""
        body = b'{"key":"' + base64.b64encode(key.encode()) + b'","value":"' + base64.b64encode(value) + b'"}'
        return int(self._post("/v3/kv/put", body)["header"]["revision"])

    def get_len(self, key: str) -> int:
        """Length of the stored value of ``key`` (a linearizable range read); -1 if absent."""
        reply = self._post("/v3/kv/range", json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode())
        kvs = reply.get("kvs") or []
        return len(base64.b64decode(kvs[0]["value"])) if kvs else -1

    def compact(self, revision: int) -> None:
        self._post("/v3/kv/compaction", json.dumps({"revision": str(revision)}).encode())

    def status(self, timeout: float = 1.0) -> dict[str, Any]:
        """This member's id, the leader's id (as strings) and its Raft index."""
        return self._post("/v3/maintenance/status", b"{}", timeout=timeout)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class EtcdCluster:
    """A 3-member etcd cluster of child processes, started, killed and stopped by PID."""

    def __init__(self, run_dir: str, base_port: int, members: int = 3, max_request_bytes: int = 17 * MiB):
        self.run_dir = os.path.abspath(run_dir)
        self.base_port = base_port
        self.members = members
        self.max_request_bytes = max_request_bytes
        self.procs: dict[int, subprocess.Popen] = {}
        os.makedirs(self.run_dir, exist_ok=True)

    def client_address(self, k: int) -> str:
        return f"127.0.0.1:{self.base_port + k}"

    def _peer_url(self, k: int) -> str:
        return f"http://127.0.0.1:{self.base_port + PEER_OFFSET + k}"

    def start_member(self, k: int) -> int:
        cluster = ",".join(f"m{i}={self._peer_url(i)}" for i in range(1, self.members + 1))
        argv = [etcd_binary() or "etcd", "--name", f"m{k}", "--data-dir", os.path.join(self.run_dir, f"m{k}"),
                "--listen-client-urls", f"http://{self.client_address(k)}",
                "--advertise-client-urls", f"http://{self.client_address(k)}",
                "--listen-peer-urls", self._peer_url(k), "--initial-advertise-peer-urls", self._peer_url(k),
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"raftps-bench-{self.base_port}",
                "--max-request-bytes", str(self.max_request_bytes), "--quota-backend-bytes", str(QUOTA_BYTES),
                "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]
        with open(os.path.join(self.run_dir, f"m{k}.log"), "ab") as logf:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.procs[k] = proc
        return proc.pid

    def pids(self) -> list[int]:
        return [p.pid for _, p in sorted(self.procs.items())]

    def member_status(self, k: int) -> dict[str, Any] | None:
        kv = EtcdKV(self.client_address(k), timeout=1.0)
        try:
            return kv.status()
        except (OSError, EtcdError, http.client.HTTPException, ValueError):
            return None
        finally:
            kv.close()

    def leader(self) -> int | None:
        """The member (1..N) that every live member names as leader, or None."""
        ids: dict[str, int] = {}
        named: set[str] = set()
        for k in range(1, self.members + 1):
            if self.procs.get(k) is None or self.procs[k].poll() is not None:
                continue
            st = self.member_status(k)
            if not st:
                return None
            ids[st["header"]["member_id"]] = k
            named.add(st.get("leader", "0"))
        return ids.get(named.pop()) if len(named) == 1 else None

    def wait_ready(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for k, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"etcd member {k} exited ({p.returncode}); see {self.run_dir}/m{k}.log")
            leader = self.leader()
            if leader is not None:
                return leader
            time.sleep(0.1)
        raise TimeoutError(f"etcd: no leader within {timeout:.0f} s; see {self.run_dir}/m*.log")

    def start(self, timeout: float = 30.0) -> int:
        for k in range(1, self.members + 1):
            if self.procs.get(k) is None or self.procs[k].poll() is not None:
                self.start_member(k)
        return self.wait_ready(timeout)

    def kill(self, k: int) -> None:
        """SIGKILL member k by PID and reap it."""
        proc = self.procs[k]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_pid(proc, grace=10.0)

    def wipe(self) -> None:
        self.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def measure(run_dir: str, sizes: list[int], clients: list[int], duration: float | dict[int, float], max_ops: int,
            base_port: int) -> list[dict[str, Any]]:
    """Puts of every size x client count on a fresh 3-member cluster; one record each
    (system ``etcd``, op ``push`` so the report lines it up with raftps)."""
    if etcd_binary() is None:
        raise RuntimeError("etcd is not installed: run bench/setup.sh (Debian's etcd-server)")
    cl = EtcdCluster(run_dir, base_port, max_request_bytes=max(sizes) + MiB)
    out: list[dict[str, Any]] = []
    try:
        t0 = time.monotonic()
        leader = cl.start()
        addr = cl.client_address(leader)
        log(f"etcd {etcd_version()}: 3 members up in {time.monotonic() - t0:.1f} s, leader m{leader} at {addr}")
        admin = EtcdKV(addr)
        for size, n in [(s, n) for s in sizes for n in clients]:
            dur = seconds_for(duration, size)
            args = [{"kind": "etcd", "op": "push", "addresses": addr, "size": size, "seed": 1000 * n + k,
                     "duration": dur, "max_ops": max_ops, "timeout": 30.0} for k in range(n)]
            with RssSampler(cl.pids()) as rss:
                res = run_workers(args)
            rec = {"system": "etcd", "op": "push", "size": size, "clients": n, "duration": dur,
                   **summarize(res, size), "peak_rss_mb": max(rss.peak_rss_kb.values(), default=0) / 1024}
            out.append(rec)
            log(f"etcd put {size_label(size)} x{n} ({dur:.0f} s): {rec['ops_per_s']:.1f}/s {rec['MB_per_s']:.1f} MB/s "
                f"p50 {rec['p50_ms']:.1f} ms p99 {rec['p99_ms']:.1f} ms, peak member RSS {rec['peak_rss_mb']:.0f} MB "
                f"({rec['errors']} errors)")
            admin.compact(admin.put("bench/mark", b"x"))       # drop the run's history from the backend
        admin.close()
    finally:
        cl.wipe()
    return out
