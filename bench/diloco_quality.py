"""DiLoCo against synchronous training at the same tokens: the char GPT x4 on a real 3-node cluster.

``python -m bench.diloco_quality [--batches 300,1200] [--h 5,20,50] [--outer nesterov,average]
[--modes diloco,diloco-async] [--warmup 0,30] [--inner-lr 2e-3,4e-3] [--compress none,fp16,int8]
[--overlap off,on] [--name diloco_quality] [--out bench/results]``: for each configuration, 4 ranks (threads of
this process, each with its own model replica and inner optimizer) train examples/char_gpt.py's
GPT on 1/4 of each global batch of 32 windows, and the validation loss is taken at every budget
in ``--batches``; "sync x4" is raftps's synchronous mode (the store's Adam on the mean gradient
every batch), the reference DiLoCo must match within 5% at the same tokens. Inner optimizer:
torch.optim.Adam at the examples' lr (2e-3), the optimizer sync runs in the store. Outer steps:
"nesterov" (the paper's: momentum SGD, lr 0.7, momentum 0.9, Nesterov) and "average" (SGD lr 1.0:
the global parameters become the mean of the ranks'). Also reports the bytes sent to the store per
token. ``--compress``: the pseudo-gradients' encoding (raftps/client/diloco.py); ``--overlap on``: each
round sent in the background while inner steps go on. Writes NAME.md/.json; progress on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from typing import Any

from .common import log, write_results

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
WORLD, BATCH, LR, SEED = 4, 32, 2e-3, 0
OUTERS = {"nesterov": {"name": "momentum", "lr": 0.7, "momentum": 0.9, "nesterov": True},
          "average": {"name": "sgd", "lr": 1.0},
          # what might close the gap at small budgets: less outer momentum, or a step past the mean
          "nesterov-m0.5": {"name": "momentum", "lr": 0.7, "momentum": 0.5, "nesterov": True},
          "sgd-1.4": {"name": "sgd", "lr": 1.4}}


def run(cluster: Any, label: str, budgets: list[int], mode: str, sync_every: int = 1,
        outer: dict | None = None, warmup: int = 0, lr: float = LR, compress: str = "none",
        overlap: bool = False) -> dict[str, Any]:
    """One configuration: 4 ranks to the largest budget; the validation loss at each budget."""
    import torch
    import raftps.torch as rpt
    sys.path.insert(0, EXAMPLES)
    import char_gpt
    sys.path.remove(EXAMPLES)
    prefix = f"quality-{label.replace(' ', '-').replace('=', '')}-{time.monotonic_ns()}"
    built = [char_gpt.build(SEED, BATCH) for _ in range(WORLD)]
    val: dict[int, float] = {}
    sent = [0] * WORLD
    t0 = time.monotonic()

    def rank(r: int) -> None:
        model, batch_indices, loss_on, val_loss = built[r]
        inner = torch.optim.Adam(model.parameters(), lr=lr)
        extra = {"sync_every": sync_every, "outer": outer, "warmup": warmup, "compress": compress,
                 "overlap": overlap} if mode.startswith("diloco") else {}
        with rpt.DistributedOptimizer(inner, model=model, cluster=cluster.client(timeout=120), mode=mode,
                                      prefix=prefix, rank=r, world_size=WORLD, step_timeout=120.0, **extra) as opt:
            for g in range(max(budgets)):
                idx = batch_indices(g)
                opt.zero_grad()
                loss_on(model, idx[r * BATCH // WORLD:(r + 1) * BATCH // WORLD]).backward()
                opt.step()
                if g + 1 in budgets and overlap:     # the round in flight, applied: the global values
                    opt.flush()
                if r == 0 and g + 1 in budgets:      # at a round's end every rank holds the global values
                    val[g + 1] = val_loss(model)
                    log(f"{label}: batch {g + 1}, validation loss {val[g + 1]:.4f} ({time.monotonic() - t0:.0f} s)")
            sent[r] = opt.bytes_sent if opt.bytes_sent is not None else 0
    errors: list[BaseException] = []

    def guarded(r: int) -> None:
        try:
            rank(r)
        except BaseException as exc:     # re-raised below
            errors.append(exc)
    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    params = sum(p.numel() * 4 for p in built[0][0].parameters())
    tokens = max(budgets) * BATCH * char_gpt.BLOCK
    # sync: every rank sends its float32 gradient every batch
    per_token = (sum(sent) if mode.startswith("diloco") else WORLD * params * max(budgets)) / tokens
    return {"label": label, "mode": mode, "sync_every": sync_every, "outer": outer, "compress": compress,
            "overlap": overlap, "val_loss": val,
            "bytes_per_token": per_token, "seconds": time.monotonic() - t0}


def report(rows: list[dict[str, Any]], budgets: list[int], meta: dict[str, Any]) -> str:
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    lines = ["# DiLoCo against synchronous training, char GPT x4", "",
             f"`{meta['command']}`, {meta['date']}, commit {meta['commit']}, 1-minute load average "
             f"{meta['load'][0]:.1f} at the start and {meta['load'][1]:.1f} at the end (2 cores, shared). 4 ranks "
             "(threads of one process) on 1/4 of each global batch of 32 windows of 64 characters; inner "
             "optimizer torch.optim.Adam lr 2e-3 (sync: the store's Adam, same lr, on the mean gradient).", "",
             "| configuration | " + " | ".join(f"val loss at {b}" for b in budgets) + " | " +
             " | ".join(f"/ sync at {b}" for b in budgets) + " | bytes to the store per token | wall s |",
             "|---|" + "---|" * (2 * len(budgets) + 2)]
    for r in rows:
        losses = [r["val_loss"].get(b) for b in budgets]
        ratios = [(x / sync["val_loss"][b]) if sync and x is not None and b in sync["val_loss"] else None
                  for x, b in zip(losses, budgets)]
        lines.append(f"| {r['label']} | " + " | ".join(f"{x:.4f}" if x is not None else "-" for x in losses) + " | "
                     + " | ".join(f"{x:.3f}x" if x is not None else "-" for x in ratios)
                     + f" | {r['bytes_per_token']:,.0f} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diloco_quality", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="300", help="comma list of budgets (global batches); the largest is run")
    ap.add_argument("--h", default="5,20,50", help="comma list of sync_every values")
    ap.add_argument("--outer", default="nesterov,average", help=f"comma list of {sorted(OUTERS)}")
    ap.add_argument("--modes", default="diloco", help="comma list of diloco, diloco-async")
    ap.add_argument("--warmup", default="0", help="comma list of DiLoCo warm-up steps (rounds of one step first)")
    ap.add_argument("--inner-lr", default=str(LR), help="comma list of the inner Adam's lr")
    ap.add_argument("--compress", default="none", help="comma list of none, fp16, int8 (pseudo-gradients)")
    ap.add_argument("--overlap", default="off", help="comma list of off, on (rounds sent in the background)")
    ap.add_argument("--name", default="diloco_quality", help="the results' file name (NAME.md, NAME.json)")
    ap.add_argument("--no-sync", action="store_true", help="skip the sync x4 reference")
    ap.add_argument("--base-port", type=int, default=25600)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    import subprocess
    from raftps.tools.localcluster import LocalCluster
    budgets = sorted(int(b) for b in a.batches.split(","))
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="raftps-diloco-quality-") as run_dir:
        cluster = LocalCluster(run_dir, nodes=3, base_port=a.base_port)
        cluster.start(timeout=60)
        os.environ.update(cluster.client_env)
        try:
            if not a.no_sync:
                rows.append(run(cluster, "sync x4", budgets, "sync"))
            for mode in a.modes.split(","):
                for h in (int(x) for x in a.h.split(",")):
                    for name in a.outer.split(","):
                        for w in (int(x) for x in a.warmup.split(",")):
                            for lr, comp, olap in ((float(x), c, o) for x in a.inner_lr.split(",")
                                                   for c in a.compress.split(",") for o in a.overlap.split(",")):
                                label = (f"{mode} x4 H={h} {name}" + (f" warmup {w}" if w else "")
                                         + (f" inner lr {lr:g}" if lr != LR else "")
                                         + (f" {comp}" if comp != "none" else "") + (" overlap" if olap == "on" else ""))
                                rows.append(run(cluster, label, budgets, mode, h, OUTERS[name], w, lr, comp,
                                                olap == "on"))
        finally:
            cluster.wipe()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"command": "python -m bench.diloco_quality " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "load": (load0, os.getloadavg()[0])}
    print(write_results(a.out, a.name, {"meta": meta, "rows": rows}, lambda: report(rows, budgets, meta)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
