"""Goodput under faults: ``python -m bench --parts goodput`` (or ``python -m bench.goodput
[--quick|--full]``): time and tokens to a target validation loss when workers and the store's
leader are SIGKILLed, for DDP, DDP with checkpoint-restart, torchft and raftps.

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
  (e) raftps-diloco, (f) raftps-diloco-async   raftps.torch wrapping AdamW with an outer
                    Nesterov step in the store (skipped, with the reason, while raftps.torch does
                    not take that form).
raftps workers run one supervised process each (the supervisor restarts a dead one alone).

A configuration runs until it has passed the budget and reached the target, or twice the budget.
Reported per configuration: wall time (from the launch) and tokens (global batches computed,
recomputed ones included) to the target, validation loss at the budget and at the end, steps
recomputed (rank 0 computing a batch it had computed before) and steps taken short of the killed
worker's part, bytes sent to the store per token (the nodes' client-frame byte counters) or
all-reduced per token (computed: every rank's gradient, or pseudo-gradient every H steps), and the
step rate before the first fault. Writes goodput.{md,json,png} (--quick: goodput_quick.*).

Ports from --base-port B: raftps clusters at B+700+10i (+1..3, +101..103, +201..203, +301..303
/metrics), torchrun rendezvous B+690..B+698 (torchft replica groups B+680..B+683), the torchft lighthouse B+699.
"""
from __future__ import annotations

import argparse
import csv
import json
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAR_GPT = os.path.join(ROOT, "examples", "char_gpt.py")
WORKER = os.path.join(ROOT, "bench", "goodput_worker.py")
WORKERS = 4
BATCH, BLOCK = 32, 64                       # char_gpt.py's global batch and window
TOKENS_PER_BATCH = BATCH * BLOCK
WORKER_KILL_AT, LEADER_KILL_AT, TARGET_AT = 0.3, 0.6, 0.8
CHECKPOINT_COST = 0.05                      # (b)'s checkpoint interval: saving costs about this share
MODES = {   # budget (global batches), evaluation interval, DiLoCo's H, per-run limit (s)
    # evaluations at round ends (eval_every a multiple of H) and at 80% of the budget (the target)
    "quick": dict(budget=50, eval_every=5, sync_every=5, timeout=240),
    "full": dict(budget=300, eval_every=20, sync_every=20, timeout=1800),
}
CONFIGS = ["ddp", "ddp-ckpt", "torchft-ddp", "torchft-diloco", "raftps-sync", "raftps-diloco", "raftps-diloco-async"]
LABELS = {"ddp": "(a) DDP, no faults", "ddp-ckpt": "(b) DDP + checkpoint-restart",
          "torchft-ddp": "(c) torchft DDP", "torchft-diloco": "(c) torchft DiLoCo",
          "raftps-sync": "(d) raftps sync", "raftps-diloco": "(e) raftps DiLoCo",
          "raftps-diloco-async": "(f) raftps async DiLoCo"}


# ---- reading a run: pure functions of metrics.csv rows (tests/test_bench_goodput.py) ----------

def read_rows(path: str) -> list[dict[str, float | None]]:
    """metrics.csv (examples/common.py's Metrics) as dicts: time, step, loss, val (None if not evaluated), unix."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [{"time": float(r["time"]), "step": int(r["step"]), "loss": float(r["loss"]),
                 "val": float(r["val_loss"]) if r["val_loss"] != "" else None, "unix": float(r["unix"])}
                for r in csv.DictReader(f) if r.get("unix")]


def batch_rows(rows: list[dict], completed: bool) -> list[dict]:
    """The rows that are computed batches: a completed run's last row repeats its last step for
    the final evaluation and is no batch."""
    if completed and len(rows) >= 2 and rows[-1]["step"] == rows[-2]["step"]:
        return rows[:-1]
    return rows


def recomputed(rows: list[dict]) -> int:
    """Batches rank 0 computed again: rows whose step it had already passed (a resume from a checkpoint)."""
    done, again = 0, 0
    for r in rows:
        again += r["step"] <= done
        done = max(done, r["step"])
    return again


def target_from(rows: list[dict], budget: int, at: float = TARGET_AT) -> float:
    """The ceiling's validation loss at ``at`` of the budget: its first evaluation at or past that step."""
    step = at * budget
    for r in rows:
        if r["val"] is not None and r["step"] >= step:
            return r["val"]
    raise ValueError(f"no evaluation at or after step {step:g} (of {budget})")


def reached(rows: list[dict], target: float) -> dict | None:
    """The first evaluated row at or below the target, with the batches computed up to it."""
    for i, r in enumerate(rows):
        if r["val"] is not None and r["val"] <= target:
            return {**r, "batches": i + 1}
    return None


def val_at(rows: list[dict], step: int) -> float | None:
    """The first evaluation at or past ``step`` (the budget), else None."""
    return next((r["val"] for r in rows if r["val"] is not None and r["step"] >= step), None)


def step_rate(rows: list[dict], until_unix: float | None) -> float | None:
    """Global batches per second over the rows before ``until_unix`` (the first fault; None: all),
    leaving out the first 10% of them (start-up)."""
    rows = [r for r in rows if until_unix is None or r["unix"] < until_unix]
    if len(rows) < 5:
        return None
    a, b = rows[len(rows) // 10], rows[-1]
    return (b["step"] - a["step"]) / (b["unix"] - a["unix"]) if b["unix"] > a["unix"] else None


def short_steps(kill_step: int | None, resume_step: int | None) -> int | None:
    """Batches the others took without the killed rank's part: from rank 0's step at the kill to the
    batch the restarted rank resumed at (an upper bound by one: the batch in flight at the kill may
    have had its part). None if it never came back."""
    if kill_step is None:
        return 0
    if resume_step is None:
        return None
    return max(0, resume_step - kill_step)


def summarize(name: str, rows: list[dict], completed: bool, launch_unix: float, budget: int, target: float,
              events: list[tuple[float, str]], extra: dict[str, Any]) -> dict[str, Any]:
    """One configuration's report row from its metrics rows and fault events (unix, text)."""
    rows = batch_rows(rows, completed)
    hit = reached(rows, target)
    first_fault = min((u for u, text in events if text.startswith("SIGKILL")), default=None)
    evals = [r for r in rows if r["val"] is not None]
    out = {"config": name, "label": LABELS.get(name, name), "target": target, "budget": budget,
           "batches": len(rows), "last_step": rows[-1]["step"] if rows else 0,
           "wall_to_target_s": hit["unix"] - launch_unix if hit else None,
           "tokens_to_target": hit["batches"] * TOKENS_PER_BATCH if hit else None,
           "step_at_target": hit["step"] if hit else None,
           "val_at_budget": val_at(rows, budget), "final_val": evals[-1]["val"] if evals else None,
           "recomputed_steps": recomputed(rows), "steps_before_fault_per_s": step_rate(rows, first_fault),
           "first_step_s": rows[0]["unix"] - rows[0]["time"] - launch_unix if rows else None,
           "events": [(u - launch_unix, text) for u, text in events]}
    out.update(extra)
    return out


# ---- launching and supervising -------------------------------------------------------------

class Torchrun:
    """``torchrun --nproc-per-node N --max-restarts R`` in its own session (its workers are its children)."""

    def __init__(self, script: str, args: list[str], nproc: int, port: int, env: dict[str, str], log_path: str,
                 max_restarts: int = 3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--max-restarts", str(max_restarts), "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--node-rank", "0", script, *args]
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def workers(self) -> list[int]:
        return sorted(_children(self.proc.pid))

    def kill_worker(self) -> int | None:
        """SIGKILL the newest worker (the highest PID: local rank nproc-1 in practice)."""
        pids = self.workers()
        if not pids:
            return None
        os.kill(pids[-1], signal.SIGKILL)
        return pids[-1]

    def done(self) -> bool:
        return self.proc.poll() is not None

    def ok(self) -> bool:
        return self.proc.poll() == 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)      # the session we started: torchrun and its workers
        self.proc.wait(10)
        self.log.close()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class Supervised:
    """One process per raftps worker (RANK, WORLD_SIZE set); a worker that dies by a signal is
    started again alone (at most ``restarts`` times), the others keep training."""

    def __init__(self, argv: list[str], ranks: int, env: dict[str, str], log_dir: str, restarts: int = 3):
        self.argv, self.ranks, self.env, self.log_dir, self.restarts = argv, ranks, env, log_dir, restarts
        self.procs: dict[int, subprocess.Popen] = {}
        self.started: list[tuple[float, int]] = []       # (unix, rank) of every restart
        self.back: dict[int, int] = {}                   # rank -> the batch its restart resumed at
        for r in range(ranks):
            self._start(r)

    def _start(self, r: int) -> None:
        log_file = open(os.path.join(self.log_dir, f"rank{r}.log"), "ab")
        self.procs[r] = subprocess.Popen(self.argv, env={**self.env, "RANK": str(r), "WORLD_SIZE": str(self.ranks)},
                                         stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        log_file.close()

    def poll(self) -> None:
        for r, p in self.procs.items():
            if p.poll() is not None and p.returncode < 0 and self.restarts > 0:
                self.restarts -= 1
                self.started.append((time.time(), r))
                self._start(r)
        for unix, r in self.started:      # the restarted rank's resume line: its first batch follows
            if r not in self.back:
                resumed = _resume_step(os.path.join(self.log_dir, f"rank{r}.log"), r)
                if resumed is not None:
                    self.back[r] = resumed

    def kill_worker(self, rank: int | None = None) -> int:
        p = self.procs[self.ranks - 1 if rank is None else rank]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        return p.pid

    def done(self) -> bool:
        self.poll()
        return all(p.poll() is not None for p in self.procs.values())

    def ok(self) -> bool:
        return all(p.poll() == 0 for p in self.procs.values())

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(10)


def _resume_step(path: str, rank: int) -> int | None:
    """The batch a restarted rank resumed at, from the line examples/common.py and
    bench/goodput_worker.py print before a resumed rank's first batch (``[rank r] ... global batches S..``)."""
    try:
        with open(path, errors="replace") as f:
            for line in f:
                m = re.match(rf"\[rank {rank}\] .*global batch(?:es)? (\d+)", line)
                if m:
                    return int(m.group(1))
    except OSError:
        pass
    return None


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


def _char_gpt() -> Any:
    """examples/char_gpt.py as a module (it imports torch)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import char_gpt
    finally:
        sys.path.pop(0)
    return char_gpt


def param_bytes() -> int:
    model = _char_gpt().build(0, BATCH)[0]
    return sum(p.numel() * p.element_size() for p in model.parameters())


def char_gpt_lr() -> float:
    return _char_gpt().DEFAULTS["lr"]


def checkpoint_seconds(repeat: int = 5) -> float:
    """Median seconds of one torch.save of the char GPT's model and Adam state (what (b) writes)."""
    import statistics
    import torch
    model, batch_indices, loss_on, _ = _char_gpt().build(0, BATCH)
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


def torchft_available() -> str | None:
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        return f"torchft is not installed ({e}): bash bench/setup.sh --torchft"
    if shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) is None:
        return "torchft_lighthouse is not next to this Python"
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
                    "--sync-every", str(s.sync_every), "--out", out]
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
        extra["sync_every"] = s.sync_every
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
    from raftps.localcluster import LocalCluster
    out = os.path.join(s.run_dir, name)
    os.makedirs(out)
    cluster = LocalCluster(os.path.join(s.run_dir, name + "-cluster"), nodes=3, base_port=s.base_port + 700 + 10 * s.runs)
    prefix = f"goodput-{name}"
    if name == "raftps-sync":
        argv = [sys.executable, CHAR_GPT, "--backend", "raftps", "--mode", "sync", "--prefix", prefix,
                *_char_gpt_args(s, 2 * s.budget, out)]
    else:
        argv = [sys.executable, WORKER, "--kind", name, "--steps", str(2 * s.budget), "--eval-every",
                str(s.eval_every), "--sync-every", str(s.sync_every), "--prefix", prefix, "--out", out]
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
        extra["sync_every"] = s.sync_every
    return _finish(s, run, rows, completed, extra)


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


# ---- report ---------------------------------------------------------------------------------

def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 30's goodput targets: raftps DiLoCo's wall time to the target against (b) and (c)."""
    by = {r["config"]: r for r in results if "error" not in r and "skipped" not in r}
    out = []
    for ours in ("raftps-diloco", "raftps-diloco-async", "raftps-sync"):
        for theirs, limit in (("ddp-ckpt", 0.7), ("torchft-ddp", 1.0), ("torchft-diloco", 1.0)):
            a, b = by.get(ours), by.get(theirs)
            if a is None or b is None:
                continue
            ta, tb = a["wall_to_target_s"], b["wall_to_target_s"]
            ratio = ta / tb if ta is not None and tb is not None else None
            out.append({"what": f"{LABELS[ours]} / {LABELS[theirs]}, wall time to target", "ratio": ratio,
                        "limit": limit if ours == "raftps-diloco" else None,
                        "met": None if ours != "raftps-diloco" else (ratio is not None and ratio <= limit)})
    return out


def write_report(results: list[dict[str, Any]], meta: dict[str, Any], out: str) -> str:
    """goodput.{md,json,png} (quick: goodput_quick.*)."""
    sfx = "" if meta["mode"] == "full" else "_quick"
    os.makedirs(out, exist_ok=True)
    png = plot(results, os.path.join(out, f"goodput{sfx}.png"), meta)
    target = next((r["target"] for r in results if "target" in r), None)
    lines = [f"# Goodput under faults: char GPT x{WORKERS}, {meta['budget']} global batches "
             f"({meta['budget'] * TOKENS_PER_BATCH:,} tokens)", "",
             f"`{meta['command']}`, {meta['date']}, commit {meta['commit']}, {meta['machine']}, torch {meta['torch']}, "
             f"torchft {meta['torchft']}. `uptime` at the start: `{meta['uptime_start']}`; at the end: "
             f"`{meta['uptime_end']}`. **Taken on a loaded, shared 2-core machine**: every worker of every "
             "configuration shares those cores with other people's work, so times are noisy; compare within this run.",
             "",
             f"Faults: a worker SIGKILLed at {WORKER_KILL_AT:.0%} of the budget (its launcher starts it again), the "
             f"store's leader SIGKILLed at {LEADER_KILL_AT:.0%} (raftps only). Target: (a)'s validation loss at "
             f"{TARGET_AT:.0%} of the budget = **{_f(target, '.4f')}**. Wall time counts from the launch (process "
             "start, imports, rendezvous included); tokens count every batch computed, recomputed ones too. "
             f"A run stops past the budget once it has reached the target, at the latest at {2 * meta['budget']} batches.",
             "",
             "| configuration | wall s to target | tokens to target | val loss at budget | final val loss "
             "(at batch) | recomputed steps | steps short of the killed worker | bytes/token | steps/s before faults "
             "| launcher |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['label']} | {'skipped' if 'skipped' in r else 'failed'}: {r.get('skipped') or r['error']} "
                         "| | | | | | | | |")
            continue
        tokens = f"{r['tokens_to_target']:,}" if r["tokens_to_target"] is not None else "not reached"
        lines.append(f"| {r['label']} | {_f(r['wall_to_target_s'], '.1f') if r['wall_to_target_s'] else 'not reached'} "
                     f"| {tokens} | {_f(r['val_at_budget'], '.4f')} | {_f(r['final_val'], '.4f')} ({r['last_step']}) | "
                     f"{r['recomputed_steps']} | {_f(r['short_steps'], 'd')} | {_f(r['bytes_per_token'], ',.0f')} "
                     f"({r['bytes_how']}) | {_f(r['steps_before_fault_per_s'])} | {r['launcher']} |")
    lines += ["", "Ratios (issue 30's targets apply to raftps DiLoCo: <= 0.7x of (b), <= 1.0x of (c)):", "",
              "| ratio | value | target |", "|---|---|---|"]
    for t in ratios(results):
        verdict = "" if t["met"] is None else ("met" if t["met"] else "NOT met")
        lines.append(f"| {t['what']} | {_f(t['ratio'])} | {verdict} |")
    lines += ["", "How each ran:", ""] + [f"- {r['label']}: {note(r, meta)}" for r in results
                                           if "skipped" not in r and "error" not in r]
    lines += ["", f"![validation loss against wall time]({os.path.basename(png)})", ""]
    md = "\n".join(lines)
    with open(os.path.join(out, f"goodput{sfx}.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, f"goodput{sfx}.json"), "w") as f:
        json.dump({"meta": meta, "results": results, "ratios": ratios(results)}, f, indent=1, default=str)
    return md


def note(r: dict[str, Any], meta: dict[str, Any]) -> str:
    """What a configuration's figures mean, in one line."""
    diloco = (f"H = {r.get('sync_every')}, inner AdamW (lr {meta.get('lr')}, weight decay 0.1, betas 0.9/0.95), "
              "outer Nesterov momentum SGD (lr 0.7, momentum 0.9)")
    return {
        "ddp": f"torchrun, gloo all-reduce, torch.optim.Adam (lr {meta.get('lr')}); the target is its validation loss at "
               f"{TARGET_AT:.0%} of the budget.",
        "ddp-ckpt": f"rank 0 torch.saves model, Adam state and step every {r.get('checkpoint_every')} batches "
                    f"(one save took {_f(r.get('checkpoint_save_ms'), '.0f')} ms against (a)'s "
                    f"{_f(r.get('step_ms_of_a'), '.0f')} ms step: about {CHECKPOINT_COST:.0%}); torchrun restarts "
                    "all 4 ranks, which load the checkpoint; the process group is built on a store prefix per "
                    "restart (examples/common.py, init_gloo), without which the restarted group fails in "
                    "init_process_group (Gloo connectFullMesh failed ... Connection refused).",
        "torchft-ddp": "torchft.ddp.PureDistributedDataParallel + torchft.Optimizer over Adam (its "
                       "DistributedDataParallel raised AssertionError at ddp.py:76 in the surviving replica "
                       "groups once a peer was SIGKILLed); short steps: steps committed with fewer than 4 "
                       "participants (rank 0's manager.num_participants()).",
        "torchft-diloco": f"torchft.local_sgd.DiLoCo, {diloco}; synchronous quorum (its train_diloco.py); "
                          "short steps: rounds committed with fewer than 4 participants.",
        "raftps-sync": f"raftps.torch sync, Adam in the store (lr {meta.get('lr')}, as DDP's), step_timeout 10 s: a step waits that "
                       "long for a dead rank; short steps: an upper bound by one (from rank 0's step at the kill "
                       "to the restarted rank's first batch).",
        "raftps-diloco": f"raftps.torch mode='diloco', {diloco} in the store.",
        "raftps-diloco-async": f"raftps.torch mode='diloco-async', {diloco} in the store, staleness-aware.",
    }.get(r["config"], "")


def plot(results: list[dict[str, Any]], png: str, meta: dict[str, Any]) -> str:
    """Validation loss against wall time since launch, faults as dotted lines in the run's colour."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 5.5))
    target = next((r["target"] for r in results if "target" in r), None)
    for i, r in enumerate(x for x in results if x.get("curve")):
        colour = f"C{i}"
        ax.plot([t for t, _ in r["curve"]], [v for _, v in r["curve"]], marker=".", color=colour, label=r["label"])
        for t, text in r.get("events", []):
            if text.startswith("SIGKILL"):
                ax.axvline(t, color=colour, linestyle=":" if "worker" in text else "--", linewidth=1)
    if target is not None:
        ax.axhline(target, color="black", linewidth=0.8, label=f"target {target:.3f}")
    ax.plot([], [], color="grey", linestyle=":", label="worker SIGKILL")
    ax.plot([], [], color="grey", linestyle="--", label="store leader SIGKILL")
    ax.set(xlabel="seconds since launch", ylabel="validation loss",
           title=f"char GPT x{WORKERS}, {meta['budget']} global batches, faults at "
                 f"{WORKER_KILL_AT:.0%} / {LEADER_KILL_AT:.0%} ({meta['mode']}; loaded machine)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


# ---- the part -------------------------------------------------------------------------------

def measure(run_dir: str, base_port: int, mode: str, out: str, configs: list[str] | None = None,
            command: str = "python -m bench.goodput") -> list[dict[str, Any]]:
    cfg = MODES[mode]
    uptime0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t0 = time.monotonic()
    s = Setup(mode, run_dir, base_port, cfg["budget"], cfg["eval_every"], cfg["sync_every"], cfg["timeout"],
              param_bytes())
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
    meta = {"mode": mode, "budget": s.budget, "eval_every": s.eval_every, "sync_every": s.sync_every,
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
    ap = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help=f"{MODES['quick']['budget']} global batches (default)")
    g.add_argument("--full", action="store_true", help=f"{MODES['full']['budget']} global batches")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--base-port", type=int, default=23000)
    ap.add_argument("--configs", help=f"comma list of {CONFIGS} ((a) ddp always runs: it sets the target)")
    a = ap.parse_args(argv)
    configs = [c.strip() for c in a.configs.split(",")] if a.configs else None
    unknown = set(configs or []) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    with tempfile.TemporaryDirectory(prefix="raftps-goodput-") as run_dir:
        results = measure(run_dir, a.base_port, "full" if a.full else "quick", a.out, configs)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
