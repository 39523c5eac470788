"""Linearizable 4 MiB pulls from the leader: --read-mode log (a barrier entry per read) against
readindex (a confirmation round shared by concurrent reads, no entry) and lease (reads on the
leader's lease, rounds only every heartbeat), in the same run; and, as the ceiling, the same pulls
from the lease cluster's leader with linearizable=False (mode "none").

    python -m bench.readindex [--seconds 5] [--clients 1,4] [--base-port 27600]

Three 3-node loopback clusters, one after the other, the same payload and clients. Prints one line
per (mode, clients) and a JSON summary on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time

import numpy as np

from raftps.tools.localcluster import LocalCluster

NAME = "bench.ri"


def rate(cluster: LocalCluster, clients: int, seconds: float, linearizable: bool = True) -> dict:
    leader = cluster.leader()
    address = cluster.client_address(leader)
    counts = [0] * clients
    latencies: list[float] = []
    errors: list[BaseException] = []
    deadline = time.monotonic() + seconds

    def run(i: int) -> None:
        try:
            with cluster.client([address], timeout=30) as c:
                c.pull([NAME])                                  # connect + warm
                while time.monotonic() < deadline:
                    t0 = time.perf_counter()
                    tensors, _ = c.pull([NAME], min_version=0, linearizable=linearizable)
                    latencies.append(time.perf_counter() - t0)
                    assert tensors[NAME].nbytes == 4 << 20
                    counts[i] += 1
        except BaseException as exc:   # reported by the caller
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    elapsed = max(time.monotonic() - start, seconds)
    if errors:
        raise errors[0]
    lat = sorted(latencies)
    return {"clients": clients, "pulls": sum(counts), "pulls_per_s": round(sum(counts) / elapsed, 1),
            "p50_ms": round(1000 * lat[len(lat) // 2], 2) if lat else None,
            "p99_ms": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2) if lat else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--clients", default="1,4")
    p.add_argument("--base-port", type=int, default=27600)
    args = p.parse_args(argv)
    results = []
    payload = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    for k, mode in enumerate(("log", "readindex", "lease")):
        with tempfile.TemporaryDirectory(prefix=f"bench-ri-{mode}-") as run_dir:
            cluster = LocalCluster(run_dir, nodes=3, base_port=args.base_port + 20 * k,
                                   extra_args=["--read-mode", mode])
            try:
                cluster.start(timeout=60)
                with cluster.client(timeout=30) as c:
                    c.create(NAME, payload, {"name": "sgd", "lr": 0.1})
                    c.push({NAME: np.ones_like(payload)})
                runs = [(mode, n, True) for n in (int(x) for x in args.clients.split(","))]
                if mode == "lease":          # the ceiling: the same pulls, not linearizable, from the leader
                    runs += [("none", n, False) for n in (int(x) for x in args.clients.split(","))]
                for label, n, linearizable in runs:
                    before = [r for r in cluster.status() if r["role"] == "leader"][0]
                    row = {"mode": label, **rate(cluster, n, args.seconds, linearizable)}
                    after = [r for r in cluster.status() if r["role"] == "leader"][0]
                    row["entries_appended"] = after["applied"] - before["applied"]
                    row["read_rounds"] = after.get("read_rounds", 0) - before.get("read_rounds", 0)
                    row["lease_reads"] = after.get("lease_reads", 0) - before.get("lease_reads", 0)
                    print(f"{label:9s} clients={n} {row['pulls_per_s']:8.1f} pulls/s  p50 {row['p50_ms']} ms  "
                          f"p99 {row['p99_ms']} ms  entries {row['entries_appended']}  rounds {row['read_rounds']}  "
                          f"on lease {row['lease_reads']}",
                          file=sys.stderr, flush=True)
                    results.append(row)
            finally:
                cluster.wipe()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
