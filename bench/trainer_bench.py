"""Statistical and hardware efficiency on digits: --local vs async Downpour (1, 2, 4 workers,
and 4 tuned for few updates) vs sync (4), on one 3-node cluster.

    python -m bench.trainer_bench [--seeds 3] [--base-port 7300] [--out runs/bench] [--settings ...]

For every setting and seed: applied updates, gradient steps and wall time until the test
accuracy first reaches 0.95 (evaluated about every 2 updates), and applied updates per second
(whole run, and steady: between 10% and 90% of the run's updates); then medians, ratios to the
first setting, and the raw push rate of the same 4 MiB tensor on the same cluster. For plain
async settings, ``sim`` is the median updates-to-0.95 of a zero-overhead store with staleness
exactly K - 1 (trainer/delay_sim.py): the part of the cost that staleness alone explains.
``python -m trainer.bench``, its name before it moved here, still runs it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from trainer.config import Config
from trainer.delay_sim import updates_to_target
from trainer.run import TARGET_ACC, train

# label -> Config fields. "downpour x4" is Downpour as tuned for few updates: each worker runs
# 4 local SGD steps between pulls and pushes their sum, and the store divides the lr by the
# push's staleness; its updates carry 4 gradients each (the grad steps column counts them).
SETTINGS: dict[str, dict] = {
    "local x1": dict(local=True, mode="sync", workers=1),
    "async x1": dict(mode="async", workers=1),
    "async x2": dict(mode="async", workers=2),
    "async x4": dict(mode="async", workers=4),
    "downpour x4": dict(mode="async", workers=4, n_fetch=4, n_push=4, staleness_aware=True),
    "sync x4": dict(mode="sync", workers=4),
}


def raw_push_rate(addresses: str, seconds: float = 5.0, max_pushes: int = 200) -> float:
    """Pushes/s of one client pushing a 1,000,000-float32 tensor (4 MB, the MLP's big layer)."""
    from raftps import Client
    with Client(addresses) as c:
        if not any(t["name"] == "bench/raw" for t in c.tensors()):
            c.create("bench/raw", np.zeros(1_000_000, np.float32), {"name": "sgd", "lr": 1e-6})
        grad = np.full(1_000_000, 1e-3, np.float32)
        t0, n = time.monotonic(), 0
        while n < max_pushes and time.monotonic() - t0 < seconds:
            c.push({"bench/raw": grad})
            n += 1
        return n / (time.monotonic() - t0)


def raw_push_rates(addresses: str, measure_runs) -> tuple[dict, object]:
    """The raw rate before and after ``measure_runs()`` (it drifts by 10-20% on this shared
    machine): the ratios use the higher, so drift cannot flatter the trainer."""
    before = raw_push_rate(addresses)
    result = measure_runs()
    after = raw_push_rate(addresses)
    return {"ops_per_s": max(before, after), "before": before, "after": after}, result


def simulated(setting: dict, seeds: int) -> float:
    """Median updates to 0.95 of async SGD with staleness exactly workers - 1 and no store."""
    if setting.get("mode") != "async" or setting.get("n_push", 1) != 1 or setting.get("staleness_aware"):
        return float("nan")
    workers = setting["workers"]
    runs = [updates_to_target(Config(workers=workers, seed=s), delay=workers - 1) for s in range(seeds)]
    hit = [r for r in runs if r is not None]
    return statistics.median(hit) if hit else float("nan")


def summarize(label: str, runs: list[dict]) -> dict:
    """Medians over one setting's seeds: updates, gradient steps and seconds to 0.95 (of the runs
    that reached it), start-up, update rates (whole run after the first step; steady: between 10%
    and 90% of the run's updates) and final accuracy."""
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    hit = [r[f"reached_{TARGET_ACC}"] for r in runs if r[f"reached_{TARGET_ACC}"]]
    n_push = SETTINGS.get(label, {}).get("n_push", 1)
    steady = [r["steady_updates_per_s"] for r in runs if r.get("steady_updates_per_s")]
    return {"setting": label, "reached": f"{len(hit)}/{len(runs)}",
            "updates": med([h["updates"] for h in hit]), "grad_steps": med([h["updates"] * n_push for h in hit]),
            "time_s": med([h["time_s"] for h in hit]), "startup_s": med([r["first_step_s"] or 0.0 for r in runs]),
            "upd_per_s": med([r["updates"] / max(r["wall_s"] - (r["first_step_s"] or 0.0), 1e-9) for r in runs]),
            "steady_upd_per_s": med(steady), "final_acc": med([r["final_test_acc"] for r in runs]),
            "wall_s": med([r["wall_s"] for r in runs])}


def drop_run_tensors(addresses: str, prefix: str) -> None:
    """Delete a finished run's tensors: status digests and snapshots cover the whole store, so
    earlier runs' tensors would slow every later run (and the raw push rate measured after them)."""
    from raftps import Client
    with Client(addresses) as client:
        names = [t["name"] for t in client.tensors() if t["name"].startswith(prefix + "/")]
        if names:
            client.delete(names)


def run_setting(label: str, addresses: str | None, seeds: int, epochs: int, out: str) -> list[dict]:
    """One setting's runs, one per seed, each with its own tensor prefix, deleted after the run."""
    name = label.replace(" ", "")
    runs = []
    for seed in range(seeds):
        cfg = Config(cluster=addresses, epochs=epochs, seed=seed, evals_per_epoch=11, prefix=f"bench-{name}-{seed}",
                     out=os.path.join(out, f"{name}-{seed}"), **SETTINGS[label])
        runs.append(train(cfg))
        if not cfg.local:
            drop_run_tensors(addresses, cfg.prefix)
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trainer_bench")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--base-port", type=int, default=7300)
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), metavar="SETTING",
                    help=f"any of: {', '.join(SETTINGS)} (the first is the ratios' base)")
    args = ap.parse_args(argv)
    from raftps.tools.localcluster import LocalCluster
    cluster = LocalCluster(os.path.join(args.out, "cluster"), nodes=3, base_port=args.base_port)
    os.environ.update(cluster.client_env)   # this process's clients and the workers it starts find the token
    rows = []
    try:
        addresses = cluster.start(timeout=60)
        raws, runs = raw_push_rates(addresses, lambda: [run_setting(label, addresses, args.seeds, args.epochs, args.out)
                                                        for label in args.settings])
    finally:
        cluster.wipe()
    for label, runs_of in zip(args.settings, runs):
        rows.append({**summarize(label, runs_of), "sim": simulated(SETTINGS[label], args.seeds)})
    raw = raws["ops_per_s"]
    base = rows[0]
    print(f"raw 4 MB push rate (1 client, same cluster): {raws['before']:.1f} pushes/s before the runs, "
          f"{raws['after']:.1f} after; ratios use {raw:.1f}")
    print(f"{'setting':11} {'hit':>5} {'upd->0.95':>9} {'x local':>7} {'grads':>6} {'s->0.95':>8} {'x local':>7} "
          f"{'startup s':>9} {'upd/s':>7} {'steady':>7} {'/raw':>5} {'final acc':>9} {'sim upd':>7}")
    for r in rows:
        print(f"{r['setting']:11} {r['reached']:>5} {r['updates']:9.1f} {r['updates'] / base['updates']:7.2f} "
              f"{r['grad_steps']:6.0f} {r['time_s']:8.2f} {r['time_s'] / base['time_s']:7.2f} {r['startup_s']:9.2f} "
              f"{r['upd_per_s']:7.1f} {r['steady_upd_per_s']:7.1f} {r['steady_upd_per_s'] / raw:5.2f} "
              f"{r['final_acc']:9.4f} {r['sim']:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
