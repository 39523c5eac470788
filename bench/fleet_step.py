"""Where a synchronous step's bytes and time go on a fleet of shaped links (raftps.chaos.fleet).

    python -m bench.fleet_step [--link 100mbit] [--workers 4] [--mb 5.1] [--steps 5] [--mode sync-pull]
                               [--out bench/results] [--name fleet_step]

3 store hosts and ``--workers`` worker hosts, one rank each (raftps.chaos.fleet_worker), every
host's link shaped both ways at ``--link``. ``sync-pull``: a job of float32 tensors of ``--mb``
MB in all, ``--steps`` push_step steps with pull=True (as raftps.torch's sync mode runs them).
Each host's link counters (the kernel's) are sampled every 50 ms; for each step after the first,
between the first rank's start and the last rank's answer: the bytes each host sent and received,
and when each phase ended (95% of its bytes had crossed): the contributions into the leader, the
step's payload out to the followers, the answers out to the workers. ``create``: every rank
creates the same tensors at once (what every rank of raftps.torch and DiLoCo did before one rank
became the creator); each rank's outcome and time, and the bytes per host. ``sync``: as sync-pull
without pull (``--steps 0``: rank 0 creates, the others wait for its tensors, and nothing else).
Writes NAME.md and NAME.json in --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from raftps.chaos.fleet import Fleet, available

from .common import MB, log

SAMPLE = 0.05
PHASES = (("contributions in", "leader", 1), ("payload to followers", "followers", 1), ("answers out", "workers", 1))


def sample_links(fleet: Fleet, stop: threading.Event, samples: list) -> None:
    while not stop.is_set():
        samples.append((time.time(), fleet.link_bytes()))
        stop.wait(SAMPLE)


def at(samples: list, t: float) -> dict[int, tuple[int, int]]:
    """The counters of the last sample taken at or before ``t``."""
    best = samples[0][1]
    for when, counters in samples:
        if when > t:
            break
        best = counters
    return best


def phases(samples: list, t0: float, t1: float, hosts: dict[str, list[int]]) -> dict[str, float]:
    """Seconds after t0 at which each phase's receivers had 95% of their bytes of the step."""
    start, end = at(samples, t0), at(samples, t1)
    out = {}
    for phase, role, direction in PHASES:
        total = sum(end[h][direction] - start[h][direction] for h in hosts[role])
        done = next((when for when, c in samples if t0 <= when <= t1 + SAMPLE
                     and sum(c[h][direction] - start[h][direction] for h in hosts[role]) >= 0.95 * total), t1)
        out[phase] = round(done - t0, 2)
    return out


def run(args: argparse.Namespace) -> dict:
    workers = args.workers
    with tempfile.TemporaryDirectory(prefix="fleet-step-") as run_dir, \
            Fleet(3, workers, link=args.link, prefix="rpsbf", subnet="10.79.9") as fleet:
        cluster = fleet.cluster(run_dir, base_port=37300)
        cluster.start()
        leader = cluster.leader()
        hosts = {"leader": [leader], "followers": [n for n in (1, 2, 3) if n != leader],
                 "workers": [fleet.worker_host(w) for w in range(1, workers + 1)]}
        samples: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample_links, args=(fleet, stop, samples), daemon=True)
        sampler.start()
        env = {**cluster.client_env, "PYTHONPATH": os.getcwd()}
        procs = [fleet.start_worker(r + 1, [sys.executable, "-m", "raftps.chaos.fleet_worker", args.mode,
                                            cluster.addresses, "bench", str(r), str(workers), str(int(args.mb * MB)),
                                            str(args.steps), str(args.timeout)], env=env, log=subprocess.PIPE)
                 for r in range(workers)]
        reports = []
        for p in procs:
            p.wait(args.timeout * (args.steps + 3))
            reports.append(json.loads(p.stdout.read().decode().strip().splitlines()[-1]))
        stop.set()
        sampler.join(5)
        first, last = samples[0][1], samples[-1][1]
        record = {"link": args.link, "workers": workers, "mb": args.mb, "mode": args.mode, "steps": args.steps,
                  "timeout": args.timeout, "leader_host": leader,
                  "reports": reports,
                  "bytes": {h: [last[h][0] - first[h][0], last[h][1] - first[h][1]] for h in sorted(last)}}
        if args.mode == "sync-pull" and all(r["ok"] for r in reports):
            steps = []
            for s in range(1, args.steps):
                t0 = min(r["times"][s][0] for r in reports)
                t1 = max(r["times"][s][1] for r in reports)
                a, b = at(samples, t0), at(samples, t1)
                steps.append({"step": s, "seconds": round(t1 - t0, 2), "phases": phases(samples, t0, t1, hosts),
                              "bytes": {h: [b[h][0] - a[h][0], b[h][1] - a[h][1]] for h in sorted(b)}})
            record["steps"] = steps
        return record


def report(record: dict) -> str:
    lines = [f"# Fleet step: {record['mode']}, {record['workers']} workers, 3 store hosts, {record['link']} per host, "
             f"{record['mb']} MB model", "",
             f"Command: `python -m bench.fleet_step --link {record['link']} --workers {record['workers']} "
             f"--mb {record['mb']} --mode {record['mode']} --steps {record['steps']} --timeout {record['timeout']:g}`"
             f" (commit {record.get('commit', '?')}); leader on host {record['leader_host']} "
             "(hosts 1-3 store, then workers).", ""]
    for rank, r in enumerate(record["reports"]):
        lines.append(f"- rank {rank}: " + (f"ok in {r['seconds']:.1f} s" if r["ok"] else f"failed: {r['error']}"))
    lines += ["", "Bytes on each host's link over the whole run (MB sent / received):", "",
              "| host | sent | received |", "|---|---|---|"]
    lines += [f"| {h} | {s / MB:.2f} | {r / MB:.2f} |" for h, (s, r) in record["bytes"].items()]
    for step in record.get("steps", []):
        lines += ["", f"Step {step['step']}: {step['seconds']} s; phase ends (s after its first rank started): "
                  + ", ".join(f"{k} {v}" for k, v in step["phases"].items()),
                  "", "| host | sent MB | received MB |", "|---|---|---|"]
        lines += [f"| {h} | {s / MB:.2f} | {r / MB:.2f} |" for h, (s, r) in step["bytes"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_step", description=__doc__.splitlines()[0])
    p.add_argument("--link", default="100mbit")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mb", type=float, default=5.1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--mode", choices=("sync-pull", "sync", "create"), default="sync-pull")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--name", default="fleet_step")
    args = p.parse_args(argv)
    problem = available()
    if problem:
        log(f"fleet_step needs a fleet: {problem}")
        return 2
    record = run(args)
    record["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    text = report(record)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
