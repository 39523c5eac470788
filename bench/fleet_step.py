"""Where a synchronous step's bytes and time go on a fleet of shaped links (raftps.chaos.fleet).

    python -m bench.fleet_step [--link 100mbit] [--workers 4] [--mb 5.1] [--steps 5] [--mode sync-pull]
                               [--groups 1] [--parts both] [--answers leader] [--wire fp32] [--chunk-mb 0]
                               [--pairs off] [--ddp]
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
``--groups G``: the store shards the model over G Raft groups (the worker's model is then split
into tensors of equal bytes per group) and waits until their leaders sit on different hosts;
``--parts``: a step's parts go to the groups' leaders at once (the client's lanes), in turn (one
lane: push_step before its parts went at once), or both, one after the other on the same fleet.
``--answers spread``: each rank reads the step's tensors from member rank mod 3 (push_step's
``spread_answers``), ``both``: leader's answers, then spread. ``--wire fp16``: gradients as fp16 (and DDP's all-reduce of fp16). ``--ddp``: then the DDP
baseline on the same fleet, in the same run: gloo all-reduces of the same bytes among the worker
hosts, as DDP does with a step's gradients (one bucket). Steps/s counts steps 1..end.
``--chunk-mb A,B``: a configuration per value, each group's part streamed in chunks of up to
that many MB (push_step's chunk_bytes; 0: whole). Per step, each host's link busy time: the
seconds it sent (received) at more than half the link's rate, from the same samples.
``--pairs on``: each chunked configuration with push_step's ``pairs`` (ranks 2i and 2i + 1 add up
half the chunks each and relay the answers to each other), ``both``: without, then with.
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


def link_rate(link: str) -> float | None:
    """Bytes per second of a ``--link`` such as 100mbit or 1gbit; None when unshaped."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if link.endswith(unit):
            return float(link[:-len(unit)]) * scale / 8
    return None


def busy(samples: list, t0: float, t1: float, rate: float) -> dict[int, list[float]]:
    """{host: [seconds it sent, seconds it received at more than half ``rate``]} within t0..t1."""
    window = [(when, c) for when, c in samples if t0 - SAMPLE <= when <= t1 + SAMPLE]
    out: dict[int, list[float]] = {h: [0.0, 0.0] for h in (window[0][1] if window else {})}
    for (a, ca), (b, cb) in zip(window, window[1:]):
        for h in out:
            for d in (0, 1):
                if (cb[h][d] - ca[h][d]) / (b - a) > rate / 2:
                    out[h][d] = round(out[h][d] + b - a, 2)
    return out


def balanced_leaders(cluster, groups: int, timeout: float = 60.0) -> dict[int, int]:
    """{group: leading node}, once every group is led by its preferred node (node g % N + 1, so
    that with G = N every node leads one group), or as they are after ``timeout`` s. The nodes
    hand leadership over to it every 5 s (replica/upkeep.py); a hand-over during the timed steps
    costs every rank a part sent to the old leader whole and sent again."""
    want = {g: g % cluster.nodes + 1 for g in range(groups)}
    deadline = time.monotonic() + timeout
    while True:
        leaders = {g: cluster.leader(g) for g in range(groups)}
        if leaders == want or time.monotonic() > deadline:
            return leaders
        time.sleep(0.5)


def run_ranks(fleet: Fleet, args: argparse.Namespace, mode: str, address: str, prefix: str, lanes: int,
              env: dict, samples: list, hosts: dict | None, answers: str = "leader", chunk: int = 0,
              pairs: bool = False) -> dict:
    """One configuration: ``--workers`` ranks of fleet_worker MODE, one per worker host; their
    reports, the bytes per host, and per step after the first its seconds (and phases when
    ``hosts`` names the one leader's)."""
    workers = args.workers
    t_start = time.time()
    procs = [fleet.start_worker(r + 1, [sys.executable, "-m", "raftps.chaos.fleet_worker", mode, address, prefix,
                                        str(r), str(workers), str(int(args.mb * MB)), str(args.steps),
                                        str(args.timeout), str(lanes), args.wire, answers, str(chunk),
                                        "pairs" if pairs else "whole"],
                                  env=env, log=subprocess.PIPE)
             for r in range(workers)]
    reports = []
    for p in procs:
        p.wait(args.timeout * (args.steps + 3))
        lines = p.stdout.read().decode().strip().splitlines()
        reports.append(json.loads(lines[-1]) if lines and lines[-1].startswith("{") else
                       {"ok": False, "error": "\n".join(lines[-5:])})
    time.sleep(2 * SAMPLE)
    first, last = at(samples, t_start), samples[-1][1]
    out: dict = {"mode": mode, "lanes": lanes, "answers": answers, "reports": reports,
                 "bytes": {h: [last[h][0] - first[h][0], last[h][1] - first[h][1]] for h in sorted(last)}}
    if not all(r["ok"] and "times" in r for r in reports) or args.steps < 2:
        return out
    steps = []
    for s in range(1, args.steps):
        t0 = min(r["times"][s][0] for r in reports)
        t1 = max(r["times"][s][1] for r in reports)
        a, b = at(samples, t0), at(samples, t1)
        step = {"step": s, "seconds": round(t1 - t0, 3),
                "bytes": {h: [b[h][0] - a[h][0], b[h][1] - a[h][1]] for h in sorted(b)}}
        if hosts:
            step["phases"] = phases(samples, t0, t1, hosts)
        if link_rate(args.link):
            step["busy"] = busy(samples, t0, t1, link_rate(args.link))
        steps.append(step)
    out["steps"] = steps
    begin = min(r["times"][1][0] for r in reports)
    end = max(r["times"][-1][1] for r in reports)
    out["steps_per_s"] = round((args.steps - 1) / (end - begin), 3)
    return out


def run(args: argparse.Namespace) -> dict:
    workers = args.workers
    with tempfile.TemporaryDirectory(prefix="fleet-step-") as run_dir, \
            Fleet(3, workers, link=args.link, prefix="rpsbf", subnet="10.79.9") as fleet:
        cluster = fleet.cluster(run_dir, base_port=37300, groups=args.groups)
        cluster.start()
        leaders = balanced_leaders(cluster, args.groups)
        hosts = None
        if args.groups == 1:
            hosts = {"leader": [leaders[0]], "followers": [n for n in (1, 2, 3) if n != leaders[0]],
                     "workers": [fleet.worker_host(w) for w in range(1, workers + 1)]}
        samples: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample_links, args=(fleet, stop, samples), daemon=True)
        sampler.start()
        env = {**cluster.client_env, "PYTHONPATH": os.getcwd()}
        lanes = args.lanes
        configs = [("one Raft group", lanes)] if args.groups == 1 else \
            [("parts at once", lanes), ("parts in turn", 1)] if args.parts == "both" else \
            [("parts in turn", 1)] if args.parts == "in-turn" else [("parts at once", lanes)]
        answers = ["leader", "spread"] if args.answers == "both" else [args.answers]
        chunk_mbs = [float(v) for v in str(args.chunk_mb).split(",")]
        pairs = {"off": [False], "on": [True], "both": [False, True]}[args.pairs]
        configs = [(name + (", answers from member rank mod 3" if a == "spread" else "")
                    + (f", chunks of {mb:g} MB" if mb else "") + (", pairs" if p else ""), lanes, a, int(mb * MB), p)
                   for name, lanes in configs for a in answers for mb in chunk_mbs for p in pairs if mb or not p]
        runs = {}
        try:
            for i, (name, lanes, a, chunk, p) in enumerate(configs):
                runs[name] = run_ranks(fleet, args, args.mode, cluster.addresses, f"bench{i}", lanes, env, samples,
                                       hosts if args.mode == "sync-pull" else None, a, chunk, p)
            if args.ddp:
                runs["DDP (gloo all-reduce)"] = run_ranks(fleet, args, "allreduce", f"{fleet.ip(fleet.worker_host(1))}:29555",
                                                          "ddp", 1, {"GLOO_SOCKET_IFNAME": "eth0"}, samples, None)
        finally:
            stop.set()
            sampler.join(5)
        return {"link": args.link, "workers": workers, "mb": args.mb, "mode": args.mode, "steps": args.steps,
                "timeout": args.timeout, "groups": args.groups, "leaders": leaders, "runs": runs}


def report(record: dict) -> str:
    lines = [f"# Fleet step: {record['mode']}, {record['workers']} workers, 3 store hosts, {record['link']} per host, "
             f"{record['mb']} MB model, {record['groups']} Raft group(s)", "",
             f"Command: `python -m bench.fleet_step --link {record['link']} --workers {record['workers']} "
             f"--mb {record['mb']} --mode {record['mode']} --steps {record['steps']} --timeout {record['timeout']:g} "
             f"--groups {record['groups']} --parts {record.get('parts', 'both')} --wire {record.get('wire', 'fp32')} "
             f"--answers {record.get('answers', 'leader')} --chunk-mb {record.get('chunk_mb', 0)}"
             f" --pairs {record.get('pairs', 'off')} --lanes {record.get('lanes', 16)}"
             f"{' --ddp' if record.get('ddp') else ''}`"
             f" (commit {record.get('commit', '?')}); leaders (group: store host) {record['leaders']} "
             "(hosts 1-3 store, then workers). Every configuration ran in this one run, on this one fleet."
             + (f" Load average (1, 5, 15 min) of the 2-core machine: {record['load_average']['before']} before, "
                f"{record['load_average']['after']} after." if "load_average" in record else ""), ""]
    timed = {name: r for name, r in record["runs"].items() if "steps_per_s" in r}
    ddp = timed.get("DDP (gloo all-reduce)")
    if timed:
        lines += ["| configuration | steps/s (steps 1..end) | seconds per step (each) | vs DDP |", "|---|---|---|---|"]
        for name, r in timed.items():
            ratio = f"{r['steps_per_s'] / ddp['steps_per_s']:.2f}x" if ddp else "-"
            lines.append(f"| {name} | {r['steps_per_s']:.2f} | {', '.join(str(s['seconds']) for s in r['steps'])} | {ratio} |")
    for name, r in record["runs"].items():
        lines += ["", f"## {name}", ""]
        for rank, rep in enumerate(r["reports"]):
            lines.append(f"- rank {rank}: " + (f"ok in {rep['seconds']:.1f} s, {rep.get('tcp_retransmits', '?')} TCP "
                                               "segments sent again on its host" if rep["ok"] else f"failed: {rep['error']}"))
        lines += ["", "Bytes on each host's link over this configuration (MB sent / received):", "",
                  "| host | sent | received |", "|---|---|---|"]
        lines += [f"| {h} | {s / MB:.2f} | {v / MB:.2f} |" for h, (s, v) in r["bytes"].items()]
        for step in r.get("steps", []):
            said = "; phase ends (s after its first rank started): " + ", ".join(
                f"{k} {v}" for k, v in step["phases"].items()) if "phases" in step else ""
            lines += ["", f"Step {step['step']}: {step['seconds']} s{said}"]
            if "busy" in step:
                lines += ["", "| host | sent MB | received MB | seconds sending / receiving at > half the link's rate |",
                          "|---|---|---|---|"]
                lines += [f"| {h} | {s / MB:.2f} | {v / MB:.2f} | {step['busy'][h][0]} / {step['busy'][h][1]} |"
                          for h, (s, v) in step["bytes"].items()]
            else:
                lines += ["", "| host | sent MB | received MB |", "|---|---|---|"]
                lines += [f"| {h} | {s / MB:.2f} | {v / MB:.2f} |" for h, (s, v) in step["bytes"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_step", description=__doc__.splitlines()[0])
    p.add_argument("--link", default="100mbit")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mb", type=float, default=5.1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--mode", choices=("sync-pull", "sync", "create"), default="sync-pull")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--groups", type=int, default=1, help="Raft groups the store shards the model over")
    p.add_argument("--parts", choices=("both", "at-once", "in-turn"), default="both",
                   help="with several groups: a step's parts at once (the client's lanes), in turn (one lane), or both")
    p.add_argument("--ddp", action="store_true", help="then the DDP baseline on the same fleet: gloo all-reduces "
                   "of the same bytes among the worker hosts")
    p.add_argument("--answers", choices=("leader", "spread", "both"), default="leader",
                   help="spread: each rank reads the step's tensors from store member rank mod 3 "
                   "(push_step's spread_answers) instead of taking them in the leader's answer")
    p.add_argument("--wire", choices=("fp32", "fp16"), default="fp32",
                   help="fp16: sync steps send fp16 gradients (push_step's encoding), DDP all-reduces fp16")
    p.add_argument("--chunk-mb", default="0", help="comma-separated: a configuration per value, each group's part "
                   "streamed in chunks of up to that many MB (push_step's chunk_bytes; 0: whole)")
    p.add_argument("--pairs", choices=("off", "on", "both"), default="off",
                   help="chunked configurations with push_step's pairs (on), without (off), or each both ways")
    p.add_argument("--lanes", type=int, default=16, help="each rank's writes on their way at once (the client's "
                   "max_in_flight) when a step's parts go at once")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--name", default="fleet_step")
    args = p.parse_args(argv)
    problem = available()
    if problem:
        log(f"fleet_step needs a fleet: {problem}")
        return 2
    load_before = os.getloadavg()
    record = run(args)
    record["load_average"] = {"before": [round(x, 2) for x in load_before],
                              "after": [round(x, 2) for x in os.getloadavg()]}
    record["parts"], record["ddp"], record["wire"], record["answers"] = args.parts, args.ddp, args.wire, args.answers
    record["chunk_mb"], record["pairs"], record["lanes"] = args.chunk_mb, args.pairs, args.lanes
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
