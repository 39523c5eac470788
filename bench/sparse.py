"""Row-sparse pushes against dense pushes of one embedding table, on a real 3-node cluster.

    python -m bench.sparse [--rows 1000000] [--dim 64] [--fraction 0.01] [--optimizer sgd]
                           [--seconds 10] [--dense-pushes 5] [--out bench/results] [--base-port 21300]
    python -m bench --parts sparse

One client pushes into a ROWS x DIM float32 table (1M x 64 = 256 MB): first row-sparse pushes
touching FRACTION of the rows (distinct random rows, compress.encode_rows), then dense pushes of
the whole table, on the same cluster; the ratio of the two push rates is the target (>= 20x at
1%). Before that, in this process, the state machine alone: the apply time of one sparse push in
place, of the first sparse push after a full read (it copies the table once, see machine.py) and
of one dense push. A dense 256 MB push fits the default limits (max_frame_mb 1024, a tensor up to
1 GiB). The cluster's --request-timeout is raised from 3 s to 30 s: on a loaded 2-core machine a
256 MB payload can take longer than 3 s to reach a majority and commit, and each timed-out
attempt is sent again, which would make the dense rate (and so the ratio) look worse than the
push itself is. Writes sparse.md and sparse.json in --out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from .common import MiB, log, write_results

REQUEST_TIMEOUT = 30.0        # seconds; see the docstring


def _timed(fn: Any, repeat: int) -> float:
    """Median seconds of ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pushes(rows: int, dim: int, k: int, variants: int = 4) -> list[tuple[dict, dict]]:
    """A few pre-encoded sparse pushes of k distinct random rows, so the client measures pushes,
    not gradient generation."""
    from raftps.compress import encode_rows
    rng = np.random.default_rng(0)
    return [encode_rows("emb", rng.choice(rows, k, replace=False), rng.standard_normal((k, dim)).astype(np.float32))
            for _ in range(variants)]


def apply_costs(rows: int, dim: int, k: int, spec: dict) -> dict[str, float]:
    """Milliseconds per apply in the state machine alone (no Raft, no network)."""
    from raftps.store.machine import TensorStore
    store, index = TensorStore(), 0

    def apply(op: str, **fields: Any) -> dict:
        nonlocal index
        index += 1
        r = store.apply(index, {"op": op, "client": "bench", "seq": index, "ack": index, **fields})
        assert "error" not in r, r
        return r
    apply("create", tensors={"emb": np.zeros((rows, dim), np.float32)}, optimizer={"emb": spec})
    pushes = _pushes(rows, dim, k)
    sparse = _timed(lambda: apply("push", tensors=pushes[index % 4][0], encoding=pushes[index % 4][1]), 20)

    def after_read() -> None:
        store.read(["emb"])                       # a full pull: the next sparse push copies once
        apply("push", tensors=pushes[0][0], encoding=pushes[0][1])
    read_total = _timed(after_read, 3)
    grad = np.full((rows, dim), 1e-3, np.float32)
    dense = _timed(lambda: apply("push", tensors={"emb": grad}), 3)
    return {"sparse_apply_ms": sparse * 1e3, "sparse_apply_after_full_read_ms": read_total * 1e3,
            "dense_apply_ms": dense * 1e3}


def measure(run_dir: str, base_port: int, rows: int = 1_000_000, dim: int = 64, fraction: float = 0.01,
            optimizer: str = "sgd", seconds: float = 10.0, dense_pushes: int = 5) -> dict[str, Any]:
    from raftps.tools.localcluster import LocalCluster
    k = max(1, int(rows * fraction))
    spec = {"name": optimizer, "lr": 0.01}
    out: dict[str, Any] = {"rows": rows, "dim": dim, "table_mb": rows * dim * 4 / MiB, "rows_per_push": k,
                           "fraction": fraction, "optimizer": spec}
    log(f"sparse: state machine apply costs, {rows} x {dim}, {k} rows per sparse push")
    out.update(apply_costs(rows, dim, k, spec))
    pushes = _pushes(rows, dim, k)
    out["sparse_push_bytes"] = sum(a.nbytes for a in pushes[0][0].values())
    out["dense_push_bytes"] = rows * dim * 4
    cluster = LocalCluster(os.path.join(run_dir, "cluster"), nodes=3, base_port=base_port,
                           extra_args=["--request-timeout", str(REQUEST_TIMEOUT)])
    try:
        cluster.start(timeout=60)
        with cluster.client(timeout=300) as c:
            c.create("emb", np.zeros((rows, dim), np.float32), spec)
            c.push(pushes[0][0], encoding=pushes[0][1])          # warm-up: the one copy after create
            log(f"sparse: sparse pushes for {seconds} s")
            lat, t0 = [], time.monotonic()
            while time.monotonic() - t0 < seconds:
                tensors, encoding = pushes[len(lat) % len(pushes)]
                t = time.perf_counter()
                c.push(tensors, encoding=encoding)
                lat.append(time.perf_counter() - t)
            out["sparse_pushes"] = len(lat)
            out["sparse_push_rate"] = len(lat) / (time.monotonic() - t0)
            out["sparse_latency_ms_p50"] = statistics.median(lat) * 1e3
            out["sparse_latency_ms_max"] = max(lat) * 1e3
            grad = np.full((rows, dim), 1e-3, np.float32)
            log(f"sparse: {dense_pushes} dense pushes of {rows * dim * 4 / MiB:.0f} MiB")
            lat, t0 = [], time.monotonic()
            for _ in range(dense_pushes):
                t = time.perf_counter()
                c.push({"emb": grad})
                lat.append(time.perf_counter() - t)
            out["dense_pushes"] = len(lat)
            out["dense_push_rate"] = len(lat) / (time.monotonic() - t0)
            out["dense_latency_ms_p50"] = statistics.median(lat) * 1e3
            out["dense_latencies_ms"] = [round(x * 1e3) for x in lat]
            out["ratio"] = out["sparse_push_rate"] / out["dense_push_rate"]
            out["target_20x_ok"] = out["ratio"] >= 20
            out["pull_rows_ms"] = _timed(lambda: c.pull_rows("emb", pushes[0][0]["emb:indices"]), 5) * 1e3
            out["replicas_converged"] = _converged(c)
    finally:
        cluster.wipe()
    out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return out


def _converged(client: Any, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = client.status(timeout=10.0)
        if all(s["role"] != "down" for s in st) and len({(s["applied"], s["digest"]) for s in st}) == 1:
            return True
        time.sleep(0.5)
    return False


def report(r: dict[str, Any]) -> str:
    return "\n".join([
        "# Row-sparse pushes vs dense pushes",
        "",
        f"{r['rows']:,} x {r['dim']} float32 table ({r['table_mb']:.0f} MiB), optimizer {r['optimizer']['name']}; "
        f"a sparse push touches {r['rows_per_push']:,} distinct rows ({r['fraction']:.0%}); one client; 3-node "
        "LocalCluster on 127.0.0.1, default limits, request timeout "
        f"{REQUEST_TIMEOUT:.0f} s (see bench/sparse.py).",
        "",
        "| push | bytes | pushes/s (cluster) | p50 latency | state machine apply |",
        "|---|---|---|---|---|",
        f"| sparse ({r['fraction']:.0%} rows) | {r['sparse_push_bytes'] / MiB:.2f} MiB | {r['sparse_push_rate']:.1f} "
        f"({r['sparse_pushes']} pushes) | {r['sparse_latency_ms_p50']:.1f} ms | {r['sparse_apply_ms']:.2f} ms in place; "
        f"{r['sparse_apply_after_full_read_ms']:.0f} ms after a full read (one table copy) |",
        f"| dense | {r['dense_push_bytes'] / MiB:.0f} MiB | {r['dense_push_rate']:.2f} ({r['dense_pushes']} pushes) | "
        f"{r['dense_latency_ms_p50']:.0f} ms | {r['dense_apply_ms']:.0f} ms |",
        "",
        f"Latencies of the dense pushes (ms): {r['dense_latencies_ms']}; the slowest sparse push: "
        f"{r['sparse_latency_ms_max']:.0f} ms.",
        "",
        f"Sparse / dense push rate: **{r['ratio']:.0f}x** (target >= 20x: {'met' if r['target_20x_ok'] else 'NOT met'}). "
        f"pull_rows of the {r['rows_per_push']:,} rows: {r['pull_rows_ms']:.1f} ms (median of 5). Replicas converged (same digest): "
        f"{r['replicas_converged']}. Load average at the end: {r['loadavg_1m_end']}.",
        "",
    ])


def bench_part(run_dir: str, base_port: int, mode: str, out: str) -> list[dict]:
    """``python -m bench --parts sparse``: writes sparse.md/.json; no rows for results.md."""
    r = measure(run_dir, base_port, seconds=5.0 if mode == "quick" else 15.0, dense_pushes=3 if mode == "quick" else 8)
    _write(r, out)
    return []


def _write(r: dict[str, Any], out: str) -> None:
    print(write_results(out, "sparse", r, lambda: report(r)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sparse", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adagrad", "adam"])
    ap.add_argument("--seconds", type=float, default=10.0, help="of sparse pushes")
    ap.add_argument("--dense-pushes", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--base-port", type=int, default=21300)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="raftps-sparse-") as run_dir:
        r = measure(run_dir, a.base_port, a.rows, a.dim, a.fraction, a.optimizer, a.seconds, a.dense_pushes)
    _write(r, a.out)
    return 0 if r["target_20x_ok"] and r["replicas_converged"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
