"""Goodput under faults: ``python -m bench --parts goodput`` (or ``python -m bench.goodput
[--quick|--full]``): time and tokens to a target validation loss when workers and the store's
leader are SIGKILLed, for DDP, DDP with checkpoint-restart, torchft and raftps, all on one
loopback. ``--fleet``: on hosts with shaped links instead (bench/goodput_fleet.py).

Every configuration trains examples/char_gpt.py's GPT on its data with its seed, global batch
(32 windows of 64 tokens) and token budget (``budget`` global batches), 4 workers, one after
the other on this machine. The fault schedule: at 30% of the budget one worker is SIGKILLed and
its launcher starts it again; at 60% the store's leader is SIGKILLed (raftps runs only).

  (a) ddp           DDP (gloo) under torchrun, no faults: the ceiling; it defines the target, its
                    validation loss at 80% of the budget;
  (b) ddp-ckpt      DDP with ``torch.save`` checkpoints every N global batches (N sized from the
                    measured save time and (a)'s step time so that saving costs about 5%), torchrun
                    ``--max-restarts`` restarts the group, which resumes from the last checkpoint;
  (c) torchft-ddp / torchft-diloco   torchft 0.2.0 (gloo): each replica group under its own
                    torchrun (``--max-restarts``), a ``torchft_lighthouse --min_replicas 1``;
  (d) raftps-sync   raftps.torch sync (store-side Adam) on a fresh 3-node LocalCluster;
  (e) raftps-diloco, (f) raftps-diloco-async   raftps.torch wrapping Adam (DDP's), the outer step in
                    the store: ``--outer`` (plain averaging by default, or the paper's Nesterov
                    momentum; torchft's DiLoCo runs the same one), asynchronous: averaging.
raftps workers run one supervised process each (the supervisor restarts a dead one alone).
The torchft and raftps DiLoCo workers are bench/goodput_worker.py; the launchers are
bench/goodput_launch.py; what is measured and reported, from rank 0's metrics.csv, is
bench/goodput_report.py.

A configuration runs until it has passed the budget and reached the target, or twice the budget.
Reported per configuration: wall time (from the launch) and tokens (global batches computed,
recomputed ones included) to the target, validation loss at the budget and at the end, steps
recomputed (rank 0 computing a batch it had computed before) and steps taken short of the killed
worker's part, bytes sent to the store per token (the nodes' client-frame byte counters) or
all-reduced per token (computed: every rank's gradient, or pseudo-gradient every H steps), and the
step rate before the first fault. Writes goodput.{md,json,png} (--quick: goodput_quick.*).

Ports from --base-port B: raftps clusters at B+700+10i (+1..3, +101..103, +201..203, +301..303
/metrics), torchrun rendezvous B+690..B+698 (torchft replica groups B+680..B+683), the torchft
lighthouse B+699.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

from .common import log
from .goodput_launch import Supervised, Torchrun, char_gpt_lr, char_gpt_module, raftps_argv, torchft_available
from .goodput_report import (ACKED_ROUNDS, BATCH, CHECKPOINT_COST, LABELS, LEADER_KILL_AT, TOKENS_PER_BATCH,
                             WORKER_KILL_AT, WORKERS, batch_rows, read_rows, reached, short_steps, store_check, summarize,
                             target_from, write_report)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAR_GPT = os.path.join(ROOT, "examples", "char_gpt.py")
WORKER = os.path.join(ROOT, "bench", "goodput_worker.py")
MODES = {   # budget (global batches), evaluation interval, DiLoCo's H, per-run limit (s)
    # evaluations at round ends (eval_every a multiple of H) and at 80% of the budget (the target)
    "quick": dict(budget=50, eval_every=5, sync_every=5, timeout=240),
    "full": dict(budget=300, eval_every=20, sync_every=20, timeout=1800),
}
CONFIGS = ["ddp", "ddp-ckpt", "torchft-ddp", "torchft-diloco", "raftps-sync", "raftps-diloco", "raftps-diloco-async"]


# ---- one configuration under the fault schedule ------------------------------------------------

@dataclass
class Run:
    name: str
    out: str                                   # the run's --out: metrics.csv
    launch_unix: float = field(default_factory=time.time)
    events: list[tuple[float, str]] = field(default_factory=list)
    fault_steps: dict[str, int] = field(default_factory=dict)   # what was killed -> rank 0's step then


def _last_step(rows: list[dict]) -> int:
    return max((r["step"] for r in rows), default=0)


def drive(run: Run, job: Any, budget: int, target: float | None, timeout: float,
          faults: list[tuple[float, str, Callable[[], str]]]) -> bool:
    """Watch rank 0's metrics.csv; fire each fault (fraction of the budget, name, action) once rank 0
    passes it; stop once past the budget with the target reached (or at twice the budget, or the
    job's end, or ``timeout``). Returns whether the job itself finished cleanly."""
    pending = sorted(faults)
    deadline, said = time.monotonic() + timeout, 0.0
    while True:
        rows = read_rows(os.path.join(run.out, "metrics.csv"))
        step = _last_step(rows)
        while pending and step >= pending[0][0] * budget:
            _, what, action = pending.pop(0)
            run.events.append((time.time(), f"SIGKILL {what}"))
            run.fault_steps[what] = step
            log(f"goodput {run.name}: step {step}: SIGKILL {what}: {action()}")
        if job.done():
            return job.ok()
        hit = target is not None and reached(rows, target) is not None
        if step >= 2 * budget or (step >= budget and (target is None or hit)):
            return False
        if time.monotonic() > deadline:
            run.events.append((time.time(), "timeout"))
            log(f"goodput {run.name}: timed out after {timeout:.0f} s at step {step}")
            return False
        if time.monotonic() - said > 15:
            evals = [r for r in rows if r["val"] is not None]
            log(f"goodput {run.name}: step {step}/{budget}, {time.time() - run.launch_unix:.0f} s, val loss "
                f"{evals[-1]['val'] if evals else float('nan'):.3f} (target {target if target else 'after (a)'})")
            said = time.monotonic()
        time.sleep(0.2)


def client_bytes_in(cluster: Any) -> dict[str, float]:
    """Each live node's count of client-frame bytes received (its /metrics), by node address."""
    out = {}
    for row in cluster.client().status(digest=False):
        if row.get("role") == "down" or not row.get("metrics"):
            continue
        try:
            text = urllib.request.urlopen(f"http://{row['metrics']}/metrics", timeout=5).read().decode()
        except OSError:
            continue
        m = re.search(r'^raftps_client_bytes_total\{direction="in"\} (\S+)$', text, re.M)
        if m:
            out[row["address"]] = float(m.group(1))
    return out


def param_bytes() -> int:
    model = char_gpt_module().build(0, BATCH)[0]
    return sum(p.numel() * p.element_size() for p in model.parameters())


def checkpoint_seconds(repeat: int = 5) -> float:
    """Median seconds of one torch.save of the char GPT's model and Adam state (what (b) writes)."""
    import statistics
    import torch
    model, batch_indices, loss_on, _ = char_gpt_module().build(0, BATCH)
    opt = torch.optim.Adam(model.parameters())
    loss_on(model, batch_indices(0)[:2]).backward()
    opt.step()                                          # Adam's state exists
    d = tempfile.mkdtemp(prefix="raftps-goodput-ckpt-")
    times = []
    try:
        for _ in range(repeat):
            t = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, os.path.join(d, "c.tmp"))
            os.replace(os.path.join(d, "c.tmp"), os.path.join(d, "c.pt"))
            times.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return statistics.median(times)


def raftps_diloco_available() -> str | None:
    """None when raftps.torch takes the wrapped DiLoCo form; else why not."""
    import inspect
    try:
        import raftps.torch as rpt
    except ImportError as e:
        return f"raftps.torch does not import: {e}"
    params = inspect.signature(rpt.DistributedOptimizer).parameters       # a class or a function
    modes = getattr(rpt, "MODES", ())
    if "model" not in params or "diloco" not in modes or "diloco-async" not in modes:
        return (f"raftps.torch.DistributedOptimizer does not take the wrapped form yet (modes {tuple(modes)}, "
                f"no model= argument): issue 30's mode='diloco'/'diloco-async' is not on this branch")
    return None


# ---- the configurations -------------------------------------------------------------------

@dataclass
class Setup:
    mode: str
    run_dir: str
    base_port: int
    budget: int
    eval_every: int
    sync_every: int
    timeout: float
    param_bytes: int
    outer: str = "average"                      # DiLoCo's outer step, torchft's and raftps's alike
    target: float | None = None
    checkpoint_every: int = 0
    checkpoint_timing: tuple[float, float] = (0.0, 0.0)     # one save, (a)'s step: ms
    runs: int = 0                               # configurations started: each gets its own ports


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1"}


def _char_gpt_args(s: Setup, steps: int, out: str) -> list[str]:
    return ["--steps", str(steps), "--eval-every", str(s.eval_every), "--out", out]


def run_ddp(s: Setup, name: str) -> dict[str, Any]:
    """(a) no faults, --steps budget; (b) checkpoints every N, a worker SIGKILL, torchrun restarts the group."""
    out = os.path.join(s.run_dir, name)
    os.makedirs(out)
    faulted = name == "ddp-ckpt"
    args = ["--backend", "ddp", *_char_gpt_args(s, 2 * s.budget if faulted else s.budget, out)]
    if faulted:
        args += ["--checkpoint", os.path.join(out, "checkpoint.pt"), "--checkpoint-every", str(s.checkpoint_every)]
    run = Run(name, out)
    job = Torchrun(CHAR_GPT, args, WORKERS, s.base_port + 690 + s.runs, _env(), os.path.join(out, "torchrun.log"))
    try:
        faults = [(WORKER_KILL_AT, "worker", lambda: f"pid {job.kill_worker()}")] if faulted else []
        completed = drive(run, job, s.budget, s.target if faulted else None, s.timeout, faults)
    finally:
        job.stop()
    rows = read_rows(os.path.join(out, "metrics.csv"))
    extra = {"bytes_per_token": WORKERS * s.param_bytes / TOKENS_PER_BATCH, "bytes_how": "computed: 4 ranks' gradients "
             "all-reduced every batch", "short_steps": 0, "launcher": "one torchrun, --max-restarts 3"}
    if faulted:
        extra["checkpoint_every"] = s.checkpoint_every
        extra["checkpoint_save_ms"], extra["step_ms_of_a"] = s.checkpoint_timing
    return _finish(s, run, rows, completed, extra)


def run_torchft(s: Setup, name: str) -> dict[str, Any]:
    """(c) one torchrun per replica group (nproc 1, --max-restarts 3) and a lighthouse; replica group 3 SIGKILLed."""
    out = os.path.join(s.run_dir, name)
    os.makedirs(out)
    lighthouse_port = s.base_port + 699
    lh_log = open(os.path.join(out, "lighthouse.log"), "ab")
    lighthouse = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse"),
                                   "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                                   "--bind", f"127.0.0.1:{lighthouse_port}"],
                                  stdout=lh_log, stderr=subprocess.STDOUT, start_new_session=True)
    run = Run(name, out)
    groups: list[Torchrun] = []
    try:
        for r in range(WORKERS):
            env = {**_env(), "REPLICA_GROUP_ID": str(r), "NUM_REPLICA_GROUPS": str(WORKERS),
                   "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}"}
            args = ["--kind", name, "--steps", str(2 * s.budget), "--eval-every", str(s.eval_every),
                    "--sync-every", str(s.sync_every), "--outer", s.outer, "--out", out]
            groups.append(Torchrun(WORKER, args, 1, s.base_port + 680 + r, env,
                                   os.path.join(out, f"group{r}.log")))
        job = _AnyDone(groups)
        faults = [(WORKER_KILL_AT, "replica group 3's worker", lambda: f"pid {groups[-1].kill_worker()}")]
        completed = drive(run, job, s.budget, s.target, s.timeout, faults)
    finally:
        for g in groups:
            g.stop()
        if lighthouse.poll() is None:
            lighthouse.kill()
        lighthouse.wait(10)
        lh_log.close()
    rows = read_rows(os.path.join(out, "metrics.csv"))
    short = os.path.join(out, "short_steps.txt")
    n_short = len(open(short).read().split()) if os.path.exists(short) else 0
    per = 1 if name == "torchft-ddp" else s.sync_every
    extra = {"bytes_per_token": WORKERS * s.param_bytes / (per * TOKENS_PER_BATCH),
             "bytes_how": "computed: 4 replica groups' " + ("gradients every batch" if per == 1 else
                                                              f"pseudo-gradients every {per} batches"),
             "short_steps": n_short, "launcher": "a torchrun per replica group, --max-restarts 3; a lighthouse"}
    if name == "torchft-diloco":
        extra.update(sync_every=s.sync_every, outer=s.outer)
    return _finish(s, run, rows, completed, extra)


class _AnyDone:
    """Replica group 0's end is the job's end (it writes the metrics)."""

    def __init__(self, groups: list[Torchrun]):
        self.groups = groups

    def done(self) -> bool:
        return self.groups[0].done()

    def ok(self) -> bool:
        return self.groups[0].ok()


def run_raftps(s: Setup, name: str) -> dict[str, Any]:
    """(d)-(f) a fresh 3-node LocalCluster; one supervised process per rank; rank 3 SIGKILLed at 30%,
    the leader at 60%."""
    from raftps.tools.localcluster import LocalCluster
    out = os.path.join(s.run_dir, name)
    os.makedirs(out)
    cluster = LocalCluster(os.path.join(s.run_dir, name + "-cluster"), nodes=3, base_port=s.base_port + 700 + 10 * s.runs)
    prefix = f"goodput-{name}"
    argv = raftps_argv(name, prefix, 2 * s.budget, s.eval_every, s.sync_every, s.outer, out)
    run = Run(name, out)
    bytes_seen: dict[str, float] = {}
    job = None
    try:
        cluster.start(timeout=60)
        run.launch_unix = time.time()
        job = Supervised(argv, WORKERS, {**_env(), **cluster.client_env}, out)

        def kill_leader() -> str:
            bytes_seen.update(client_bytes_in(cluster))   # the node about to die: its count so far
            leader = cluster.leader()
            cluster.kill(leader)
            return f"node {leader}"

        faults = [(WORKER_KILL_AT, "worker (rank 3)", lambda: f"pid {job.kill_worker()}"),
                  (LEADER_KILL_AT, "store leader", kill_leader)]
        completed = drive(run, job, s.budget, s.target, s.timeout, faults)
        bytes_seen.update(client_bytes_in(cluster))
        job.stop()
        if name == "raftps-diloco":
            check = read_store_check(cluster, prefix, os.path.join(out, ACKED_ROUNDS))
            log(f"goodput {name}: {check['verdict']}")
    finally:
        if job is not None:
            job.stop()
        cluster.stop()
        cluster.wipe()
    rows = batch_rows(read_rows(os.path.join(out, "metrics.csv")), completed)
    kill = next((step for what, step in run.fault_steps.items() if what.startswith("worker")), None)
    extra = {"bytes_per_token": sum(bytes_seen.values()) / max(1, len(rows) * TOKENS_PER_BATCH),
             "bytes_how": "measured: client bytes into the 3 nodes / tokens computed",
             "short_steps": short_steps(kill, job.back.get(WORKERS - 1) if job else None),
             "launcher": "one supervised process per rank (a dead one restarts alone)"}
    if name != "raftps-sync":
        extra.update(sync_every=s.sync_every, outer=s.outer)
    if name == "raftps-diloco":
        extra["store_check"] = check
    return _finish(s, run, rows, completed, extra)


def read_store_check(cluster: Any, prefix: str, acked_path: str) -> dict[str, Any]:
    """After a synchronous DiLoCo run: the store's applied rounds and every global tensor's
    version, against the rounds the workers were acknowledged (store_check)."""
    from raftps import jobs
    with cluster.client(timeout=30) as c:
        applied = c.sync_applied(jobs.diloco_job(prefix, 0, 1))
        versions = c.export(prefix + "/")["tensor_versions"]
    acked = open(acked_path).read().split("\n") if os.path.exists(acked_path) else []
    return store_check(applied, versions, [tuple(map(int, line.split())) for line in acked if line.strip()])


def _finish(s: Setup, run: Run, rows: list[dict], completed: bool, extra: dict[str, Any]) -> dict[str, Any]:
    s.runs += 1
    if not rows:
        return {"config": run.name, "label": LABELS[run.name], "error": "no metrics (see the run's logs)",
                "events": [(u - run.launch_unix, t) for u, t in run.events]}
    target = s.target if s.target is not None else target_from(rows, s.budget)
    r = summarize(run.name, rows, completed, run.launch_unix, s.budget, target, run.events, extra)
    r["curve"] = [(x["unix"] - run.launch_unix, x["val"]) for x in batch_rows(rows, completed) if x["val"] is not None]
    log(f"goodput {run.name}: target {target:.4f} " + (f"at {r['wall_to_target_s']:.1f} s, {r['tokens_to_target']:,} "
        f"tokens" if r["wall_to_target_s"] is not None else "not reached") + f"; val loss at the budget "
        f"{r['val_at_budget']}, final {r['final_val']}; recomputed {r['recomputed_steps']}, short "
        f"{r['short_steps']}; {r['steps_before_fault_per_s']} steps/s before any fault")
    return r



# ---- the part -------------------------------------------------------------------------------

def measure(run_dir: str, base_port: int, mode: str, out: str, configs: list[str] | None = None,
            command: str = "python -m bench.goodput", sync_every: int | None = None,
            outer: str = "average", budget: int | None = None) -> list[dict[str, Any]]:
    cfg = {**MODES[mode], **({"sync_every": sync_every} if sync_every else {})}
    if budget:          # a longer or shorter run of the mode: its per-run limit scales with it
        cfg.update(budget=budget, timeout=cfg["timeout"] * budget / cfg["budget"])
    uptime0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t0 = time.monotonic()
    s = Setup(mode, run_dir, base_port, cfg["budget"], cfg["eval_every"], cfg["sync_every"], cfg["timeout"],
              param_bytes(), outer)
    chosen = configs or CONFIGS
    results: list[dict[str, Any]] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # SIGTERM: clean up as on an error
    try:
        for name in ["ddp"] + [c for c in chosen if c != "ddp"]:     # (a) first: it sets the target
            skip = (torchft_available() if name.startswith("torchft") else
                    raftps_diloco_available() if name.startswith("raftps-diloco") else None)
            if skip:
                log(f"goodput {name}: skipped: {skip}")
                results.append({"config": name, "label": LABELS[name], "skipped": skip})
                continue
            if name == "ddp-ckpt":
                save_s = checkpoint_seconds()
                step_s = 1 / results[0]["steps_before_fault_per_s"]
                s.checkpoint_every = max(1, round(save_s / (CHECKPOINT_COST * step_s)))
                s.checkpoint_timing = (save_s * 1e3, step_s * 1e3)
                log(f"goodput ddp-ckpt: torch.save {save_s * 1e3:.0f} ms, (a)'s step {step_s * 1e3:.0f} ms: "
                    f"a checkpoint every {s.checkpoint_every} batches")
            log(f"== goodput {name} (elapsed {time.monotonic() - t0:.0f} s)")
            runner = run_ddp if name.startswith("ddp") else run_torchft if name.startswith("torchft") else run_raftps
            try:
                r = runner(s, name)
            except Exception as e:                 # noqa: BLE001 - reported in the table; the others still run
                log(f"goodput {name} failed: {type(e).__name__}: {e}")
                r = {"config": name, "label": LABELS[name], "error": f"{type(e).__name__}: {e}"}
            results.append(r)
            if name == "ddp":
                if "error" in r:
                    raise RuntimeError(f"(a) DDP failed, so there is no target: {r['error']}")
                s.target = r["target"]
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        import torchft
        torchft_version = getattr(torchft, "__version__", None) or _dist_version("torchft")
    except ImportError:
        torchft_version = "missing"
    meta = {"mode": mode, "suffix": "" if not budget else f"_{budget}", "budget": s.budget, "eval_every": s.eval_every, "sync_every": s.sync_every, "outer": outer,
            "command": command + " " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{os.cpu_count()} cores",
            "seconds": round(time.monotonic() - t0, 1), "uptime_start": uptime0,
            "uptime_end": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip(),
            "torch": __import__("torch").__version__, "torchft": torchft_version, "param_bytes": s.param_bytes,
            "lr": char_gpt_lr()}
    md = write_report(results, meta, out)
    print(md)
    return results


def _dist_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


def bench_part(run_dir: str, base_port: int, mode: str, out: str) -> list[dict]:
    """``python -m bench --parts goodput``: writes its own files; no rows for results.md."""
    measure(run_dir, base_port, mode, out, command="python -m bench")
    return []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--fleet" in argv:            # on shaped network namespaces: bench/goodput_fleet.py
        from .goodput_fleet_report import main as fleet_main
        return fleet_main(argv)
    ap = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help=f"{MODES['quick']['budget']} global batches (default)")
    g.add_argument("--full", action="store_true", help=f"{MODES['full']['budget']} global batches")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--base-port", type=int, default=23000)
    ap.add_argument("--configs", help=f"comma list of {CONFIGS} ((a) ddp always runs: it sets the target)")
    ap.add_argument("--budget", type=int, help="global batches, instead of the mode's (its reports are named "
                    "goodput[_quick]_BUDGET.*)")
    ap.add_argument("--sync-every", type=int, help="DiLoCo's H (default: the mode's, "
                    + ", ".join(f"{m} {c['sync_every']}" for m, c in MODES.items()) + ")")
    ap.add_argument("--outer", choices=("average", "nesterov"), default="average",
                    help="the synchronous DiLoCo outer step, torchft's and raftps's alike: plain averaging "
                         "(SGD lr 1.0) or the paper's Nesterov momentum (lr 0.7, momentum 0.9); asynchronous "
                         "DiLoCo always averages")
    a = ap.parse_args(argv)
    if a.sync_every is not None and a.sync_every < 1:
        ap.error(f"--sync-every must be >= 1, got {a.sync_every}")
    if a.budget is not None and a.budget < 10:
        ap.error(f"--budget must be >= 10 global batches, got {a.budget}")
    configs = [c.strip() for c in a.configs.split(",")] if a.configs else None
    unknown = set(configs or []) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    with tempfile.TemporaryDirectory(prefix="raftps-goodput-") as run_dir:
        results = measure(run_dir, a.base_port, "full" if a.full else "quick", a.out, configs,
                          sync_every=a.sync_every, outer=a.outer, budget=a.budget)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
