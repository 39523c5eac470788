"""``python -m bench.backward_time``: examples/char_gpt.py's forward and backward time for one
rank's share of a goodput fleet batch (32 windows of 64 tokens over 4 ranks: 8 windows), on one
torch thread: what sync's ``overlap=True`` can hide at most per step (it sends chunks while
backward runs). Writes bench/results/NAME.md."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

WARMUP, STEPS = 5, 20


def measure(windows: int) -> dict[str, list[float]]:
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import char_gpt
    torch.set_num_threads(1)
    model, batch_indices, loss_on, _ = char_gpt.build(0, 32)
    times: dict[str, list[float]] = {"forward": [], "backward": []}
    for g in range(WARMUP + STEPS):
        idx = batch_indices(g)[:windows]
        t0 = time.perf_counter()
        loss = loss_on(model, idx)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad()
        if g >= WARMUP:
            times["forward"].append(t1 - t0)
            times["backward"].append(t2 - t1)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.backward_time", description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="char_gpt_backward_time")
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    times = measure(a.windows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = [f"| {k} | {statistics.median(v) * 1e3:.1f} | {min(v) * 1e3:.1f} | {max(v) * 1e3:.1f} |" for k, v in times.items()]
    md = "\n".join([
        "# char GPT: forward and backward time of one rank's share of a batch", "",
        f"`python -m bench.backward_time --windows {a.windows}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"commit {commit}, one torch thread, {a.windows} windows x 64 tokens, {STEPS} steps after {WARMUP} of warm-up; "
        f"1-minute load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, on the shared 2-core "
        "machine (one process: on the fleet four workers share its two cores).", "",
        "| phase | median ms | min ms | max ms |", "|---|---|---|---|", *rows, ""])
    path = os.path.join(a.out, a.name + ".md")
    with open(path, "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
