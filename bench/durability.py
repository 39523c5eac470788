"""What durability costs: raftps with --durability fsync against the default (none), and etcd
(which fsyncs its WAL before it acknowledges) when it is installed, pushes of 1 KiB .. 4 MiB.

    python -m bench.durability [--seconds 6] [--seconds-4mib 20] [--clients 4] [--out bench/results]
                               [--base-port 36000]

The 4 MiB points run longer (``--seconds-4mib``, every system alike): a fresh durable node writes
its first payloads into new files (allocated blocks, 320-409 MB/s on this disk for 12 writers)
until its first snapshot makes spares of them, about 5 s into the 4 MiB phase, and a long training
job lives past that; the rate is still the whole window's, warm-up included.
Each mode runs on a fresh 3-node cluster (data dirs on this machine's disk; the non-durable mode's
payloads in tmpfs, as its default). Writes durability.md and durability.json in --out with the
push rates and the ratios issue 15 sets targets on (durable >= 5x etcd's MB/s at 4 MiB, >= 1x etcd
at 1 KiB, durable >= 0.6x non-durable at 4 MiB).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from typing import Any

from . import etcd, push
from .common import KiB, MiB, log, size_label, write_results

SIZES = [1 * KiB, 64 * KiB, 1 * MiB, 4 * MiB]


def filesystem(path: str) -> str:
    out = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout.splitlines()
    return out[-1].split()[1] if len(out) > 1 else "unknown"


def rate(records: list[dict], system: str, size: int) -> dict | None:
    return next((r for r in records if r.get("system") == system and r.get("op") == "push"
                 and r.get("size") == size), None)


def report(records: list[dict], clients: int, disk: str) -> str:
    systems = [("raftps-3", "raftps, durability none"), ("raftps-3-durable", "raftps, durability fsync"),
               ("etcd", "etcd 3-member (fsyncs)")]
    lengths = sorted({(r["size"], r["duration"]) for r in records if r.get("op") == "push"})
    lines = [f"# Durability: pushes x{clients} clients, 3 nodes on one machine ({disk} data dirs)", "",
             "Seconds per point: " + ", ".join(f"{size_label(s)} {d:g}" for s, d in lengths) + ".", "",
             "| system | " + " | ".join(size_label(s) for s in SIZES) + " |",
             "|---|" + "---|" * len(SIZES)]
    for system, label in systems:
        cells = []
        for size in SIZES:
            r = rate(records, system, size)
            cells.append("-" if r is None else f"{r['ops_per_s']:.0f}/s ({r['MB_per_s']:.1f} MB/s)")
        if any(c != "-" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")

    def ratio(a: str, b: str, size: int) -> str:
        ra, rb = rate(records, a, size), rate(records, b, size)
        return "-" if not ra or not rb or not rb["MB_per_s"] else f"{ra['MB_per_s'] / rb['MB_per_s']:.2f}x"
    lines += ["| ratio | measured | target |", "|---|---|---|",
              f"| durable / non-durable, 4 MiB | {ratio('raftps-3-durable', 'raftps-3', 4 * MiB)} | >= 0.6x |",
              f"| durable / etcd, 4 MiB (MB/s) | {ratio('raftps-3-durable', 'etcd', 4 * MiB)} | >= 5x |",
              f"| durable / etcd, 1 KiB | {ratio('raftps-3-durable', 'etcd', 1 * KiB)} | >= 1x |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.durability", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--seconds-4mib", type=float, default=20.0, help="the 4 MiB points' length (every system)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-ops", type=int, default=20000)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--base-port", type=int, default=36000)
    args = p.parse_args(argv)
    records: list[dict[str, Any]] = []
    seconds = {0: args.seconds, 4 * MiB: args.seconds_4mib}
    root = os.path.abspath(os.path.join(args.out, "..", "run-durability"))
    os.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        disk = filesystem(tmp)
        for i, mode in enumerate(("none", "fsync")):
            log(f"durability {mode}: 3 nodes, data on {disk}")
            records += push.measure(os.path.join(tmp, mode), 3, SIZES, [args.clients], seconds,
                                    args.max_ops, args.base_port + 30 * i, durability=mode)
        if etcd.etcd_binary():
            records += etcd.measure(os.path.join(tmp, "etcd"), SIZES, [args.clients], seconds,
                                    args.max_ops, args.base_port + 60)
        else:
            log("etcd is not installed (bench/setup.sh installs it): no etcd rows")
    print(write_results(args.out, "durability", records, lambda: report(records, args.clients, disk)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
