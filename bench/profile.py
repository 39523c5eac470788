"""Where a raftps node's time goes under push load: py-spy on the leader and one follower.

``python -m bench.profile [--size BYTES] [--clients N] [--seconds S] [--out DIR]`` starts a fresh
3-node LocalCluster, runs N push clients for S seconds, and meanwhile records the leader and a
follower with ``py-spy record --format raw`` (collapsed stacks, non-idle samples only; needs
``pip install py-spy``). Prints, per node, the share of samples by thread and the top functions
by self and by inclusive samples; writes the raw stacks to DIR. ``--perf``: instead, ``perf
record`` of every node's CPU (kernel included: socket copies, page faults, SHA-256 in libcrypto,
numpy), printed as the share of cycles by shared object and by symbol.
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

from .common import MiB, log, run_workers, size_label, stop_pid


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


def _py_spy() -> str | None:
    """py-spy on PATH or next to this interpreter (a venv's bin)."""
    near = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return shutil.which("py-spy") or (near if os.access(near, os.X_OK) else None)


def perf_report(data: str, top: int = 14) -> dict[str, list[tuple[str, float]]]:
    """Shares of cycles by shared object and by (object, symbol) of one ``perf record`` file."""
    def rows(sort: str) -> list[tuple[str, float]]:
        out = subprocess.run(["perf", "report", "-i", data, "--stdio", "--sort", sort, "--no-children"],
                             capture_output=True, text=True).stdout
        got = []
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0].endswith("%") and not line.startswith("#"):
                got.append((" ".join(p for p in parts[1:] if p != "[.]" and p != "[k]"), float(parts[0][:-1])))
        return got[:top]
    return {"dso": rows("dso"), "symbol": rows("dso,sym")}


def _under_load(size: int, clients: int, seconds: float, base_port: int,
                record: Any, durability: str = "none") -> tuple[float, list[tuple[str, str]]]:
    """A fresh 3-node cluster under ``clients`` pushes of ``size`` bytes for ``seconds``, while the
    processes ``record(cluster, leader)`` started ([(role, process, output path)]) record its
    nodes: (pushes/s, [(role, output path)])."""
    from raftps.tools.localcluster import LocalCluster
    run_dir = tempfile.mkdtemp(prefix="raftps-prof-")
    cl = LocalCluster(run_dir, nodes=3, base_port=base_port, durability=durability)
    os.environ.update(cl.client_env)   # this process's clients and the workers it starts find the token
    cl.start()
    recorders: list[tuple[str, subprocess.Popen, str]] = []
    try:
        with cl.client(timeout=30.0) as c:
            c.create("w", np.zeros(size // 4, np.float32), optimizer={"name": "sgd", "lr": 0.01})
        recorders = record(cl, cl.leader())
        args = [{"kind": "raftps", "op": "push", "addresses": cl.addresses, "name": "w", "size": size, "seed": k,
                 "duration": seconds, "max_ops": 10**6, "timeout": 30.0} for k in range(clients)]
        res = run_workers(args)
        for _, p, _ in recorders:
            p.wait(timeout=seconds + 60)
        return res["ops_per_s"], [(role, path) for role, _, path in recorders]
    finally:
        for _, p, _ in recorders:
            stop_pid(p)
        cl.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def run_perf(size: int, clients: int, seconds: float, out: str, base_port: int = 9580,
             durability: str = "none") -> dict[str, Any]:
    """``perf record`` of all three nodes under push load: where their CPU goes, kernel included."""
    os.makedirs(out, exist_ok=True)

    def record(cl: Any, leader: int) -> list[tuple[str, subprocess.Popen, str]]:
        recorders = []
        for node in range(1, 4):
            role = "leader" if node == leader else f"follower{node}"
            path = os.path.join(out, f"perf_{role}_{size_label(size).replace(' ', '')}.data")
            cmd = ["perf", "record", "-F", "499", "-p", str(cl.pid(node)), "-o", path, "--", "sleep", str(int(seconds))]
            recorders.append((role, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path))
        return recorders
    rate, paths = _under_load(size, clients, seconds, base_port, record, durability)
    return {"size": size, "clients": clients, "pushes_per_s": rate,
            "nodes": {role: perf_report(path) for role, path in paths}}


def print_perf(r: dict[str, Any]) -> None:
    print(f"## perf (cycles, kernel included), {size_label(r['size'])} x{r['clients']} clients "
          f"({r['pushes_per_s']:.1f} pushes/s while recorded)")
    for role, s in r["nodes"].items():
        print(f"\n### {role}")
        print("- by object: " + "; ".join(f"{n} {p}%" for n, p in s["dso"][:8]))
        print("- by symbol: " + "; ".join(f"{n} {p}%" for n, p in s["symbol"]))


def run(size: int, clients: int, seconds: float, out: str, base_port: int = 9580, rate: int = 100,
        gil: bool = False, idle: bool = False, durability: str = "none") -> dict[str, Any]:
    spy = _py_spy()
    if not spy:
        raise RuntimeError("py-spy not found: pip install py-spy")
    os.makedirs(out, exist_ok=True)

    def record(cl: Any, leader: int) -> list[tuple[str, subprocess.Popen, str]]:
        follower = next(n for n in range(1, 4) if n != leader)
        recorders = []
        for role, node in (("leader", leader), ("follower", follower)):
            path = os.path.join(out, f"profile_{role}_{size_label(size).replace(' ', '')}.txt")
            cmd = [spy, "record", "--format", "raw", "--threads", "--nonblocking", "--rate", str(rate),
                   "--duration", str(int(seconds)), "--pid", str(cl.pid(node)), "--output", path] \
                + (["--gil"] if gil else []) + (["--idle"] if idle else [])
            recorders.append((role, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path))
        return recorders
    pushes_per_s, paths = _under_load(size, clients, seconds, base_port, record, durability)
    return {"size": size, "clients": clients, "pushes_per_s": pushes_per_s, "gil": gil, "idle": idle,
            "nodes": {role: summarize(path) for role, path in paths}}


def print_report(r: dict[str, Any]) -> None:
    what = "GIL-holding" if r["gil"] else "all (idle included)" if r["idle"] else "non-idle"
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
    ap.add_argument("--perf", action="store_true", help="perf record of every node instead of py-spy")
    ap.add_argument("--idle", action="store_true",
                    help="py-spy: idle samples too (where a thread waits: fsync, poll, locks)")
    ap.add_argument("--durability", choices=["none", "fsync"], default="none", help="the nodes' serve --durability")
    ap.add_argument("--base-port", type=int, default=9580)
    a = ap.parse_args()
    log(f"profiling {size_label(a.size)} x{a.clients} for {a.seconds:.0f} s")
    if a.perf:
        print_perf(run_perf(a.size, a.clients, a.seconds, a.out, a.base_port, a.durability))
    else:
        print_report(run(a.size, a.clients, a.seconds, a.out, a.base_port, gil=a.gil, idle=a.idle,
                         durability=a.durability))


if __name__ == "__main__":
    sys.exit(main())
