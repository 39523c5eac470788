"""``python -m bench [--quick|--full] [--out bench/results] [--parts ...]``: run, print, write.

Parts (in this order): loopback (physical limit), naive (pysyncobj carrying the payload), raw
(bench/raw_dataplane.py, issue 13's design prototype: the raw data plane without validation,
sessions, HMAC or persistence, 4 MiB x4, run right before raftps3), raftps3 (pushes, pulls, node RSS), rss60 (full mode: a 60 s 4 MiB run on a fresh cluster
holding only that model, for the RSS target), raftps1, etcd (etcd 3.4 puts of the same bytes),
failover (10 leader SIGKILLs, raftps and etcd), catchup (a restarted follower through a compacted
log, 4 and 64 MiB models), train (time to 0.95: --local, raftps workers, torch.distributed
all-reduce), and, only when named in --parts, async_algos (bench/async_algos.py: asynchrony-aware
optimizers, SSP, EASGD and top-k; writes its own async_algos.md/.json/.png; ``--parts async_algos``
alone still rewrites results.md in --out, without tables: give it another --out, or run
``python -m bench.async_algos``), sparse (bench/sparse.py, only when named: row-sparse pushes
touching 1% of a 1M x 64 embedding against dense pushes of it; writes sparse.md/.json; the same
caveat), and torch (bench/torch_train.py, only when named: examples/
cnn_digits.py and examples/char_gpt.py through raftps.torch in sync, async and Downpour mode
against one process and DDP x4; writes torch_train.md/.json and torch_<example>.png), and groups
(bench/groups.py, only when named, needs root: CPU-seconds and bytes per 4 MiB push of the busiest
node for (N, G) = (3, 1), (3, 3), (6, 6), (9, 9) Raft groups, nodes in network namespaces; writes
groups.md/.json/.png; the same caveat), and goodput (bench/goodput.py, only when named: time and tokens
to a target validation loss under a worker SIGKILL and a store-leader SIGKILL, for DDP, DDP with
checkpoint-restart, torchft and raftps; writes goodput.md/.json/.png, --quick goodput_quick.*; the
same caveat), and elastic (bench/elastic.py, only when named: a (G = 6, N = 5) cluster holding 128 MiB
(--full: 1 GiB) of tensors: time to rebalance onto an added host, the push rate during it against
before, and time from a host's SIGKILL to 3 replicas of every group; writes elastic.md/.json; the
same caveat). Each is bounded in count and time; a part that fails is reported as failed and the
others still run. etcd and torch come from bench/setup.sh, run once when a part needs them.

Ports, from --base-port B (default 9500): naive B-99..B-87, loopback B-50, raw data plane B-40..B-18, raftps clusters at
B, B+30, B+60, B+90 (failover), B+120 (catch-up), B+150 (training), B+180 (async_algos), B+250 (sparse), B+460 (torch), each using +1..+3, +101..+103,
+201..+203 (groups: base port 31000, inside its own namespaces only); etcd B+401..B+413 and B+421..B+433 (failover); torch rendezvous B+440; torchrun rendezvous of the torch part B+470..B+499; goodput: torchft B+680..B+683, torchrun B+690..B+698,
lighthouse B+699, raftps clusters B+700+10i (each +1..+3, +101..+103, +201..+203, +301..+303); elastic: a
6-group cluster at B+8093 (+1..+2306).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from . import (async_algos, catchup, elastic, etcd, failover, goodput, groups, loopback, naive_store, push, report,
               sparse, torch_train, train)
from .common import KiB, MiB, log, machine

SIZES = [1 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
MODES: dict[str, dict[str, Any]] = {
    # quick: about 3-4 minutes; full: about 12-15 minutes on the 2-core machine
    "quick": dict(loop_bytes=1 << 30, dur=3.0, max_ops=20000, pull_clients=[4], long=0.0,
                  naive=[([4 * MiB], [4])], naive_dur=15.0, naive_max=20, burst=5000,
                  kills=10, catchup_timeout=30.0, train=["local x1", "async x4", "downpour x4", "sync x4"], seeds=1,
                  torch_workers=[1, 4]),
    "full": dict(loop_bytes=2 << 30, dur=10.0, max_ops=200000, pull_clients=[1, 4], long=60.0,
                 naive=[([1 * KiB, 64 * KiB, 1 * MiB, 4 * MiB], [1, 4]), ([16 * MiB], [1, 4])],
                 naive_dur=20.0, naive_max=30, burst=20000,
                 kills=10, catchup_timeout=120.0, train=["local x1", "async x1", "async x2", "async x4",
                                                         "downpour x4", "sync x4"], seeds=2, torch_workers=[1, 2, 4]),
}
CATCHUP_SIZES = [4 * MiB, 64 * MiB]
TRAIN_EPOCHS = 6                # bench.trainer_bench's default: 132 applied updates with --local


def setup_if_needed(parts: list[str]) -> None:
    """Run bench/setup.sh once if a chosen part needs etcd, torch, torchft or cryptography and it is missing."""
    need = ({"etcd", "failover"} & set(parts) and etcd.etcd_binary() is None) or \
        ({"train", "torch", "goodput"} & set(parts) and train.torch_version() is None) or \
        ("goodput" in parts and importlib.util.find_spec("torchft") is None) or \
        ("naive" in parts and importlib.util.find_spec("cryptography") is None)
    if not need:
        return
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "setup.sh")
    log(f"etcd, torch or cryptography missing: running {script}")
    r = subprocess.run(["bash", script], timeout=900)
    if r.returncode:
        log(f"{script} exited {r.returncode}; parts that need what is missing will say so")
    importlib.invalidate_caches()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="a few minutes (default)")
    g.add_argument("--full", action="store_true", help="all sizes on every system, 60 s RSS run")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--parts", default="loopback,naive,raw,raftps3,rss60,raftps1,etcd,failover,catchup,train",
                    help="comma list (default: all); rss60, full mode only: 60 s of 4 MiB x4 on a fresh 3-node cluster")
    ap.add_argument("--base-port", type=int, default=9500, help="every port is derived from it (see above)")
    ap.add_argument("--no-setup", action="store_true", help="never run bench/setup.sh (parts lacking etcd/torch say so)")
    a = ap.parse_args(argv)
    mode = "full" if a.full else "quick"
    m = MODES[mode]
    parts = [p for p in a.parts.split(",") if p != "rss60" or m["long"]]
    run_dir = tempfile.mkdtemp(prefix="raftps-bench-")
    t0 = time.monotonic()
    if not a.no_setup:
        setup_if_needed(parts)
    load0 = os.getloadavg()
    B = a.base_port
    records: list[dict[str, Any]] = []

    def part(name: str, fn: Callable[[], list[dict[str, Any]]]) -> None:
        if name not in parts:
            return
        log(f"== {name} (elapsed {time.monotonic() - t0:.0f} s)")
        try:
            records.extend(fn())
        except Exception as e:
            traceback.print_exc()
            records.append({"system": name, "op": "error", "error": f"{type(e).__name__}: {e}"})

    part("loopback", lambda: loopback.measure(SIZES, target_bytes=m["loop_bytes"], port=B - 50))
    part("naive", lambda: [r for i, (sizes, clients) in enumerate(m["naive"]) for r in naive_store.measure(
        os.path.join(run_dir, f"naive{i}"), sizes, clients, m["naive_dur"], m["naive_max"], base_port=B - 100,
        burst=m["burst"] if i == 0 else 0)])
    part("raw", lambda: push.measure_raw(os.path.join(run_dir, "raw"), 4 * MiB, 4, m["dur"], m["max_ops"], B - 40))
    part("raftps3", lambda: push.measure(os.path.join(run_dir, "raftps3"), 3, SIZES, [1, 4], m["dur"], m["max_ops"],
                                         a.base_port, pull_clients=m["pull_clients"]))
    part("rss60", lambda: push.measure(os.path.join(run_dir, "rss60"), 3, [4 * MiB], [4], m["long"], 10**9,
                                       a.base_port + 30))
    part("raftps1", lambda: push.measure(os.path.join(run_dir, "raftps1"), 1, SIZES, [1, 4], m["dur"], m["max_ops"],
                                         a.base_port + 60, pull_clients=m["pull_clients"]))
    part("etcd", lambda: etcd.measure(os.path.join(run_dir, "etcd"), SIZES, [1, 4], m["dur"], m["max_ops"], B + 400))
    part("failover", lambda: failover.raftps(os.path.join(run_dir, "failover-raftps"), B + 90, m["kills"])
         + failover.etcd(os.path.join(run_dir, "failover-etcd"), B + 420, m["kills"]))
    part("catchup", lambda: catchup.measure(os.path.join(run_dir, "catchup"), CATCHUP_SIZES, B + 120,
                                            timeout=m["catchup_timeout"]))
    part("train", lambda: train.measure(os.path.join(run_dir, "train"), B + 150, m["train"], m["seeds"], TRAIN_EPOCHS,
                                        m["torch_workers"], B + 440))
    # Its own report files (async_algos.md/.json/.png); nothing for results.md's tables.
    part("async_algos", lambda: async_algos.bench_part(os.path.join(run_dir, "async_algos"), B + 180, mode, a.out))
    # Their own report files too (torch_train.md/.json, torch_<example>.png; sparse.md/.json).
    part("torch", lambda: torch_train.bench_part(os.path.join(run_dir, "torch"), B, mode, a.out))
    part("sparse", lambda: sparse.bench_part(os.path.join(run_dir, "sparse"), B + 250, mode, a.out))
    part("groups", lambda: groups.bench_part(a.out, mode))    # groups.md/.json/.png
    part("goodput", lambda: goodput.bench_part(os.path.join(run_dir, "goodput"), B, mode, a.out))   # goodput*.md/.json/.png
    part("elastic", lambda: elastic.bench_part(os.path.join(run_dir, "elastic"), B + 8093, mode, a.out))    # elastic.md/.json
    meta = {"mode": mode, "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "seconds": round(time.monotonic() - t0, 1), "parts": parts,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "loadavg_1m_start_end": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
            "etcd": etcd.etcd_version() if etcd.etcd_binary() else None, "torch": train.torch_version(),
            "durability": "Naive store: pysyncobj in-memory log. raftps: as LocalCluster configures it "
                          "(pysyncobj journal file, never fsynced; payloads in tmpfs until a snapshot). "
                          "etcd: fsyncs its WAL (and bbolt its backend) before it acknowledges a put, on disk."}
    md = report.write(records, meta, a.out)
    print(md)
    log(f"wrote {a.out}/results.md, results.json and plots in {meta['seconds']} s")
    shutil.rmtree(run_dir, ignore_errors=True)
    return 1 if any(r.get("op") == "error" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
