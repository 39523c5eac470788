"""Small writes with and without group commit, A/B in one run on fresh 3-node clusters.

    python -m bench.group_commit [--seconds 6] [--clients 4 16] [--out bench/results] [--base-port 36200]

``--entries-in-flight 0`` (every write its own log entry, as before group commit) against the
default (2 entries in flight; writes arriving meanwhile share the next one), pushes of 1 KiB and
64 KiB from 4 and 16 client processes. Writes group_commit.md and group_commit.json in --out.
"""
from __future__ import annotations

import argparse
import os
import tempfile

from . import naive_store, push
from .common import KiB, log, size_label, write_results

SIZES = [1 * KiB, 64 * KiB]
MODES = [("0", "one write per entry (--entries-in-flight 0)"), ("2", "group commit (default, 2 in flight)")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.group_commit", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--clients", type=int, nargs="+", default=[4, 16])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--base-port", type=int, default=36200)
    args = p.parse_args(argv)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (flight, label) in enumerate(MODES):
            log(f"group commit A/B: {label}")
            records += push.measure(os.path.join(tmp, flight), 3, SIZES, args.clients, args.seconds, 50_000,
                                    args.base_port + 30 * i, node_args=["--entries-in-flight", flight],
                                    system=f"inflight-{flight}", pipelined=[16])
        records += naive_store.measure(os.path.join(tmp, "naive"), [1 * KiB], [], args.seconds, 1000,
                                       base_port=args.base_port + 100, burst=5000)
    lines = ["# Small writes: group commit A/B (3 nodes, one run)", "",
             "| pushes | " + " | ".join(label for _, label in MODES) + " | ratio |", "|---|---|---|---|"]
    for size in SIZES:
        for n in args.clients:
            r = [next((x for x in records if x.get("system") == f"inflight-{f}" and x.get("op") == "push"
                       and x.get("size") == size and x.get("clients") == n), None) for f, _ in MODES]
            cells = ["-" if x is None else f"{x['ops_per_s']:.0f}/s (p50 {x['p50_ms']:.1f} ms, "
                     f"node CPU {x['cpu_ms_per_push_nodes']:.2f} ms/push)" for x in r]
            ratio = "-" if None in r or not r[0]["ops_per_s"] else f"{r[1]['ops_per_s'] / r[0]['ops_per_s']:.2f}x"
            lines.append(f"| {size_label(size)} x{n} | " + " | ".join(cells) + f" | {ratio} |")
    piped = [next((x for x in records if x.get("system") == f"inflight-{f}" and x.get("op") == "push-pipelined"), None)
             for f, _ in MODES]
    base = next((x for x in records if x.get("system") == "pysyncobj-pipelined"), None)
    if None not in piped:
        cells = [f"{x['ops_per_s']:.0f}/s (p50 {x['p50_ms']:.1f} ms)" for x in piped]
        lines.append(f"| 1 KiB, 1 client, 16 in flight (push_async) | " + " | ".join(cells)
                     + f" | {piped[1]['ops_per_s'] / max(piped[0]['ops_per_s'], 1e-9):.2f}x |")
    if base is not None and piped[1] is not None:
        lines += ["", f"pysyncobj's own pipelined 1 KiB command rate (leader alone, no client): "
                  f"{base['ops_per_s']:.0f}/s; raftps 1 KiB, 1 client, 16 in flight, group commit: "
                  f"{piped[1]['ops_per_s'] / base['ops_per_s']:.2f}x of it (target >= 1x)."]
    print(write_results(args.out, "group_commit", records, "\n".join(lines) + "\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
