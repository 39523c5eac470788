"""The run's PNG: training and test loss, and test accuracy, against wall time and against
applied updates, with a vertical line wherever a node was killed or went down."""
from __future__ import annotations

import os


def _num(row: dict, key: str) -> float:
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return float("nan")


def plot_run(out_dir: str, metrics: list[dict], events: list[dict], title: str = "") -> str:
    """Write OUT_DIR/plot.png from metrics.csv-style rows; returns its path."""
    import matplotlib
    matplotlib.use("Agg")           # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex="col")
    marks = [e for e in events if any(w in e["event"] for w in ("kill", "down"))]
    for col, xkey, xlabel in ((0, "time_s", "wall time (s)"), (1, "updates", "applied updates")):
        x = [_num(r, xkey) for r in metrics]
        loss_ax, acc_ax = axes[0][col], axes[1][col]
        loss_ax.plot(x, [_num(r, "train_loss") for r in metrics], ".-", label="train loss")
        loss_ax.plot(x, [_num(r, "test_loss") for r in metrics], ".-", label="test loss")
        loss_ax.set_yscale("log")
        loss_ax.set_ylabel("loss")
        loss_ax.legend(loc="upper right")
        acc_ax.plot(x, [_num(r, "test_acc") for r in metrics], ".-", color="tab:green")
        acc_ax.set_ylabel("test accuracy")
        acc_ax.set_xlabel(xlabel)
        acc_ax.set_ylim(0, 1.02)
        for ax in (loss_ax, acc_ax):
            ax.grid(alpha=0.3)
            for e in marks:
                ax.axvline(_num(e, xkey), color="tab:red", linestyle="--", alpha=0.7)
        if marks:
            acc_ax.text(_num(marks[0], xkey), 0.05, " " + marks[0]["event"], color="tab:red", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(out_dir, "plot.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
