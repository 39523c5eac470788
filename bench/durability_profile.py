"""Where a durable push's disk time goes: bytes and fsyncs per push, on a fresh 3-node cluster.

    python -m bench.durability_profile [--size BYTES] [--clients 4] [--seconds 15]
                                       [--durability fsync] [--strace] [--base-port 36100]

Pushes ``--size`` gradients from ``--clients`` processes for ``--seconds`` and reports, from
/proc: the disk's bytes written, write requests, cache flushes and trims per push (the whole disk,
so other work on it shows too) and the share of the time it was busy; each node's bytes written
per push (/proc/PID/io); and each node's snapshot index and spare payload bytes at the end.
``--strace``: also each node's fsync/fdatasync/rename counts and time in them (strace -c, which
slows the nodes: use it for counts, not rates). A run longer than the bench's 6 s shows the
steady state, in which collected payload files are reused as spares.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from typing import Any

import numpy as np

from .common import log, run_workers, size_label, summarize


def disk_of(path: str) -> str:
    """The block device (e.g. vda) holding ``path``, as /proc/diskstats names it."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if int(fields[0]) == major and int(fields[1]) == minor:
                return fields[2]
    return "vda"


def diskstats(device: str) -> dict[str, int]:
    """Cumulative counters of ``device`` (Documentation/admin-guide/iostats.rst)."""
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if fields[2] == device:
                ints = [int(x) for x in fields[3:]]
                ints += [0] * (17 - len(ints))
                return {"writes": ints[4], "sectors_written": ints[6], "busy_ms": ints[9],
                        "sectors_discarded": ints[13], "flushes": ints[15]}
    raise ValueError(f"no disk {device} in /proc/diskstats")


def io_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("write_bytes"))


def per_push(before: dict[str, int], after: dict[str, int], pushes: int, seconds: float) -> dict[str, Any]:
    delta = {k: after[k] - before[k] for k in before}
    return {"disk_MB_per_push": delta["sectors_written"] * 512 / pushes / 1e6,
            "disk_writes_per_push": delta["writes"] / pushes,
            "disk_flushes_per_push": delta["flushes"] / pushes,
            "disk_trim_MB_per_push": delta["sectors_discarded"] * 512 / pushes / 1e6,
            "disk_busy_pct": delta["busy_ms"] / seconds / 10}


def strace(pid: int, out: str) -> subprocess.Popen:
    return subprocess.Popen(["strace", "-f", "-c", "-w", "-e", "trace=fsync,fdatasync,rename,unlink",
                             "-p", str(pid), "-o", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.durability_profile", description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4 << 20)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--durability", default="fsync", choices=("none", "fsync"))
    p.add_argument("--strace", action="store_true")
    p.add_argument("--base-port", type=int, default=36100)
    args = p.parse_args(argv)
    from raftps.tools.localcluster import LocalCluster
    with tempfile.TemporaryDirectory(prefix="durability-profile-", dir=os.getcwd()) as root:
        cluster = LocalCluster(root, nodes=3, base_port=args.base_port, durability=args.durability)
        os.environ.update(cluster.client_env)
        cluster.start()
        try:
            addresses = ",".join(cluster.addresses) if not isinstance(cluster.addresses, str) else cluster.addresses
            admin = cluster.client(addresses, timeout=30.0)
            admin.create("w", np.zeros(max(args.size // 4, 1), np.float32), optimizer={"name": "sgd", "lr": 0.01})
            roles = {s["pid"]: s["role"] for s in admin.status()}
            pids = [int(cluster.pid(node)) for node in range(1, 4)]
            tracers = [strace(pid, os.path.join(root, f"{pid}.strace")) for pid in pids] if args.strace else []
            time.sleep(1.0 if tracers else 0.0)
            device = disk_of(root)
            disk0, node0 = diskstats(device), [io_bytes(pid) for pid in pids]
            res = run_workers([{"kind": "raftps", "op": "push", "addresses": addresses, "name": "w", "size": args.size,
                                "seed": k, "duration": args.seconds, "max_ops": 1_000_000, "timeout": 30.0}
                               for k in range(args.clients)])
            disk1, node1 = diskstats(device), [io_bytes(pid) for pid in pids]
            for tracer in tracers:
                tracer.send_signal(2)
                tracer.wait()
            pushes = max(res["ok"], 1)
            rec = {**summarize(res, args.size), **per_push(disk0, disk1, pushes, res["seconds"])}
            print(f"{args.durability} {size_label(args.size)} x{args.clients} ({args.seconds:.0f} s): "
                  f"{rec['ops_per_s']:.1f}/s {rec['MB_per_s']:.1f} MB/s p50 {rec['p50_ms']:.1f} ms p99 {rec['p99_ms']:.1f} ms")
            print(f"disk {device}: {rec['disk_MB_per_push']:.2f} MB written per push, {rec['disk_writes_per_push']:.1f} "
                  f"write requests, {rec['disk_flushes_per_push']:.1f} cache flushes, {rec['disk_trim_MB_per_push']:.2f} MB "
                  f"trimmed; busy {rec['disk_busy_pct']:.0f}% of the time")
            status = {s["pid"]: s for s in admin.status()}
            for pid, b0, b1 in zip(pids, node0, node1):
                s = status.get(pid, {})
                print(f"  node pid {pid} ({roles.get(pid, '?')}): {(b1 - b0) / pushes / 1e6:.2f} MB written per push; "
                      f"snapshot index {s.get('snapshot_index')} of applied {s.get('applied')}, "
                      f"spare payload files {s.get('payload_spare_bytes', 0) / 1e6:.0f} MB")
            for pid in pids if tracers else []:
                with open(os.path.join(root, f"{pid}.strace")) as f:
                    rows = [line.split() for line in f if line.strip() and line.split()[-1] in
                            ("fsync", "fdatasync", "rename", "unlink")]
                print(f"  node pid {pid}: " + ", ".join(f"{r[-1]} {int(r[3]) / pushes:.2f}/push "
                                                       f"({float(r[1]):.2f} s)" for r in rows))
            admin.close()
        finally:
            cluster.stop()
            log("cluster stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
