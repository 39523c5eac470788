"""Statistical and hardware efficiency on digits: --local vs async (1, 2, 4 workers) vs sync (4).

    python -m trainer.bench [--seeds 3] [--base-port 7300] [--out runs/bench]

For every setting and seed: applied updates and wall time until the test accuracy first reaches
0.95 (evaluated every 2 updates), and applied updates per second; then medians, ratios to
--local, and the raw push rate of the same 4 MiB tensor size on the same cluster. For async
settings, ``sim`` is the median updates-to-0.95 of a zero-overhead store with staleness exactly
K - 1 (trainer/delay_sim.py): the part of the cost that staleness alone explains.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from .config import Config
from .delay_sim import updates_to_target
from .run import TARGET_ACC, train

SETTINGS = [("local", 1), ("async", 1), ("async", 2), ("async", 4), ("sync", 4)]


def raw_push_rate(addresses: str, seconds: float = 5.0, max_pushes: int = 200) -> float:
    """Pushes/s of one client pushing a 1,000,000-float32 tensor (4 MB, the MLP's big layer)."""
    from raftps import Client
    with Client(addresses) as c:
        c.create("bench/raw", np.zeros(1_000_000, np.float32), {"name": "sgd", "lr": 1e-6})
        grad = np.full(1_000_000, 1e-3, np.float32)
        t0, n = time.monotonic(), 0
        while n < max_pushes and time.monotonic() - t0 < seconds:
            c.push({"bench/raw": grad})
            n += 1
        return n / (time.monotonic() - t0)


def simulated(mode: str, workers: int, seeds: int) -> float:
    """Median updates to 0.95 of async SGD with staleness exactly workers - 1 and no store."""
    if mode != "async":
        return float("nan")
    runs = [updates_to_target(Config(workers=workers, seed=s), delay=workers - 1) for s in range(seeds)]
    hit = [r for r in runs if r is not None]
    return statistics.median(hit) if hit else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.bench")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--base-port", type=int, default=7300)
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args(argv)
    from raftps.localcluster import LocalCluster
    cluster = LocalCluster(os.path.join(args.out, "cluster"), nodes=3, base_port=args.base_port)
    os.environ.update(cluster.client_env)   # this process's clients and the workers it starts find the token
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        addresses = cluster.start(timeout=60)
        raw = raw_push_rate(addresses)
        for mode, workers in SETTINGS:
            for seed in range(args.seeds):
                cfg = Config(cluster=addresses, local=mode == "local", mode="sync" if mode == "local" else mode,
                             workers=workers, epochs=args.epochs, seed=seed, evals_per_epoch=11,
                             prefix=f"bench-{mode}{workers}-{seed}", out=os.path.join(args.out, f"{mode}{workers}-{seed}"))
                results.setdefault((mode, workers), []).append(train(cfg))
    finally:
        cluster.wipe()
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    rows = []
    for (mode, workers), runs in results.items():
        hit = [r[f"reached_{TARGET_ACC}"] for r in runs if r[f"reached_{TARGET_ACC}"]]
        rows.append({"setting": f"{mode} x{workers}", "reached": f"{len(hit)}/{len(runs)}",
                     "updates": med([h["updates"] for h in hit]), "time_s": med([h["time_s"] for h in hit]),
                     "startup_s": med([r["first_step_s"] or 0.0 for r in runs]),
                     "upd_per_s": med([r["updates"] / max(r["wall_s"] - (r["first_step_s"] or 0.0), 1e-9) for r in runs]),
                     "final_acc": med([r["final_test_acc"] for r in runs]),
                     "sim": simulated(mode, workers, args.seeds)})
    base = rows[0]
    print(f"raw 4 MB push rate (1 client, same cluster): {raw:.1f} pushes/s")
    print(f"{'setting':10} {'hit':>5} {'upd->0.95':>9} {'x local':>7} {'s->0.95':>8} {'x local':>7} "
          f"{'startup s':>9} {'upd/s':>7} {'/raw':>5} {'final acc':>9} {'sim upd':>7}")
    for r in rows:
        print(f"{r['setting']:10} {r['reached']:>5} {r['updates']:9.1f} {r['updates'] / base['updates']:7.2f} "
              f"{r['time_s']:8.2f} {r['time_s'] / base['time_s']:7.2f} {r['startup_s']:9.2f} {r['upd_per_s']:7.1f} "
              f"{r['upd_per_s'] / raw:5.2f} {r['final_acc']:9.4f} {r['sim']:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
