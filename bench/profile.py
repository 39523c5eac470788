"""Where a raftps node's time goes under push load: py-spy on the leader and one follower.

``python -m bench.profile [--size BYTES] [--clients N] [--seconds S] [--out DIR]`` starts a fresh
3-node LocalCluster, runs N push clients for S seconds, and meanwhile records the leader and a
follower with ``py-spy record --format raw`` (collapsed stacks, non-idle samples only; needs
``pip install py-spy``). Prints, per node, the share of samples by thread and the top functions
by self and by inclusive samples; writes the raw stacks to DIR.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from .common import MiB, log, size_label, stop_pid
from .worker import run_workers


def _short(frame: str) -> str:
    """'func (path/to/file.py:12)' -> 'func (file.py:12)'."""
    func, _, loc = frame.partition(" (")
    return f"{func} ({loc.rstrip(')').rsplit('/', 1)[-1]})" if loc else func


def summarize(raw_file: str, top: int = 12) -> dict[str, Any]:
    """Thread shares, top self and inclusive functions of one py-spy raw (collapsed) file."""
    threads: collections.Counter = collections.Counter()
    self_c: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    with open(raw_file) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            k = int(n)
            frames = stack.split(";")
            total += k
            threads[frames[0]] += k
            funcs = [_short(fr) for fr in frames[1:]]
            if funcs:
                self_c[funcs[-1]] += k
            for fn in set(funcs):
                incl[fn] += k
    pct = (lambda c: [(name, round(100.0 * v / total, 1)) for name, v in c.most_common(top)]) if total else (lambda c: [])
    return {"samples": total, "threads": pct(threads), "self": pct(self_c), "inclusive": pct(incl)}


def run(size: int, clients: int, seconds: float, out: str, base_port: int = 9580, rate: int = 100,
        gil: bool = False) -> dict[str, Any]:
    from raftps.localcluster import LocalCluster
    if not shutil.which("py-spy"):
        raise RuntimeError("py-spy not found: pip install py-spy")
    os.makedirs(out, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="raftps-prof-")
    cl = LocalCluster(run_dir, nodes=3, base_port=base_port)
    os.environ.update(cl.client_env)   # this process's clients and the workers it starts find the token
    cl.start()
    spies: list[tuple[str, subprocess.Popen, str]] = []
    try:
        with cl.client(timeout=30.0) as c:
            c.create("w", np.zeros(size // 4, np.float32), optimizer={"name": "sgd", "lr": 0.01})
        leader = cl.leader()
        follower = next(n for n in range(1, 4) if n != leader)
        for role, node in (("leader", leader), ("follower", follower)):
            path = os.path.join(out, f"profile_{role}_{size_label(size).replace(' ', '')}.txt")
            cmd = ["py-spy", "record", "--format", "raw", "--threads", "--nonblocking", "--rate", str(rate),
                   "--duration", str(int(seconds)), "--pid", str(cl.pid(node)), "--output", path] + (["--gil"] if gil else [])
            spies.append((role, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path))
        args = [{"kind": "raftps", "op": "push", "addresses": cl.addresses, "name": "w", "size": size, "seed": k,
                 "duration": seconds, "max_ops": 10**6, "timeout": 30.0} for k in range(clients)]
        res = run_workers(args)
        for _, p, _ in spies:
            p.wait(timeout=seconds + 30)
        result = {"size": size, "clients": clients, "pushes_per_s": res["ops_per_s"], "gil": gil,
                  "nodes": {role: summarize(path) for role, _, path in spies}}
    finally:
        for _, p, _ in spies:
            stop_pid(p)
        cl.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def print_report(r: dict[str, Any]) -> None:
    what = "GIL-holding" if r["gil"] else "non-idle"
    print(f"## py-spy ({what} samples), {size_label(r['size'])} x{r['clients']} clients "
          f"({r['pushes_per_s']:.1f} pushes/s while profiled)")
    for role, s in r["nodes"].items():
        print(f"\n### {role}: {s['samples']} {what} samples")
        for title in ("threads", "self", "inclusive"):
            print(f"- {title}: " + "; ".join(f"{name} {p}%" for name, p in s[title][:8]))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4 * MiB)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--gil", action="store_true", help="only samples of the thread holding the GIL")
    a = ap.parse_args()
    log(f"profiling {size_label(a.size)} x{a.clients} for {a.seconds:.0f} s")
    print_report(run(a.size, a.clients, a.seconds, a.out, gil=a.gil))


if __name__ == "__main__":
    sys.exit(main())
