"""DiLoCo's steps/s on a fleet of shaped links, its round overlapped with compute or not.

    python -m bench.fleet_diloco [--link 100mbit] [--workers 4] [--mb 5.1] [--h 20] [--rounds 5]
                                 [--step-ms 200] [--compress none] [--out bench/results] [--name fleet_diloco]

3 store hosts and ``--workers`` worker hosts (raftps.chaos.fleet), every host's link shaped both
ways at ``--link``. Each worker runs raftps/client/diloco.py's synchronous rounds on a float32 model of
``--mb`` MB (raftps.chaos.fleet_worker's), H = ``--h``, ``--rounds`` rounds, outer step plain
averaging; an inner step is ``--step-ms`` of compute that leaves the CPU free (a sleep, as a GPU's
kernels would) and a subtraction. Run twice in one fleet, on one cluster, one after the other:
``overlap=False`` (the worker waits for each round) and ``overlap=True`` (the round goes in the
background, raftps/client/diloco.py). Reported per configuration: the job's inner steps per second (H x
rounds over the slowest rank's time from its first inner step to its last round applied, ``finish``
included) and each rank's seconds spent waiting in ``after_inner_step``/``finish``. Writes
NAME.md and NAME.json in --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from .common import MB, log, write_results

AVERAGE = {"name": "sgd", "lr": 1.0}


def worker(argv: list[str]) -> dict:
    """One rank, on a worker host: ADDRESSES PREFIX RANK WORLD BYTES H ROUNDS STEP_S OVERLAP COMPRESS TIMEOUT."""
    import numpy as np
    from raftps import Client
    from raftps.chaos.fleet_worker import model
    from raftps.client.diloco import DiLoCo
    addresses, prefix, rank, world, nbytes, h, rounds, step_s, overlap, compress, timeout = argv
    rank, world, h, rounds, step_s = int(rank), int(world), int(h), int(rounds), float(step_s)
    with Client(addresses, timeout=float(timeout)) as client:
        d = DiLoCo(client, prefix, model(int(nbytes)), rank=rank, world_size=world, sync_every=h, outer=AVERAGE,
                   step_timeout=float(timeout), overlap=overlap == "on",
                   compress=None if compress == "none" else compress)
        try:
            d.create()
            start, local = d.resume()
            waited, t0 = 0.0, time.monotonic()
            for step in range(start, start + h * rounds):
                time.sleep(step_s)                                   # the inner step's compute
                local = {k: v - np.float32(0.001 * (rank + 1)) for k, v in local.items()}
                t = time.monotonic()
                new = d.after_inner_step(step, local)
                waited += time.monotonic() - t
                local.update(new or {})
            t = time.monotonic()
            local.update(d.finish(local))
            waited += time.monotonic() - t
            seconds = time.monotonic() - t0
        finally:
            d.close()
    return {"ok": True, "seconds": seconds, "waited": waited, "steps": h * rounds, "bytes_sent": d.bytes_sent}


def run_config(fleet, cluster, args: argparse.Namespace, overlap: str) -> dict:
    env = {**cluster.client_env, "PYTHONPATH": os.getcwd()}
    prefix = f"fleetdiloco-{overlap}"
    procs = [fleet.start_worker(r + 1, [sys.executable, "-m", "bench.fleet_diloco", "worker", cluster.addresses,
                                        prefix, str(r), str(args.workers), str(int(args.mb * MB)), str(args.h),
                                        str(args.rounds), str(args.step_ms / 1000), overlap, args.compress,
                                        str(args.timeout)], env=env, log=subprocess.PIPE)
             for r in range(args.workers)]
    reports = []
    for p in procs:
        p.wait(args.timeout * (args.rounds + 3))
        lines = p.stdout.read().decode().strip().splitlines()
        reports.append(json.loads(lines[-1]) if lines else {"ok": False, "error": "no output"})
    ok = all(r.get("ok") for r in reports)
    slowest = max(r["seconds"] for r in reports) if ok else None
    with cluster.client() as c:
        from raftps import jobs
        applied = c.sync_applied(jobs.diloco_job(prefix, 0, 1)) + 1
    row = {"overlap": overlap, "reports": reports, "rounds_applied": applied,
           "steps_per_s": args.h * args.rounds / slowest if ok else None}
    log(f"overlap {overlap}: {row['steps_per_s']} steps/s, rounds applied {applied}, "
        f"waited {[round(r.get('waited', 0), 1) for r in reports]} s")
    return row


def run(args: argparse.Namespace) -> dict:
    from raftps.chaos.fleet import Fleet
    with tempfile.TemporaryDirectory(prefix="fleet-diloco-") as run_dir, \
            Fleet(3, args.workers, link=args.link, prefix="rpsfd", subnet="10.79.13") as fleet:
        cluster = fleet.cluster(run_dir, base_port=37700)
        cluster.start()
        rows = [run_config(fleet, cluster, args, overlap) for overlap in ("off", "on")]
    return {"args": vars(args), "rows": rows}


def report(record: dict) -> str:
    a = record["args"]
    compute = a["h"] * a["step_ms"] / 1000
    lines = [f"# DiLoCo on a fleet: {a['workers']} workers, 3 store hosts, {a['link']} per host, overlap off and on", "",
             f"`{record['command']}` (commit {record['commit']}, {record['date']}, 1-minute load average "
             f"{record['load'][0]:.1f} at the start, {record['load'][1]:.1f} at the end; 2 cores, shared). "
             f"{a['mb']} MB float32 model, H = {a['h']}, {a['rounds']} rounds, an inner step = {a['step_ms']} ms "
             f"of compute (a sleep) and a subtraction: {compute:.1f} s of compute per round, "
             f"{1000 / a['step_ms']:.1f} steps/s if rounds cost nothing. "
             f"Compression: {a['compress']}. Both configurations on one fleet and cluster, one after the other.", "",
             "| overlap | inner steps/s (job) | rounds applied | seconds per rank | waiting per rank (s) |",
             "|---|---|---|---|---|"]
    for row in record["rows"]:
        reps = row["reports"]
        if row["steps_per_s"] is None:
            errors = "; ".join(r.get("error", "") for r in reps if not r.get("ok"))
            lines.append(f"| {row['overlap']} | failed: {errors} | {row['rounds_applied']} | - | - |")
            continue
        lines.append(f"| {row['overlap']} | {row['steps_per_s']:.2f} | {row['rounds_applied']} | "
                     + ", ".join(f"{r['seconds']:.1f}" for r in reps) + " | "
                     + ", ".join(f"{r['waited']:.1f}" for r in reps) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        try:
            out = worker(argv[1:])
        except Exception as exc:        # reported to the bench, which names the rank
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.fleet_diloco", description=__doc__.splitlines()[0])
    p.add_argument("--link", default="100mbit")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mb", type=float, default=5.1)
    p.add_argument("--h", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--step-ms", type=float, default=200.0)
    p.add_argument("--compress", default="none", choices=("none", "fp16", "int8"))
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--name", default="fleet_diloco")
    args = p.parse_args(argv)
    from raftps.chaos.fleet import available
    problem = available()
    if problem:
        log(f"fleet_diloco needs a fleet: {problem}")
        return 2
    load0 = os.getloadavg()[0]
    record = run(args)
    record.update(command="python -m bench.fleet_diloco " + " ".join(argv),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip(), load=(load0, os.getloadavg()[0]))
    print(write_results(args.out, args.name, record, lambda: report(record)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
