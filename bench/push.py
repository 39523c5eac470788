"""raftps push and pull throughput/latency on a LocalCluster, with node RSS sampled meanwhile.

Pushes: every payload size x every client count (separate processes, each its own
``raftps.Client``), all clients pushing float32 gradients into the same tensor of that size
(SGD, so optimizer state is 0 bytes). Node RSS: VmRSS sampled from /proc/PID/status every 0.2 s
during each run (peak) and VmHWM at the end, as a ratio to model + optimizer state bytes (the sum
of all tensors created, which exist for the whole run). Pulls of the 4 MiB tensor: linearizable
through the leader, and ``linearizable=False`` from the followers.
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from .common import MiB, RssSampler, cpu_times, log, run_workers, seconds_for, size_label, summarize


def _node_pids(cl: Any, nodes: int) -> list[int]:
    try:
        return [int(cl.pid(i)) for i in range(1, nodes + 1)]
    except Exception:
        return [int(cl.pid(i)) for i in range(nodes)]


def _addresses(cl: Any) -> str:
    a = cl.addresses
    return a if isinstance(a, str) else ",".join(a)


def _wait_converged(client: Any, timeout: float = 20.0) -> bool:
    """True once every node reports the same applied index and digest (bounded by timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = client.status()
        live = [s for s in st if s.get("role") != "down"]
        if len(live) == len(st) and len({(s["applied"], s["digest"]) for s in live}) == 1:
            return True
        time.sleep(0.5)
    return False


def _rss_fields(rss: RssSampler, model_bytes: int) -> dict[str, Any]:
    peak = max(rss.peak_rss_kb.values(), default=0) * 1024
    hwm = max(rss.hwm_kb.values(), default=0) * 1024
    top = max(rss.peak_rss_kb, key=rss.peak_rss_kb.get, default=None)
    split = {f"peak_{k}_mb": v / 1024 for k, v in rss.split_kb.get(top, {}).items()}
    return {**split, "peak_rss_mb": peak / MiB, "hwm_mb": hwm / MiB, "model_state_mb": model_bytes / MiB,
            "rss_ratio": peak / model_bytes if model_bytes else float("nan"),
            "rss_target_ok": peak < 3 * model_bytes + 300 * MiB}


def _cpu_fields(node_times: list[tuple[float, ...]], res: dict[str, Any]) -> dict[str, Any]:
    """CPU ms per committed push (busiest node, all nodes and their kernel share, all clients)
    and how many cores the nodes and clients kept busy."""
    ok = max(res["ok"], 1)
    node_cpu = [sum(t) for t in node_times]
    total = sum(node_cpu) + res["client_cpu_s"]
    return {"cpu_ms_per_push_max_node": max(node_cpu) / ok * 1e3, "cpu_ms_per_push_nodes": sum(node_cpu) / ok * 1e3,
            "cpu_ms_per_push_clients": res["client_cpu_s"] / ok * 1e3,
            "node_sys_share": sum(t[1] for t in node_times) / sum(node_cpu) if sum(node_cpu) else float("nan"),
            "cores_busy": total / res["seconds"] if res["seconds"] else float("nan")}


def measure_raw(run_dir: str, size: int, clients: int, duration: float, max_ops: int,
                base_port: int) -> list[dict[str, Any]]:
    """The raw data plane baseline (bench/raw_dataplane.py: the design without validation,
    sessions, HMAC or persistence): 3 node processes, ``clients`` push processes of ``size``."""
    import subprocess
    import sys
    from .common import stop_pid
    from .raw_dataplane import RawClient
    os.makedirs(run_dir, exist_ok=True)
    procs = []
    for i in range(3):
        with open(os.path.join(run_dir, f"raw{i}.log"), "ab") as f:
            procs.append(subprocess.Popen([sys.executable, "-m", "bench.raw_dataplane", str(i), str(base_port)],
                                          stdout=f, stderr=subprocess.STDOUT))
    try:
        leader, deadline = None, time.monotonic() + 60
        while leader is None and time.monotonic() < deadline:
            time.sleep(0.3)
            for i in range(3):
                try:
                    c = RawClient(f"127.0.0.1:{base_port + 20 + i}", timeout=2.0)
                    if c.is_leader():
                        leader = f"127.0.0.1:{base_port + 20 + i}"
                    c.sock.close()
                except OSError:
                    pass
        if leader is None:
            raise RuntimeError(f"raw data plane: no leader within 60 s (logs in {run_dir})")
        pids = [p.pid for p in procs]
        args = [{"kind": "raw", "op": "push", "addresses": leader, "size": size, "seed": 100 + k,
                 "duration": duration, "max_ops": max_ops, "timeout": 30.0} for k in range(clients)]
        cpu0 = [cpu_times(p) for p in pids]
        res = run_workers(args)
        node_cpu = [tuple(b - a for a, b in zip(c, cpu_times(p))) for p, c in zip(pids, cpu0)]
        rec = {"system": "raw-dataplane", "op": "push", "size": size, "clients": clients, "duration": duration,
               **summarize(res, size), **_cpu_fields(node_cpu, res)}
        log(f"raw data plane push {size_label(size)} x{clients} ({duration:.0f} s): {rec['ops_per_s']:.1f}/s "
            f"{rec['MB_per_s']:.1f} MB/s p50 {rec['p50_ms']:.1f} ms ({rec['errors']} errors); CPU/push: nodes "
            f"{rec['cpu_ms_per_push_nodes']:.1f} ms (busiest {rec['cpu_ms_per_push_max_node']:.1f})")
        return [rec]
    finally:
        for p in procs:
            stop_pid(p)


def measure(run_dir: str, nodes: int, sizes: list[int], clients: list[int], duration: float | dict[int, float], max_ops: int,
            base_port: int, pull_clients: list[int] | None = None, durability: str = "none",
            node_args: list[str] | None = None, system: str | None = None,
            pipelined: list[int] | None = None) -> list[dict[str, Any]]:
    """One fresh raftps cluster of ``nodes``; returns one record per (op, size, clients).
    ``pipelined``: also one client keeping that many 1 KiB pushes in flight (push_async)."""
    from raftps.tools.localcluster import LocalCluster
    system = system or f"raftps-{nodes}" + ("-durable" if durability == "fsync" else "")
    cl = LocalCluster(run_dir, nodes=nodes, base_port=base_port, durability=durability, extra_args=node_args)
    os.environ.update(cl.client_env)   # this process's clients and the workers it starts find the token
    out: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        cl.start()                     # inside: a node that fails to start must not leave the others running
        addrs = _addresses(cl)
        pids = _node_pids(cl, nodes)
        log(f"{system}: cluster up in {time.monotonic() - t0:.1f} s, clients at {addrs}, pids {pids}")
        admin = cl.client(addrs, timeout=30.0)
        model_bytes = 0
        for size in sizes:
            admin.create(f"w{size}", np.zeros(max(size // 4, 1), np.float32), optimizer={"name": "sgd", "lr": 0.01})
            model_bytes += max(size // 4, 1) * 4
        for size, n in [(s, n) for s in sizes for n in clients]:
            dur = seconds_for(duration, size)
            args = [{"kind": "raftps", "op": "push", "addresses": addrs, "name": f"w{size}", "size": size,
                     "seed": 1000 * n + k, "duration": dur, "max_ops": max_ops,
                     "timeout": 30.0} for k in range(n)]
            cpu0 = [cpu_times(p) for p in pids]
            with RssSampler(pids) as rss:
                res = run_workers(args)
            node_cpu = [tuple(b - a for a, b in zip(c, cpu_times(p))) for p, c in zip(pids, cpu0)]
            rec = {"system": system, "op": "push", "size": size, "clients": n, "duration": dur,
                   **summarize(res, size), **_rss_fields(rss, model_bytes), **_cpu_fields(node_cpu, res)}
            out.append(rec)
            log(f"{system} push {size_label(size)} x{n} ({dur:.0f} s): {rec['ops_per_s']:.1f}/s {rec['MB_per_s']:.1f} MB/s "
                f"p50 {rec['p50_ms']:.1f} ms p99 {rec['p99_ms']:.1f} ms, peak RSS {rec['peak_rss_mb']:.0f} MB "
                f"({rec['errors']} errors); CPU/push: nodes {rec['cpu_ms_per_push_nodes']:.1f} ms "
                f"(busiest {rec['cpu_ms_per_push_max_node']:.1f}), clients {rec['cpu_ms_per_push_clients']:.1f} ms, "
                f"{rec['cores_busy']:.2f} cores busy, kernel {100 * rec['node_sys_share']:.0f}% of node CPU; RSS split "
                f"{ {k[5:-3]: round(v) for k, v in rec.items() if k.startswith('peak_Rss')} }")
        for depth in (pipelined or []):
            if 1024 not in sizes:
                admin.create("w1024", np.zeros(256, np.float32), optimizer={"name": "sgd", "lr": 0.01})
            res = run_workers([{"kind": "raftps", "op": "push", "addresses": addrs, "name": "w1024", "size": 1024,
                                "seed": 7, "duration": seconds_for(duration, 1024), "max_ops": max_ops, "timeout": 30.0,
                                "in_flight": depth}])
            rec = {"system": system, "op": "push-pipelined", "size": 1024, "clients": 1, "in_flight": depth,
                   **summarize(res, 1024)}
            out.append(rec)
            log(f"{system} push 1 KiB, 1 client, {depth} in flight: {rec['ops_per_s']:.1f}/s p50 {rec['p50_ms']:.1f} ms")
        converged = _wait_converged(admin)
        log(f"{system}: replicas converged (same applied index and digest): {converged}")
        out.append({"system": system, "op": "converged", "ok": converged})
        status = admin.status()
        followers = [s["address"] for s in status if s.get("role") == "follower"]
        admin.close()
        size = 4 * MiB
        for n in (pull_clients or []):
            targets = [("leader", True, [addrs] * n)]
            if followers:
                targets.append(("followers", False, [followers[k % len(followers)] for k in range(n)]))
            for where, lin, per_client in targets:
                args = [{"kind": "raftps", "op": "pull", "addresses": a, "name": f"w{size}", "size": size,
                         "linearizable": lin, "seed": k, "duration": seconds_for(duration, 0), "max_ops": max_ops, "timeout": 30.0}
                        for k, a in enumerate(per_client)]
                with RssSampler(pids) as rss:
                    res = run_workers(args)
                rec = {"system": system, "op": f"pull-{where}", "linearizable": lin, "size": size, "clients": n,
                       **summarize(res, size), **_rss_fields(rss, model_bytes)}
                out.append(rec)
                log(f"{system} pull 4 MiB from {where} (linearizable={lin}) x{n}: {rec['ops_per_s']:.1f}/s "
                    f"{rec['MB_per_s']:.0f} MB/s p50 {rec['p50_ms']:.1f} ms")
    finally:
        cl.stop()
    return out
