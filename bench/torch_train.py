"""PyTorch training through raftps.torch against DDP: ``python -m bench --parts torch`` (or
``python -m bench.torch_train [--quick|--full]``).

For each example (examples/cnn_digits.py, examples/char_gpt.py) it runs, one after the other on
this machine: one process (``--backend local``), DDP x4 (torchrun, gloo all-reduce), and x4 under
torchrun with ``--backend raftps`` in sync, async and Downpour (async, --n-fetch 4 --n-push 4)
mode against a real 3-node LocalCluster it starts. From each run's summary.json: steady steps/s
(global batches per second between 10% and 90% of rank 0's steps) and time to the target
(test accuracy / validation loss, seconds since the first training step, and since the launch).
Then the adapter's overhead: one process, the same model's gradients, N ``opt.step()`` of an
async world-1 DistributedOptimizer against N raw ``Client.push`` + ``Client.pull`` of the same
named_parameters as numpy arrays, alternated in rounds, medians compared.

Targets (printed met / not met): raftps sync x4 steady rate >= 0.5x DDP x4's; raftps async x4
reaches the target within 1.5x DDP x4's time; the adapter adds <= 10% over raw push + pull.
Writes torch_train.md, torch_train.json and torch_<example>.png into --out (--full: torch_train_full.md, ...).

Ports from --base-port B: the cluster at B+460 (+461..463, +561..563, +661..663), torchrun
rendezvous at B+470 + run number (< 30). gloo also opens ephemeral ports.
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
import threading
import time
from typing import Any

import numpy as np

from .common import log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
WORKERS = 4
# per example and mode: the flags every setting of it gets, and how long a run may take
CONFIG = {
    "quick": {"cnn_digits": dict(flags=["--steps", "300", "--target", "0.95"], timeout=240),
              "char_gpt": dict(flags=["--steps", "50", "--target", "2.6"], timeout=420)},
    "full": {"cnn_digits": dict(flags=["--steps", "500", "--target", "0.97"], timeout=600),
             "char_gpt": dict(flags=["--steps", "300", "--target", "2.0"], timeout=1800)},
}
SETTINGS = [  # label, processes, flags
    ("local x1", 1, ["--backend", "local", "--threads", "1"]),     # one core: robust on a shared machine
    ("ddp x4", WORKERS, ["--backend", "ddp"]),
    ("raftps sync x4", WORKERS, ["--backend", "raftps", "--mode", "sync"]),
    ("raftps async x4", WORKERS, ["--backend", "raftps", "--mode", "async"]),
    ("raftps downpour x4", WORKERS, ["--backend", "raftps", "--mode", "async", "--n-fetch", "4", "--n-push", "4"]),
]
OVERHEAD_ROUNDS = 5


def _env(cluster_env: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **cluster_env, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return env


def run_example(example: str, label: str, procs: int, flags: list[str], out: str, port: int, env: dict[str, str],
                timeout: float) -> dict[str, Any]:
    """One run (plain python for one process, torchrun otherwise); its summary.json plus the
    launch-relative times. The children's rank-0 lines are echoed as progress."""
    script = os.path.join(EXAMPLES, f"{example}.py")
    if procs == 1:
        argv = [sys.executable, script]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
                "--master-addr", "127.0.0.1", "--master-port", str(port), script]
    argv += flags + ["--out", out]
    log(f"torch {example} {label}: {' '.join(argv[1:])}")
    t_launch, load = time.time(), os.getloadavg()[0]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    tail: list[str] = []

    def echo() -> None:
        for line in p.stdout:
            tail.append(line.rstrip())
            del tail[:-30]
            if line.startswith("[rank 0]") or "Error" in line:
                print(f"    {example} {label}: {line.rstrip()}", file=sys.stderr, flush=True)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        if p.poll() is None:                         # timed out or interrupted: the session we started
            os.killpg(p.pid, signal.SIGKILL)         # (torchrun and its ranks), by its id
            p.wait()
    reader.join(5)
    wall = time.time() - t_launch
    summary_file = os.path.join(out, "summary.json")
    if rc != 0 or not os.path.exists(summary_file):
        return {"example": example, "label": label, "error": f"exit {rc}", "wall_s": wall, "tail": tail[-15:],
                "loadavg_1m_at_launch": load}
    with open(summary_file) as f:
        s = json.load(f)
    s["run_label"], s["label"] = s["label"], label       # the setting's name (e.g. "raftps downpour x4")
    s["wall_s"], s["loadavg_1m_at_launch"] = wall, load
    s["launch_to_first_step_s"] = s["first_step_unix"] - t_launch
    s["launch_to_target_s"] = (s["launch_to_first_step_s"] + s["time_to_target_s"]
                               if s["time_to_target_s"] is not None else None)
    s["out"] = out
    log(f"torch {example} {label}: {s['label']} steady {s['steady_steps_per_s']:.2f} steps/s, target "
        f"{s['target']} at {s['time_to_target_s'] if s['time_to_target_s'] is None else round(s['time_to_target_s'], 2)} s, "
        f"final {s[[k for k in s if k.startswith('final_')][0]]:.4f}, wall {wall:.1f} s")
    return s


def _delete_prefix(client: Any, prefix: str) -> None:
    names = [t["name"] for t in client.tensors() if t["name"].startswith(prefix + "/")]
    if names:
        client.delete(names)


def adapter_overhead(example: str, cluster: Any, steps: int) -> dict[str, Any]:
    """Median seconds per opt.step() (async, world 1, n_push = n_fetch = 1) against raw
    Client.push + Client.pull of the same named_parameters, and against raw with what the
    adapter's push adds (base_version, its step counter tensor), interleaved step by step."""
    import torch
    import raftps.torch as rpt
    # One intra-op thread, as the x4 workers run: with torch's 2 threads on this shared 2-core
    # machine the adapter's tensor copies (clone, copy_) took 2.2-2.9x raw push + pull for the
    # GPT (load average 8-11), against 1.03x on one thread minutes later.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _adapter_overhead(example, cluster, steps, torch, rpt)
    finally:
        torch.set_num_threads(threads)


def _adapter_overhead(example: str, cluster: Any, steps: int, torch: Any, rpt: Any) -> dict[str, Any]:
    sys.path.insert(0, EXAMPLES)
    mod = __import__(example)
    sys.path.remove(EXAMPLES)
    torch.manual_seed(0)
    model = mod.CNN() if example == "cnn_digits" else mod.GPT(len(mod.VOCAB), 64, 4, 4, 160)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3       # a fixed gradient; the store's Adam applies it each time
    spec = {"name": "adamw", "lr": 1e-4}
    tag = f"{os.getpid()}-{time.monotonic_ns()}"          # fresh names each time
    raw_prefix, ad_prefix = f"bench-raw-{example}-{tag}", f"bench-adapter-{example}-{tag}"
    wrapped_prefix = f"bench-wrapped-{example}-{tag}"
    raw_t: list[float] = []
    ad_t: list[float] = []
    fields_t: list[float] = []
    wrapped_t: list[float] = []
    # The wrapped form: torch.optim.AdamW (the same store optimizer) with an LR scheduler that
    # changes lr every step, so every push carries its hyperparameters (the wrapper's worst case).
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    with cluster.client() as c:
        names = {n: f"{raw_prefix}/{n}" for n, _ in model.named_parameters()}
        for n, p in model.named_parameters():
            c.create(names[n], p.detach().numpy().copy(), spec)
        counter = f"{raw_prefix}/_raftps/steps.rank0"
        c.create(counter, np.zeros(1, np.float64), {"name": "elastic"})
        opt = rpt.DistributedOptimizer(model, cluster=cluster.addresses, optimizer=spec, mode="async",
                                       prefix=ad_prefix, rank=0, world_size=1)
        wrapped = rpt.DistributedOptimizer(torch.optim.AdamW(twin.parameters(), lr=1e-4), model=twin,
                                           cluster=cluster.addresses, mode="async", prefix=wrapped_prefix,
                                           rank=0, world_size=1)
        schedule = torch.optim.lr_scheduler.LambdaLR(wrapped, lambda k: 1.0 / (1 + k))
        retries = {"raw": 0, "adapter": 0}        # 'behind' replies: a node had not applied the push yet
        for who, client in (("raw", c), ("adapter", opt.client)):
            transport = client._router.transport       # the one every request of the client goes over

            def counted(address: str, message: dict, timeout: float, _call=transport.call, _who=who) -> dict:
                reply = _call(address, message, timeout)
                retries[_who] += bool(reply.get("retry"))
                return reply
            transport.call = counted
        try:
            v = 0
            for _ in range(OVERHEAD_ROUNDS * steps):     # interleaved step by step: load drift hits all three
                t = time.perf_counter()
                v = c.push({names[n]: p.grad.numpy() for n, p in model.named_parameters()})
                c.pull(list(names.values()), min_version=v, linearizable=False)   # the adapter's read
                raw_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                opt.step()
                ad_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                wrapped.step()
                wrapped_t.append(time.perf_counter() - t)
                schedule.step()
                t = time.perf_counter()              # raw, with what the adapter's push carries besides
                grads = {names[n]: p.grad.numpy() for n, p in model.named_parameters()}
                grads[counter] = np.ones(1)
                v = c.push(grads, base_version=v)
                c.pull(list(names.values()), min_version=v, linearizable=False)
                fields_t.append(time.perf_counter() - t)
        finally:
            opt.close()
            wrapped.close()
            _delete_prefix(c, raw_prefix)
            _delete_prefix(c, ad_prefix)
            _delete_prefix(c, wrapped_prefix)
    raw, ad, fields = statistics.median(raw_t), statistics.median(ad_t), statistics.median(fields_t)
    wrapped_s = statistics.median(wrapped_t)
    inside = {k: round(1e3 * v[1] / max(1, v[0]), 2) for k, v in opt.timings.items()}   # the adapter's own split
    mb = sum(p.numel() * 4 for p in model.parameters()) / 1e6
    log(f"torch overhead {example}: {mb:.2f} MB of parameters; raw push+pull {raw * 1e3:.2f} ms, "
        f"opt.step() {ad * 1e3:.2f} ms (median of {len(raw_t)}): {ad / raw:.3f}x; raw with base_version and "
        f"the step counter {fields * 1e3:.2f} ms; inside opt.step() push {inside['push']} ms, pull {inside['pull']} ms; "
        f"'behind' retries: raw client {retries['raw']} (2 pulls per step), adapter {retries['adapter']}; "
        f"wrapped torch.optim.AdamW with a per-step lr {wrapped_s * 1e3:.2f} ms: {wrapped_s / ad:.3f}x the dict-spec opt.step()")
    return {"example": example, "param_mb": mb, "raw_push_pull_ms": raw * 1e3, "opt_step_ms": ad * 1e3,
            "ratio": ad / raw, "samples": len(raw_t), "raw_mean_ms": statistics.mean(raw_t) * 1e3,
            "opt_step_mean_ms": statistics.mean(ad_t) * 1e3, "raw_same_fields_ms": fields * 1e3,
            "ratio_same_fields": ad / fields, "opt_step_push_ms": inside["push"], "opt_step_pull_ms": inside["pull"],
            "behind_retries": retries, "wrapped_step_ms": wrapped_s * 1e3, "wrapped_ratio": wrapped_s / ad}


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "not reached"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def targets(runs: list[dict[str, Any]], overhead: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for example in CONFIG["quick"]:
        by = {r["label"]: r for r in runs if r["example"] == example}
        ddp, sync, asy = by.get("ddp x4", {}), by.get("raftps sync x4", {}), by.get("raftps async x4", {})
        if "error" not in ddp and "error" not in sync and ddp and sync:
            ratio = sync["steady_steps_per_s"] / ddp["steady_steps_per_s"]
            out.append({"example": example, "target": "raftps sync x4 steady steps/s >= 0.5x DDP x4",
                        "value": f"{ratio:.2f}x ({sync['steady_steps_per_s']:.1f} vs {ddp['steady_steps_per_s']:.1f})",
                        "met": ratio >= 0.5})
        if "error" not in ddp and "error" not in asy and ddp and asy:
            a, d = asy.get("time_to_target_s"), ddp.get("time_to_target_s")
            met = a is not None and d is not None and a <= 1.5 * d
            value = (f"{a / d:.2f}x ({a:.1f} s vs {d:.1f} s)" if a is not None and d is not None
                     else f"async {_fmt(a, 1)}, DDP {_fmt(d, 1)} (s)")
            out.append({"example": example, "target": "raftps async x4 time to target <= 1.5x DDP x4", "value": value,
                        "met": met})
    for o in overhead:
        if "error" not in o:
            out.append({"example": o["example"], "target": "opt.step() <= 1.10x raw push + pull",
                        "value": f"{o['ratio']:.3f}x ({o['opt_step_ms']:.1f} vs {o['raw_push_pull_ms']:.1f} ms)",
                        "met": o["ratio"] <= 1.10})
            if "wrapped_ratio" in o:
                out.append({"example": o["example"],
                            "target": "wrapped torch AdamW opt.step() (lr changing every step) <= 1.05x the dict-spec opt.step()",
                            "value": f"{o['wrapped_ratio']:.3f}x ({o['wrapped_step_ms']:.1f} vs {o['opt_step_ms']:.1f} ms)",
                            "met": o["wrapped_ratio"] <= 1.05})
    return out


def write_report(runs: list[dict[str, Any]], overhead: list[dict[str, Any]], meta: dict[str, Any], out: str) -> str:
    """torch_train.md/.json and torch_<example>.png (quick); torch_train_full.* and torch_<example>_full.png (full)."""
    sfx = "_full" if meta.get("mode") == "full" else ""
    sys.path.insert(0, EXAMPLES)
    from plot import plot_runs
    sys.path.remove(EXAMPLES)
    os.makedirs(out, exist_ok=True)
    tg = targets(runs, overhead)
    lines = ["# PyTorch: raftps.torch against DDP and one process", "",
             f"`{meta['command']}`, {meta['date']}, commit {meta['commit']}, {meta['machine']}, torch {meta['torch']}, "
             f"{meta['seconds']:.0f} s, 1-minute load average {meta['loadavg_1m_start_end'][0]} at the start and "
             f"{meta['loadavg_1m_start_end'][1]} at the end (the machine is shared). All runs share the machine's cores (4 ranks on them at once); "
             "raftps runs go to a 3-node LocalCluster on the same machine. Times to target count from rank 0's first "
             "training step (from the launch, incl. process start and imports, in brackets).", "",
             "| example | setting | params | steps | steady steps/s | time to target s (from launch) | "
             "step at target | final metric | wall s | load at launch |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['example']} | {r['label']} | | | failed: {r['error']} | | | | {r['wall_s']:.1f} | "
                         f"{r['loadavg_1m_at_launch']:.1f} |")
            continue
        metric = [k for k in r if k.startswith("final_")][0]
        ttt = (f"{r['time_to_target_s']:.1f} ({r['launch_to_target_s']:.1f})" if r["time_to_target_s"] is not None
               else "not reached")
        lines.append(f"| {r['example']} | {r['label']} | {r['parameters']:,} | {r['steps']} | "
                     f"{r['steady_steps_per_s']:.2f} | {ttt} | {_fmt(r['step_at_target'])} | "
                     f"{metric[6:]} {r[metric]:.4f} (target {r['target']}) | {r['wall_s']:.1f} | "
                     f"{r['loadavg_1m_at_launch']:.1f} |")
    lines += ["", "Adapter overhead (one process, async, world size 1, the model's own parameters, "
              "the three interleaved step by step; medians):", "",
              "| example | parameter MB | raw push + pull ms | opt.step() ms | ratio | raw push (+ base_version, "
              "+ step counter) + pull ms | opt.step() / that |", "|---|---|---|---|---|---|---|"]
    for o in overhead:
        if "error" in o:
            lines.append(f"| {o['example']} | failed: {o['error']} | | | | | |")
        else:
            lines.append(f"| {o['example']} | {o['param_mb']:.2f} | {o['raw_push_pull_ms']:.2f} | "
                         f"{o['opt_step_ms']:.2f} | {o['ratio']:.3f} | {o['raw_same_fields_ms']:.2f} | "
                         f"{o['ratio_same_fields']:.3f} |")
    lines += ["", "| example | target | measured | met |", "|---|---|---|---|"]
    lines += [f"| {t['example']} | {t['target']} | {t['value']} | {'met' if t['met'] else 'NOT met'} |" for t in tg]
    for example in CONFIG["quick"]:
        dirs = [r["out"] for r in runs if r["example"] == example and "error" not in r]
        if dirs:
            png = plot_runs(os.path.join(out, f"torch_{example}{sfx}.png"), dirs, example)
            lines += ["", f"![{example}]({os.path.basename(png)})"]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out, f"torch_train{sfx}.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, f"torch_train{sfx}.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs, "overhead": overhead, "targets": tg}, f, indent=1, default=str)
    return md


def measure(run_dir: str, base_port: int, mode: str, out: str, examples: list[str] | None = None,
            settings: list[str] | None = None, command: str = "python -m bench --parts torch") -> list[dict[str, Any]]:
    from raftps.tools.localcluster import LocalCluster
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    cluster = LocalCluster(os.path.join(run_dir, "cluster"), nodes=3, base_port=base_port + 460)
    runs: list[dict[str, Any]] = []
    overhead: list[dict[str, Any]] = []
    port = base_port + 470
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # SIGTERM: clean up as on an error
    try:
        cluster.start(timeout=60)
        env = _env(cluster.client_env)
        os.environ.update(cluster.client_env)
        for example in examples or list(CONFIG[mode]):
            cfg = CONFIG[mode][example]
            for label, procs, flags in SETTINGS:
                if settings and label not in settings:
                    continue
                prefix = f"bench-{example}-{label.replace(' ', '-')}-{os.getpid()}"
                d = os.path.join(run_dir, example, label.replace(" ", "_"))
                runs.append(run_example(example, label, procs, flags + cfg["flags"] + ["--prefix", prefix], d, port,
                                        env, cfg["timeout"]))
                port += 1
                if "raftps" in label:
                    with cluster.client() as c:
                        _delete_prefix(c, prefix)
            try:
                overhead.append(adapter_overhead(example, cluster, 30 if example == "cnn_digits" else 8))
            except Exception as e:              # noqa: BLE001 - reported in the table
                log(f"torch overhead {example} failed: {type(e).__name__}: {e}")
                overhead.append({"example": example, "error": f"{type(e).__name__}: {e}"})
    finally:
        cluster.wipe()
        signal.signal(signal.SIGTERM, previous)
    meta = {"mode": mode, "command": command + " " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} cores", "seconds": time.monotonic() - t0,
            "loadavg_1m_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip(),
            "torch": __import__("torch").__version__}
    md = write_report(runs, overhead, meta, out)
    print(md)
    for t in targets(runs, overhead):
        log(f"target {t['example']}: {t['target']}: {t['value']}: {'met' if t['met'] else 'NOT met'}")
    return runs


def bench_part(run_dir: str, base_port: int, mode: str, out: str) -> list[dict]:
    """``python -m bench --parts torch``: writes its own files; no rows for results.md."""
    measure(run_dir, base_port, mode, out, command="python -m bench")
    from . import torch_frameworks
    torch_frameworks.measure(base_port, out, 60 if mode == "quick" else 200, command="python -m bench")
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.torch_train", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="short runs: a few minutes (default)")
    g.add_argument("--full", action="store_true", help="the examples' full lengths")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--base-port", type=int, default=22000)
    ap.add_argument("--examples", help="comma list (default cnn_digits,char_gpt)")
    ap.add_argument("--settings", help=f"comma list of {[s[0] for s in SETTINGS]}")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="raftps-torch-bench-") as run_dir:
        measure(run_dir, a.base_port, "full" if a.full else "quick", a.out,
                a.examples.split(",") if a.examples else None,
                [s.strip() for s in a.settings.split(",")] if a.settings else None, "python -m bench.torch_train")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
