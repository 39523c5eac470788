"""``python -m bench [--quick|--full] [--out bench/results] [--parts ...]``: run, print, write.

Parts (in this order): loopback (physical limit), naive (pysyncobj carrying the payload),
raftps3 (pushes, pulls, node RSS), rss60 (full mode: a 60 s 4 MiB run on a fresh cluster
holding only that model, for the RSS target), raftps1. Each is bounded in count and time; a part that
fails is reported as failed and the others still run.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import platform
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from . import loopback, naive_store, push, report
from .common import KiB, MiB, log

SIZES = [1 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
MODES: dict[str, dict[str, Any]] = {
    # quick: about 3-4 minutes; full: about 12-15 minutes on the 2-core machine
    "quick": dict(loop_bytes=1 << 30, dur=3.0, max_ops=20000, pull_clients=[4], long=0.0,
                  naive=[([4 * MiB], [4])], naive_dur=15.0, naive_max=20, burst=5000),
    "full": dict(loop_bytes=2 << 30, dur=10.0, max_ops=200000, pull_clients=[1, 4], long=60.0,
                 naive=[([1 * KiB, 64 * KiB, 1 * MiB, 4 * MiB], [1, 4]), ([16 * MiB], [1, 4])],
                 naive_dur=20.0, naive_max=30, burst=20000),
}


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, {platform.platform()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="a few minutes (default)")
    g.add_argument("--full", action="store_true", help="all sizes on every system, 60 s RSS run")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--parts", default="loopback,naive,raftps3,rss60,raftps1",
                    help="comma list (default: all); rss60, full mode only: 60 s of 4 MiB x4 on a fresh 3-node cluster")
    ap.add_argument("--base-port", type=int, default=9500,
                    help="raftps 3-node base port (+30: the 60 s RSS cluster, +60: 1-node); naive store 9401-9413")
    a = ap.parse_args(argv)
    mode = "full" if a.full else "quick"
    m = MODES[mode]
    parts = [p for p in a.parts.split(",") if p != "rss60" or m["long"]]
    run_dir = tempfile.mkdtemp(prefix="raftps-bench-")
    t0 = time.monotonic()
    load0 = os.getloadavg()
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

    part("loopback", lambda: loopback.measure(SIZES, target_bytes=m["loop_bytes"]))
    part("naive", lambda: [r for i, (sizes, clients) in enumerate(m["naive"]) for r in naive_store.measure(
        os.path.join(run_dir, f"naive{i}"), sizes, clients, m["naive_dur"], m["naive_max"], burst=m["burst"] if i == 0 else 0)])
    part("raftps3", lambda: push.measure(os.path.join(run_dir, "raftps3"), 3, SIZES, [1, 4], m["dur"], m["max_ops"],
                                         a.base_port, pull_clients=m["pull_clients"]))
    part("rss60", lambda: push.measure(os.path.join(run_dir, "rss60"), 3, [4 * MiB], [4], m["long"], 10**9,
                                       a.base_port + 30))
    part("raftps1", lambda: push.measure(os.path.join(run_dir, "raftps1"), 1, SIZES, [1, 4], m["dur"], m["max_ops"],
                                         a.base_port + 60, pull_clients=m["pull_clients"]))
    meta = {"mode": mode, "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "seconds": round(time.monotonic() - t0, 1), "parts": parts,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "loadavg_1m_start_end": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
            "durability": "Naive store: pysyncobj in-memory log. raftps: as LocalCluster configures it "
                          "(pysyncobj journal file, never fsynced)."}
    md = report.write(records, meta, a.out)
    print(md)
    log(f"wrote {a.out}/results.md, results.json and plots in {meta['seconds']} s")
    shutil.rmtree(run_dir, ignore_errors=True)
    return 1 if any(r.get("op") == "error" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
