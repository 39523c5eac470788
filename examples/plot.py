"""Plot runs' loss and eval metric against time: ``python examples/plot.py OUT.png RUN_DIR...``

Each RUN_DIR is an example's ``--out`` (metrics.csv + summary.json); the legend is the
summary's label (e.g. "raftps async x4"). No torch needed.
"""
from __future__ import annotations

import csv
import json
import os
import sys


def plot_runs(png: str, run_dirs: list[str], title: str = "", events: list[tuple[float, str]] = ()) -> str:
    """``events``: (seconds since the first step, label), drawn as red lines (e.g. SIGKILLs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(11, 4))
    metric = None
    for d in run_dirs:
        with open(os.path.join(d, "summary.json")) as f:
            label = json.load(f)["label"]
        with open(os.path.join(d, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
        metric = [k for k in rows[0] if k not in ("time", "step", "loss", "unix")][0]
        ax_loss.plot([float(r["time"]) for r in rows], [float(r["loss"]) for r in rows], label=label)
        ev = [r for r in rows if r[metric] != ""]
        ax_metric.plot([float(r["time"]) for r in ev], [float(r[metric]) for r in ev], marker=".", label=label)
    ax_loss.set(xlabel="seconds since the first step", ylabel="training loss (rank 0, EMA)", title=title)
    ax_metric.set(xlabel="seconds since the first step", ylabel=metric or "", title=title)
    for ax in (ax_loss, ax_metric):
        for t, label in events:
            ax.axvline(t, color="red", linestyle="--", linewidth=1)
            ax.annotate(label, (t, 0.98), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                        color="red", va="top", ha="right")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    print(plot_runs(sys.argv[1], sys.argv[2:]))
