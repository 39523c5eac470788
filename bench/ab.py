"""A/B of the push path between source trees, in one session: ``python -m bench.ab --trees A,B``.

Each repetition runs every tree in turn (A, B, A, B, ...; the order alternates between
repetitions), each on a fresh 3-node LocalCluster started from that tree (``PYTHONPATH=tree``,
run from inside it), with ``--clients`` push processes of ``--size`` bytes for ``--seconds``.
Prints pushes/s and the nodes' CPU ms per push for every run, then the medians per tree. Trees
are worktrees of this repository (``git worktree add --detach DIR COMMIT``); bench/push.py of
each tree does the measuring, so a tree needs nothing of this file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

RAW = """
import json, sys
from bench import push
r = push.measure_raw(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), 10**6, int(sys.argv[5]))[0]
print("RESULT " + json.dumps({k: r[k] for k in ("ops_per_s", "MB_per_s", "p50_ms", "p99_ms", "errors",
                                             "cpu_ms_per_push_nodes", "cpu_ms_per_push_max_node", "cores_busy")}))
"""
CHILD = """
import json, sys
from bench import push
recs = push.measure(sys.argv[1], 3, [int(sys.argv[2])], [int(sys.argv[3])], float(sys.argv[4]), 10**6, int(sys.argv[5]))
r = next(r for r in recs if r.get("op") == "push")
print("RESULT " + json.dumps({k: r[k] for k in ("ops_per_s", "MB_per_s", "p50_ms", "p99_ms", "errors",
                                             "cpu_ms_per_push_nodes", "cpu_ms_per_push_max_node", "cores_busy")}))
"""


def _stop_nodes_of(run_dir: str) -> None:
    """SIGKILL the nodes a failed start left behind: the processes whose command line names run_dir."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if run_dir.encode() in f.read():
                    os.kill(int(pid), 9)
        except OSError:
            pass


def run_one(tree: str, size: int, clients: int, seconds: float, port: int) -> dict:
    raw = tree.startswith("raw:")          # raw:TREE: bench/raw_dataplane.py of TREE, not raftps
    tree = tree[4:] if raw else tree
    env = dict(os.environ, PYTHONPATH=tree)
    with tempfile.TemporaryDirectory(prefix="raftps-ab-") as d:
        try:
            out = subprocess.run([sys.executable, "-c", RAW if raw else CHILD, d, str(size), str(clients), str(seconds), str(port)],
                                 cwd=tree, env=env, capture_output=True, text=True, timeout=seconds + 180)
        finally:
            _stop_nodes_of(d)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[7:]), "load": os.getloadavg()[0]}
    raise RuntimeError(f"{tree}: no result (exit {out.returncode}): {out.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    ap.add_argument("--trees", required=True, help="comma list of source trees; raw:TREE is the raw data plane "
                                                   "baseline (bench/raw_dataplane.py) of TREE")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size", type=int, default=4 << 20)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--base-port", type=int, default=34100)
    a = ap.parse_args()
    trees = a.trees.split(",")
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    count = 0
    for rep in range(a.reps):
        order = trees if rep % 2 == 0 else trees[::-1]
        for t in order:
            for attempt in range(3):      # a fresh port range each run (+1..+3, +101.., +201.., +301..)
                count += 1
                try:
                    r = run_one(t, a.size, a.clients, a.seconds, a.base_port + 10 * (count % 10))
                    break
                except RuntimeError as exc:
                    print(f"rep {rep} {t}: run failed, again on other ports: {str(exc)[-300:]}", flush=True)
            else:
                raise SystemExit(f"{t}: three runs failed")
            runs[t].append(r)
            print(f"rep {rep} {t}: {r['ops_per_s']:.1f} pushes/s, nodes {r['cpu_ms_per_push_nodes']:.1f} ms CPU/push "
                  f"(busiest {r['cpu_ms_per_push_max_node']:.1f}), p50 {r['p50_ms']:.0f} ms, errors {r['errors']}, "
                  f"load {r['load']:.1f}", flush=True)
    print("\n| tree | runs | pushes/s (median, all) | node CPU ms/push (median, all) |\n|---|---|---|---|")
    for t in trees:
        ops = [r["ops_per_s"] for r in runs[t]]
        cpu = [r["cpu_ms_per_push_nodes"] for r in runs[t]]
        print(f"| {t} | {len(ops)} | {statistics.median(ops):.1f} ({', '.join(f'{x:.1f}' for x in ops)}) | "
              f"{statistics.median(cpu):.1f} ({', '.join(f'{x:.1f}' for x in cpu)}) |")


if __name__ == "__main__":
    main()
