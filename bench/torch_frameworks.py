"""Training frameworks on raftps against the same framework's own DDP: ``python -m
bench.torch_frameworks`` (``python -m bench --parts torch`` runs it after bench/torch_train.py).

The char GPT (examples/char_gpt.py's size: 4 blocks of width 160, 4 heads, context 64, on its
stdlib text) trained by 4 torchrun workers, one setting after the other on this machine: the
hand-written loop (examples/char_gpt.py), PyTorch Lightning (examples/lightning_gpt.py) and the
Hugging Face Trainer (examples/hf_trainer.py), each with its DDP (gloo all-reduce, torch's AdamW)
and on raftps in sync mode against a real 3-node LocalCluster. From each run's summary.json: the
steady steps/s (rank 0's steps between 10% and 90% of the run). Reported: raftps / DDP for each,
and each framework's ratio against the hand-written loop's (target >= 0.9: the framework adds
no round trip and no copy). Then ``accelerate.Accelerator.prepare`` on the char GPT with raftps
against plain AdamW (``prepare_time``). Writes torch_frameworks.md and .json into --out.

Ports from --base-port B: the cluster at B+760 (+761..763, ...), torchrun rendezvous at B+770 + run number.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from .common import log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
WORKERS = 4
GPT_SIZE = ["--layers", "4", "--width", "160"]               # examples/char_gpt.py's LAYERS, WIDTH (4 heads)
SCRIPTS = {  # setting: script, flags for DDP, flags for raftps sync (char_gpt's --batch is global, the others' per rank)
    "hand-written loop": ("char_gpt.py", ["--backend", "ddp", "--batch", "32"],
                          ["--backend", "raftps", "--mode", "sync", "--batch", "32"]),
    "Lightning": ("lightning_gpt.py", ["--backend", "ddp", "--batch", "8", *GPT_SIZE],
                  ["--backend", "raftps", "--mode", "sync", "--batch", "8", *GPT_SIZE]),
    "HF Trainer": ("hf_trainer.py", ["--backend", "ddp", "--batch", "8", *GPT_SIZE],
                   ["--backend", "raftps", "--mode", "sync", "--batch", "8", *GPT_SIZE]),
}


def delete_prefix(client: Any, prefix: str) -> None:
    names = [t["name"] for t in client.tensors(prefix + "/")]
    if names:
        client.delete(names)


def run(script: str, flags: list[str], out: str, port: int, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One torchrun job of WORKERS ranks; its summary.json, or {"error": ...}."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORKERS), "--master-addr",
            "127.0.0.1", "--master-port", str(port), os.path.join(EXAMPLES, script), *flags, "--out", out]
    log(f"torch frameworks: {' '.join(argv[3:])}")
    t0, load = time.time(), os.getloadavg()[0]
    with open(os.path.join(os.path.dirname(out), os.path.basename(out) + ".log"), "w") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc: Any = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            if p.poll() is None:                  # the session we started (torchrun and its ranks), by its id
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    summary = os.path.join(out, "summary.json")
    if rc != 0 or not os.path.exists(summary):
        return {"error": f"exit {rc}", "wall_s": time.time() - t0, "loadavg_1m_at_launch": load}
    with open(summary) as f:
        s = json.load(f)
    rate = s.get("steady_steps_per_s", s.get("steps_per_s"))
    return {"steps_per_s": rate, "wall_s": time.time() - t0, "loadavg_1m_at_launch": load}


def framework_rates(run_dir: str, port: int, env: dict[str, str], steps: int, client: Any) -> list[dict[str, Any]]:
    rows = []
    for setting, (script, ddp, raftps) in SCRIPTS.items():
        row: dict[str, Any] = {"setting": setting}
        for backend, flags in (("ddp", ddp), ("raftps", raftps)):
            prefix = f"bench-fw-{script[:-3]}-{os.getpid()}"
            extra = ["--prefix", prefix] if backend == "raftps" else []
            row[backend] = run(script, flags + extra + ["--steps", str(steps)],
                               os.path.join(run_dir, f"{script[:-3]}-{backend}"), port, env, 600)
            port += 1
            if backend == "raftps":
                delete_prefix(client, prefix)
        if "error" not in row["ddp"] and "error" not in row["raftps"]:
            row["ratio"] = row["raftps"]["steps_per_s"] / row["ddp"]["steps_per_s"]
        rows.append(row)
    loop = next((r.get("ratio") for r in rows if r["setting"] == "hand-written loop"), None)
    for r in rows:
        if loop and r.get("ratio") is not None:
            r["of_loop_ratio"] = r["ratio"] / loop
    return rows
def prepare_time(cluster: Any, rounds: int = 5) -> dict[str, Any]:
    """``accelerate.Accelerator.prepare(model, optimizer)`` on examples/char_gpt.py's model, median
    ms over ``rounds``: plain AdamW; raftps sync on a new job and on one whose AdamW state is in
    the store (after a step: prepare's load_state_dict(state_dict()) reads it once, writes
    nothing); and what that load cost when it wrote (load_state_dict of a copy: one write)."""
    import torch
    from accelerate import Accelerator
    import raftps.torch as rpt
    sys.path.insert(0, EXAMPLES)
    gpt = __import__("char_gpt")
    sys.path.remove(EXAMPLES)
    times: dict[str, list[float]] = {"plain": [], "raftps_new": [], "raftps_trained": [], "write_copy": []}
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    for r in range(rounds):
        torch.manual_seed(0)
        model = gpt.GPT(len(gpt.VOCAB), 64, 4, 4, 160)
        t0 = time.perf_counter()
        Accelerator(cpu=True).prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        times["plain"].append(time.perf_counter() - t0)
        with cluster.client() as client:
            opt = rpt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, cluster=client,
                                           mode="sync", prefix=f"bench-prepare-{tag}-{r}")
            t0 = time.perf_counter()
            Accelerator(cpu=True).prepare(model, opt)
            times["raftps_new"].append(time.perf_counter() - t0)
            for p in model.parameters():
                p.grad = torch.randn_like(p) * 1e-3
            opt.step()
            t0 = time.perf_counter()
            Accelerator(cpu=True).prepare(model, opt)
            times["raftps_trained"].append(time.perf_counter() - t0)
            copy_ = copy.deepcopy(opt.state_dict())
            t0 = time.perf_counter()
            opt.load_state_dict(copy_)
            times["write_copy"].append(time.perf_counter() - t0)
            delete_prefix(client, f"bench-prepare-{tag}-{r}")
    return {"param_mb": sum(p.numel() * 4 for p in model.parameters()) / 2**20, "rounds": rounds,
            **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}}


def _rate(x: dict[str, Any]) -> str:
    return x["error"] if "error" in x else f"{x['steps_per_s']:.2f}"


def write_report(rows: list[dict[str, Any]], prepare: dict[str, Any] | None, meta: dict[str, Any], out: str) -> str:
    """torch_frameworks.md and .json."""
    lines = ["# Training frameworks: raftps sync against each framework's own DDP", "",
             f"`{meta['command']}`, {meta['date']}, commit {meta['commit']}, {meta['machine']}, torch {meta['torch']}, "
             f"{meta['seconds']:.0f} s, 1-minute load average {meta['loadavg_1m_start_end'][0]} at the start and "
             f"{meta['loadavg_1m_start_end'][1]} at the end (the machine is shared). {WORKERS} torchrun workers, "
             f"{meta['steps']} steps of a global batch of 32 windows, the char GPT's size; raftps runs go to a 3-node "
             "LocalCluster on the same machine. Steady steps/s: rank 0's steps between 10% and 90% of the run.", "",
             f"| setting | DDP x{WORKERS} steps/s | raftps sync x{WORKERS} steps/s | raftps / DDP | "
             "that / the hand-written loop's (target >= 0.9) |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else ""
        of_loop = f"{r['of_loop_ratio']:.2f}" if "of_loop_ratio" in r and r["setting"] != "hand-written loop" else ""
        lines.append(f"| {r['setting']} | {_rate(r['ddp'])} | {_rate(r['raftps'])} | {ratio} | {of_loop} |")
    if prepare:
        lines += ["", f"`accelerate.Accelerator.prepare(model, optimizer)` on examples/char_gpt.py's model "
                  f"({prepare['param_mb']:.2f} MB of float32 parameters), on CPU, medians of {prepare['rounds']} rounds:",
                  "", "| optimizer | prepare ms |", "|---|---|",
                  f"| torch.optim.AdamW | {prepare['plain_ms']:.1f} |",
                  f"| raftps sync, new job (empty AdamW state) | {prepare['raftps_new_ms']:.1f} |",
                  f"| raftps sync, AdamW state in the store (after a step): one read, no write | "
                  f"{prepare['raftps_trained_ms']:.1f} |",
                  f"| (load_state_dict of a copy of that state: the write prepare no longer makes) | "
                  f"{prepare['write_copy_ms']:.1f} |"]
    md = "\n".join(lines) + "\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "torch_frameworks.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "torch_frameworks.json"), "w") as f:
        json.dump({"meta": meta, "runs": rows, "prepare": prepare}, f, indent=1)
    return md


def measure(base_port: int, out: str, steps: int, rates: bool = True,
            command: str = "python -m bench.torch_frameworks") -> str:
    from raftps.tools.localcluster import LocalCluster
    t0, load = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="raftps-frameworks-bench-") as run_dir:
        cluster = LocalCluster(os.path.join(run_dir, "cluster"), nodes=3, base_port=base_port + 760)
        try:
            cluster.start(timeout=60)
            env = {**os.environ, **cluster.client_env,
                   "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
            with cluster.client() as client:
                rows = framework_rates(run_dir, base_port + 770, env, steps, client) if rates else []
            prepare = prepare_time(cluster)
        finally:
            cluster.wipe()
    meta = {"command": command + " " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} cores", "seconds": time.monotonic() - t0, "steps": steps,
            "loadavg_1m_start_end": [round(load, 2), round(os.getloadavg()[0], 2)],
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip(), "torch": __import__("torch").__version__}
    md = write_report(rows, prepare, meta, out)
    print(md)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.torch_frameworks", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--base-port", type=int, default=22000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prepare-only", action="store_true", help="only Accelerate's prepare time")
    a = ap.parse_args(argv)
    measure(a.base_port, a.out, a.steps, rates=not a.prepare_only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
