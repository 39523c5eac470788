"""``python -m bench.goodput --fleet``: its flags, its run, and its report (NAME.md, .json, .png
in --out; ``python -m bench.goodput_fleet_report --merge OUT NAME A.json B.json`` puts several
runs' reports into one): time to target, useful steps/s, the step rate before any fault, bytes on
the links, how long a returning worker took to contribute, the store check after each raftps
run, issue 35's targets against what was measured, and time to target against link rate."""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from .common import log, write_results
from .goodput_report import LABELS, TOKENS_PER_BATCH, WORKERS

CONFIGS = list(LABELS)         # raftps-sync-overlap among them: fleet only (--chunk-bytes)
RETURN_LIMIT_S = 10.0


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _by(results: list[dict], link: str, faults: bool) -> dict[str, dict]:
    return {r["config"]: r for r in results if r.get("link") == link and r.get("faults") == faults
            and "error" not in r and "skipped" not in r}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(results: list[dict]) -> list[dict[str, Any]]:
    """Issue 35's targets, each with the measured ratio (None: not measured) and whether it is met."""
    out = []

    def add(what: str, value: float | None, limit: float, at_most: bool = True) -> None:
        met = None if value is None else (value <= limit if at_most else value >= limit)
        out.append({"what": what, "value": value, "limit": f"{'<=' if at_most else '>='} {limit}", "met": met})
    clean, faulty = _by(results, "100mbit", False), _by(results, "100mbit", True)
    steps = lambda r: r.get("steps_before_fault_per_s") if r else None       # noqa: E731
    ttt = lambda r: r.get("wall_to_target_s") if r else None                  # noqa: E731
    val = lambda r: r.get("val_at_budget") if r else None                     # noqa: E731
    unshaped = _by(results, "unshaped", False)
    add("100 Mbit/s, no faults: raftps sync steps/s / DDP's", _ratio(steps(clean.get("raftps-sync")),
                                                                   steps(clean.get("ddp"))), 1.0, at_most=False)
    add("unshaped, no faults: raftps sync steps/s / DDP's", _ratio(steps(unshaped.get("raftps-sync")),
                                                                 steps(unshaped.get("ddp"))), 0.9, at_most=False)
    same = [abs(val(by.get("raftps-sync")) - val(by.get("ddp"))) for by in (clean, unshaped)
            if val(by.get("raftps-sync")) is not None and val(by.get("ddp")) is not None]
    add("no faults: raftps sync's validation loss at the budget - DDP's (the largest gap)", max(same) if same else None, 0.0)
    add("100 Mbit/s, no faults: raftps DiLoCo steps/s / DDP's", _ratio(steps(clean.get("raftps-diloco")),
                                                                       steps(clean.get("ddp"))), 4.0, at_most=False)
    add("100 Mbit/s, no faults: raftps DiLoCo's validation loss at the budget / sync's",
        _ratio(val(clean.get("raftps-diloco")), val(clean.get("raftps-sync"))), 1.05)
    add("100 Mbit/s, schedule: raftps DiLoCo time to target / DDP + checkpoint-restart's",
        _ratio(ttt(faulty.get("raftps-diloco")), ttt(faulty.get("ddp-ckpt"))), 0.5)
    add("100 Mbit/s, schedule: raftps DiLoCo time to target / torchft DiLoCo's",
        _ratio(ttt(faulty.get("raftps-diloco")), ttt(faulty.get("torchft-diloco"))), 0.7)
    add("100 Mbit/s, schedule: raftps sync time to target / DDP + checkpoint-restart's",
        _ratio(ttt(faulty.get("raftps-sync")), ttt(faulty.get("ddp-ckpt"))), 0.9)
    add("unshaped, raftps DiLoCo under the schedule / DDP without faults, time to target",
        _ratio(ttt(_by(results, "unshaped", True).get("raftps-diloco")), ttt(_by(results, "unshaped", False).get("ddp"))), 1.1)
    backs = [b["to_contribute_s"] for r in results if r.get("config", "").startswith("raftps") for b in r.get("returns", [])]
    add("raftps: the slowest returning worker's seconds to contribute again", max(backs) if backs else None, RETURN_LIMIT_S)
    checks = [r["store_check"]["ok"] for r in results if r.get("store_check")]
    add("raftps store checks failed (nothing acknowledged lost or applied twice)",
        float(checks.count(False)) if checks else None, 0.0)
    return out


def table(results: list[dict], links: list[str]) -> list[str]:
    lines = ["| link | faults | configuration | s to target | useful steps/s | steps/s before faults | val loss at "
             "budget | MB sent (all hosts) | bytes/token | returning workers: s to contribute | store check |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for link in links:
        for faults in (False, True):
            for r in (x for x in results if x.get("link") == link and x.get("faults") == faults):
                head = f"| {link} | {'schedule' if faults else 'none'} | {LABELS[r['config']]} |"
                if "skipped" in r or "error" in r:
                    lines.append(f"{head} {'skipped' if 'skipped' in r else 'failed'}: {r.get('skipped') or r['error']} "
                                 "| | | | | | | |")
                    continue
                backs = ", ".join(f"{b['to_contribute_s']:.1f}" for b in r.get("returns", [])) or "-"
                check = r.get("store_check")
                lines.append(
                    f"{head} {_f(r['wall_to_target_s'], '.1f') if r['wall_to_target_s'] else 'not reached'} | "
                    f"{_f(r['useful_steps_per_s'])} | {_f(r['steps_before_fault_per_s'])} | {_f(r['val_at_budget'], '.4f')} | "
                    f"{r['bytes_sent_total'] / 1e6:,.0f} | {r['bytes_sent_total'] / max(1, r['batches'] * TOKENS_PER_BATCH):,.0f} | "
                    f"{backs} | {'-' if check is None else ('ok' if check['ok'] else 'FAILED')} |")
    return lines


def report(record: dict[str, Any], png: str) -> str:
    m, results = record["meta"], record["results"]
    lines = [f"# Goodput on a fleet: char GPT, {WORKERS} worker hosts and 3 store hosts, links {', '.join(m['links'])}", "",
             f"`{m['command']}`, {m['date']}, commit {m['commit']}, {m['machine']}, torch {m['torch']}, torchft "
             f"{m['torchft']}; 1-minute load average {m['load'][0]:.1f} at the start, {m['load'][1]:.1f} at the end. "
             "**Every host is a network namespace on one loaded, shared 2-core machine**: the links are shaped, "
             "the compute is shared by all 4 workers (and other people's work), so compare within this run.", "",
             f"{m['budget']} global batches of 32 windows x 64 tokens; evaluations every {m['eval_every']} batches. "
             f"Target: DDP without faults' mean validation loss between 70% and 90% of the budget, on the first link "
             f"rate = **{_f(m['target'], '.4f')}**. One inner optimizer: torch.optim.Adam (lr {m['lr']}) for DDP, "
             f"torchft DDP and DiLoCo's inner steps; raftps sync runs the same Adam in the store. DiLoCo H = "
             f"{m['sync_every']}, outer step {m['outer']}. Time counts from the configuration's launch (store nodes, "
             "lighthouse, imports and rendezvous included); bytes are every host's link counters over the run.", "",
             f"Schedule (seed {m['seed']}, the same for every configuration): worker preemptions as a Poisson process "
             f"of mean interval {m['mean_interval_s']:g} s, each host back after {m['return_delay_s']:g} s, the "
             "coordinator lost once (raftps: store leader SIGKILL; torchft: the lighthouse; DDP: rank 0's host, "
             "which holds its rendezvous store). Faults (s since the launch): "
             + "; ".join(f"{f['at_s']:.1f} {'worker host ' + str(f['worker'] + 1) if f['worker'] >= 0 else f['what']} "
                         f"(back {f['back_s']:.1f})" for f in m["faults"]) + ".", ""]
    if m.get("why"):
        lines += [f"Why this schedule and budget: {m['why']}", ""]
    if m.get("raftps"):
        lines += [raftps_setup(m["raftps"]), ""]
    if m.get("merged_from"):
        lines += [f"Merged from {', '.join(m['merged_from'])}: each measured in a run of its own (its target "
                  f"{', '.join(_f(t, '.4f') for t in m['targets_by_run'])}); a ratio below compares configurations "
                  "of one run, never across runs. The load figures: the lowest start and the highest end.", ""]
    lines += table(results, m["links"])
    lines += ["", "Issue 35's targets against this run:", "", "| target | measured | limit | |", "|---|---|---|---|"]
    for t in record["targets"]:
        lines.append(f"| {t['what']} | {_f(t['value'])} | {t['limit']} | "
                     f"{'not measured' if t['met'] is None else 'met' if t['met'] else 'NOT met'} |")
    ckpts = [r for r in results if r.get("config") == "ddp-ckpt" and "checkpoint_every" in r]
    if ckpts:
        lines += ["", "DDP + checkpoint-restart's interval (Young/Daly, sqrt(2 x save x mean interval), the save "
                  "measured on each fleet from worker host 1 to the checkpoint server on store host 2): "
                  + "; ".join(f"{r['link']}: save {r['checkpoint_save_s']:.2f} s, {r['young_daly_s']:.1f} s = every "
                              f"{r['checkpoint_every']} batches" for r in ckpts if not r["faults"]) + "."]
    slowest = [(max(r["returns"], key=lambda b: b["to_contribute_s"]), r) for r in results
               if r.get("config", "").startswith("raftps") and r.get("returns")]
    slowest = [(b, r) for b, r in slowest if b.get("phases")]
    if slowest:
        lines += ["", "Where a returning raftps worker's time went (the slowest return of each run, from its own "
                  "clock; the rest of the seconds to contribute is its launch into the host's namespace):", ""]
        lines += [f"- {r['link']}, {LABELS[r['config']]}: rank {b['rank']} back at {b['back_s']:.1f} s, contributing "
                  f"{b['to_contribute_s']:.1f} s later ({b['phases']})" for b, r in slowest]
    checks = [f"- {r['link']}, {'schedule' if r['faults'] else 'no faults'}, {LABELS[r['config']]}: "
              f"{r['store_check']['verdict']}." for r in results if r.get("store_check")]
    if checks:
        lines += ["", "The store after each raftps run (nothing acknowledged lost or applied twice):", ""] + checks
    lines += ["", "raftps async DiLoCo has no such check: its updates carry no round number to count them by.",
              "", f"![time to target against link rate]({os.path.basename(png)})", ""]
    return "\n".join(lines)


def raftps_setup(setup: dict[str, Any]) -> str:
    """The raftps configuration the run used, as the report's header states it."""
    chunks = (f"sync steps streamed in chunks of {setup['chunk_bytes']:,} bytes on links of at most 100 Mbit/s "
              f"(whole parts on faster ones){', in pairs of ranks' if setup.get('pairs') else ''}; (d) raftps sync, "
              "overlap: the same, each chunk sent as soon as backward has made its gradients (overlap=True; "
              "unshaped, without chunks, it is (d))" if setup["chunk_bytes"]
              else "sync steps sent whole")
    return (f"raftps as documented for a fleet: the model sharded over {setup['groups']} Raft group(s), their leaders "
            f"on different store hosts; {chunks}; DiLoCo's pseudo-gradients as {setup['compress']} (the asynchronous "
            "DiLoCo's dense).")


def plot(results: list[dict], links: list[str], png: str) -> str:
    """Time to target against link rate, one line per configuration (dashed: under the schedule)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, name in enumerate(CONFIGS):
        for faults, style in ((False, "-"), (True, "--")):
            pts = [(x, r["wall_to_target_s"]) for x, link in enumerate(links) for r in results
                   if r.get("config") == name and r.get("link") == link and r.get("faults") == faults
                   and r.get("wall_to_target_s") is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=f"C{i}",
                        label=LABELS[name] + (", schedule" if faults else ""))
    ax.set_xticks(range(len(links)), links)
    ax.set(xlabel="link rate per host (both ways)", ylabel="seconds from launch to the target",
           title="time to target against link rate (dashed: under the failure schedule; loaded 2-core machine)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def write(record: dict[str, Any], out: str, name: str) -> str:
    os.makedirs(out, exist_ok=True)
    png = plot(record["results"], record["meta"]["links"], os.path.join(out, f"{name}.png"))
    return write_results(out, name, record, lambda: report(record, png))


def merge(paths: list[str], out: str, name: str) -> str:
    """One report of several runs' records (each a link rate or more, measured in one run each):
    their tables side by side and time to target against every link rate in one plot. A ratio
    compares configurations of one run only (one link rate)."""
    import json
    records = [json.load(open(p)) for p in paths]
    # two runs at one link rate (some configurations each) share its rows and its point on the plot
    meta = {**records[0]["meta"], "links": list(dict.fromkeys(link for r in records for link in r["meta"]["links"])),
            "command": "; ".join(r["meta"]["command"] for r in records),
            "date": ", ".join(r["meta"]["date"] for r in records),
            "commit": ", ".join(r["meta"]["commit"] for r in records),
            "load": (min(r["meta"]["load"][0] for r in records), max(r["meta"]["load"][1] for r in records)),
            "merged_from": [os.path.basename(p) for p in paths],
            "targets_by_run": [r["meta"]["target"] for r in records]}
    results = [x for r in records for x in r["results"]]
    return write({"meta": meta, "results": results, "targets": targets(results)}, out, name)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--merge"]:           # python -m bench.goodput_fleet_report --merge OUT NAME A.json B.json ...
        print(merge(argv[3:], argv[1], argv[2]))
        return 0
    from . import goodput_fleet as gf
    from .goodput_schedule import schedule
    ap = argparse.ArgumentParser(prog="python -m bench.goodput --fleet", description=gf.__doc__.splitlines()[0])
    ap.add_argument("--fleet", action="store_true", required=True)
    ap.add_argument("--links", default="unshaped,1gbit,100mbit,20mbit", help="comma list of per-host link rates")
    ap.add_argument("--configs", help=f"comma list of {CONFIGS} ((a) ddp always runs first: it sets the target)")
    ap.add_argument("--budget", type=int, default=40, help="global batches")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--sync-every", type=int, default=5, help="DiLoCo's H")
    ap.add_argument("--outer", choices=("average", "nesterov"), default="average")
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--mean-interval", type=float, default=60.0, help="seconds between preemptions (Poisson mean)")
    ap.add_argument("--return-delay", type=float, default=10.0, help="seconds a preempted host stays away")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one configuration may run; also the schedule's horizon (the coordinator is lost "
                    "between 15%% and 50%% of it)")
    ap.add_argument("--coordinator-at", default="0.15,0.5", help="LO,HI: the coordinator is lost at a seeded offset "
                    "between these fractions of the horizon (--timeout)")
    ap.add_argument("--why", default="", help="why this schedule and budget: a sentence the report's header carries")
    ap.add_argument("--schedule", choices=("both", "off", "on"), default="both",
                    help="run every configuration without the failure schedule, with it, or both")
    ap.add_argument("--groups", type=int, default=3, help="raftps: Raft groups the model is sharded over (leaders "
                    "on different store hosts)")
    ap.add_argument("--chunk-bytes", type=int, default=53_000, help="raftps sync: a step streamed in chunks of this "
                    "many bytes on links of at most 100 Mbit/s (0: whole parts everywhere)")
    ap.add_argument("--compress", choices=("none", "fp16", "int8"), default="int8",
                    help="raftps DiLoCo: its pseudo-gradients on the wire")
    ap.add_argument("--net", default="rpsgp,10.79.21", help="the fleet's namespace prefix and /24 subnet (two "
                    "runs at once need two)")
    ap.add_argument("--base-port", type=int, default=24000)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="goodput_fleet")
    ap.add_argument("--run-dir", help="keep every run's logs and metrics here (default: a temporary folder, removed)")
    a = ap.parse_args(argv)
    from raftps.chaos.fleet import available, parse_rate
    problem = available()
    if problem:
        log(f"goodput --fleet needs a fleet: {problem}")
        return 2
    links = [x.strip() for x in a.links.split(",") if x.strip()]
    for link in links:
        try:
            parse_rate(link)
        except ValueError as e:
            ap.error(str(e))
    configs = [c.strip() for c in a.configs.split(",")] if a.configs else CONFIGS
    unknown = set(configs) - set(CONFIGS)
    if unknown or a.budget < 4 or a.eval_every < 1 or a.sync_every < 1:
        ap.error(f"unknown configurations {sorted(unknown)}" if unknown else "--budget >= 4, --eval-every and --sync-every >= 1")
    from .goodput_launch import char_gpt_lr, torchft_available
    skip = torchft_available()
    try:
        lo, hi = (float(x) for x in a.coordinator_at.split(","))
    except ValueError:
        ap.error(f"--coordinator-at takes LO,HI (fractions of --timeout), got {a.coordinator_at!r}")
    if not 0 <= lo <= hi <= 1:
        ap.error(f"--coordinator-at: 0 <= LO <= HI <= 1, got {lo},{hi}")
    faults = schedule(a.seed, a.timeout, a.mean_interval, a.return_delay, WORKERS, (lo, hi))
    load0, t0 = os.getloadavg()[0], time.monotonic()
    results: list[dict] = []
    with (contextlib.nullcontext(os.path.abspath(a.run_dir)) if a.run_dir else
          tempfile.TemporaryDirectory(prefix="raftps-goodput-fleet-")) as run_dir:
        os.makedirs(run_dir, exist_ok=True)
        plan = gf.Plan(links, a.budget, a.eval_every, a.sync_every, a.outer, a.timeout, a.seed, a.mean_interval,
                       a.return_delay, run_dir, a.base_port,
                       {"both": (False, True), "off": (False,), "on": (True,)}[a.schedule], tuple(a.net.split(",")),
                       groups=a.groups, chunk_bytes=a.chunk_bytes, compress=a.compress)
        chosen = ["ddp"] + [c for c in configs if c != "ddp" and not (skip and c.startswith("torchft"))]
        for link in links:
            results += [{"config": c, "link": link, "faults": f, "skipped": skip} for c in configs
                        if skip and c.startswith("torchft") for f in plan.schedules]
            gf.run_link(plan, link, chosen, faults, results)
    meta = {"links": links, "budget": a.budget, "eval_every": a.eval_every, "sync_every": a.sync_every, "outer": a.outer,
            "seed": a.seed, "mean_interval_s": a.mean_interval, "return_delay_s": a.return_delay, "why": a.why, "target": plan.target,
            "faults": [f.as_dict() for f in faults if f.at_s < a.timeout], "command": "python -m bench.goodput " + " ".join(argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{os.cpu_count()} cores",
            "load": (load0, os.getloadavg()[0]), "seconds": round(time.monotonic() - t0),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "torch": __import__("torch").__version__, "torchft": "missing" if skip else _version("torchft"),
            "lr": char_gpt_lr(), "raftps": {"groups": a.groups, "chunk_bytes": a.chunk_bytes, "pairs": plan.pairs,
                                                  "compress": a.compress}}
    record = {"meta": meta, "results": results, "targets": targets(results)}
    print(write(record, a.out, a.name))
    return 1 if any("error" in r for r in results) else 0


def _version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
