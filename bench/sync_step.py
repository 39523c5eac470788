"""Synchronous steps: every contribution replicated (push_sync + wait_step) against aggregation
before replication (push_step: the leader sums a step's K contributions and replicates one entry),
A/B on one 3-node cluster in one run; then, with --train, the trainer's sync x4 against torch
all-reduce x4 on the same model (bench/train.py).

    python -m bench.sync_step [--workers 4] [--mib 4] [--steps 40] [--train] [--out bench/results]
                              [--base-port 36400]

K worker processes, each with its own Client, contribute a gradient of --mib MiB (float32) to every
step, as K data-parallel workers do; steps/s over the steps after a warm-up, node CPU (whole run, warm-up included) and log
entries per step. Writes sync_step.md and sync_step.json in --out.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

import numpy as np

from .common import cpu_seconds, log, write_results

WARMUP = 3
MODES = [("push_sync", "every contribution replicated (push_sync + wait_step)"),
         ("push_step", "aggregated on the leader (push_step)")]


def _worker(addresses: str, env: dict, mode: str, rank: int, workers: int, size: int, steps: int,
            results: Any) -> None:
    os.environ.update(env)
    from raftps.client.client import Client
    grad = {"w": np.full(size // 4, float(rank + 1), np.float32)}
    stamps = []
    with Client(addresses, timeout=60.0) as c:
        for step in range(steps):
            if mode == "push_step":
                c.push_step(grad, step, workers, job=mode, rank=rank, timeout=30.0)
            else:
                c.push_sync(grad, step, workers, job=mode, rank=rank)
                c.wait_step(step, 30.0, job=mode)
            stamps.append(time.perf_counter())
    results.put((rank, stamps))


def _applied(client: Any) -> int:
    """The highest Raft index any node has applied: log entries so far."""
    return max(row.get("applied") or 0 for row in client.status())


def measure(run_dir: str, base_port: int, workers: int, size: int, steps: int) -> list[dict]:
    from raftps.tools.localcluster import LocalCluster
    cluster = LocalCluster(os.path.join(run_dir, "cluster"), nodes=3, base_port=base_port)
    records = []
    try:
        addresses = cluster.start(timeout=60)
        with cluster.client(timeout=30) as c:
            c.create("w", np.zeros(size // 4, np.float32), {"name": "sgd", "lr": 1e-6})
        ctx = mp.get_context("spawn")
        for mode, label in MODES:
            pids = [cluster.pid(n) for n in (1, 2, 3)]
            cpu0 = [cpu_seconds(pid) for pid in pids]
            with cluster.client(timeout=30) as c:
                entries0 = _applied(c)
            results = ctx.Queue()
            procs = [ctx.Process(target=_worker, args=(addresses, cluster.client_env, mode, r, workers, size, steps,
                                                       results)) for r in range(workers)]
            for p in procs:
                p.start()
            stamps = dict(results.get(timeout=600) for _ in procs)
            cpu = [cpu_seconds(pid) - c0 for pid, c0 in zip(pids, cpu0)]
            with cluster.client(timeout=30) as c:
                entries = _applied(c) - entries0
            for p in procs:
                p.join(30)
            # steps/s from the end of the warm-up to the last step, as every worker saw them
            t0 = max(s[WARMUP - 1] for s in stamps.values())
            t1 = max(s[-1] for s in stamps.values())
            rec = {"mode": mode, "label": label, "workers": workers, "size": size, "steps": steps,
                   "steps_per_s": (steps - WARMUP) / (t1 - t0),
                   "node_cpu_ms_per_step": 1000 * sum(cpu) / steps,
                   "busiest_node_cpu_ms_per_step": 1000 * max(cpu) / steps,
                   "log_entries_per_step": entries / steps}
            log(f"sync steps, {label}: {rec['steps_per_s']:.2f} steps/s, node CPU {rec['node_cpu_ms_per_step']:.0f} "
                f"ms/step (busiest {rec['busiest_node_cpu_ms_per_step']:.0f}), "
                f"{rec['log_entries_per_step']:.2f} log entries per step")
            records.append(rec)
    finally:
        cluster.wipe()
    return records


def report(records: list[dict], train_rows: list[dict]) -> str:
    by = {r["mode"]: r for r in records}
    first = records[0]
    lines = [f"# Sync steps: {first['workers']} workers x {first['size'] >> 20} MiB per step, 3 nodes, one run", "",
             "| exchange | steps/s | node CPU ms/step (busiest node) | log entries per step |", "|---|---|---|---|"]
    for mode, label in MODES:
        r = by.get(mode)
        if r:
            lines.append(f"| {label} | {r['steps_per_s']:.2f} | {r['node_cpu_ms_per_step']:.0f} "
                         f"({r['busiest_node_cpu_ms_per_step']:.0f}) | {r['log_entries_per_step']:.2f} |")
    if len(by) == 2:
        lines += ["", f"push_step / push_sync: {by['push_step']['steps_per_s'] / by['push_sync']['steps_per_s']:.2f}x "
                      f"the steps/s, {by['push_step']['node_cpu_ms_per_step'] / by['push_sync']['node_cpu_ms_per_step']:.2f}x "
                      "the node CPU per step."]
    rows = {r.get("setting"): r for r in train_rows if r.get("setting")}
    ours, theirs = rows.get("sync x4"), rows.get("torch all-reduce x4")
    if ours and theirs:
        lines += ["", "## Training: the trainer's sync x4 against torch all-reduce x4 (same MLP, data, schedule)", "",
                  "| setting | steady updates/s | updates/s from launch | start-up s | final acc |", "|---|---|---|---|---|"]
        for r in (ours, theirs):
            lines.append(f"| {r['setting']} | {r.get('steady_upd_per_s') or 0:.1f} | {r.get('upd_per_s') or 0:.1f} | "
                         f"{r.get('startup_s') or 0:.1f} | {r.get('final_acc') or 0:.4f} |")
        if ours.get("steady_upd_per_s") and theirs.get("steady_upd_per_s"):
            lines += ["", f"sync x4 / torch all-reduce x4, steady update rate: "
                          f"{ours['steady_upd_per_s'] / theirs['steady_upd_per_s']:.2f}x (target >= 0.6x)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sync_step", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mib", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--train", action="store_true", help="also the trainer's sync x4 against torch all-reduce x4")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--base-port", type=int, default=36400)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        records = measure(tmp, args.base_port, args.workers, args.mib << 20, args.steps)
        train_rows: list[dict] = []
        if args.train:
            from . import train
            train_rows = train.measure(os.path.join(tmp, "train"), args.base_port + 30, ["sync x4"], 1, 6, [4],
                                       args.base_port + 90)
    print(write_results(args.out, "sync_step", {"steps": records, "train": train_rows},
                       lambda: report(records, train_rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
