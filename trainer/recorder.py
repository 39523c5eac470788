"""The Recorder every mode shares (evaluations, events, the progress line, the summary) and the
evaluation schedule: run.py's --local and coordinator.py's cluster modes both record with it."""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from .config import Config
from .metrics import EVENTS, METRICS, CsvLog, Progress
from .networks import MLP, Params
from .plot import plot_run

TARGET_ACC = 0.95           # summary.json reports when the run first reached it


class Recorder:
    """Evaluation rows, events, the progress line and the summary, for every mode."""

    def __init__(self, cfg: Config, data, model: MLP):
        self.cfg, self.data, self.model = cfg, data, model
        os.makedirs(cfg.out, exist_ok=True)
        self.metrics = CsvLog(os.path.join(cfg.out, "metrics.csv"), METRICS)
        self.events = CsvLog(os.path.join(cfg.out, "events.csv"), EVENTS)
        self.progress = Progress()
        self.t0 = time.monotonic()
        self.losses: list[float] = []
        self.last_loss: float | None = None   # the latest training loss a worker reported, for the progress line
        self.last: dict = {}                     # the latest evaluation's metrics.csv row
        self.reached: dict | None = None
        self.first_step_s: float | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def evaluate(self, params: Params, updates: int, version: int, epoch: float,
                 staleness_mean: float | str = "", bytes_pushed: int | str = "") -> None:
        train_loss = float(np.mean(self.losses)) if self.losses else float("nan")
        self.losses = []
        loss, acc = self.model.loss_and_accuracy(params, self.data.x_test, self.data.y_test)
        row = dict(time_s=self.elapsed(), updates=updates, version=version, epoch=epoch,
                   train_loss=train_loss, test_loss=loss, test_acc=acc,
                   staleness_mean=staleness_mean, bytes_pushed=bytes_pushed)
        self.metrics.write(**row)
        self.last = row
        if self.reached is None and acc >= TARGET_ACC:
            self.reached = {"time_s": row["time_s"], "updates": updates}

    def event(self, text: str, updates: int) -> None:
        self.events.write(time_s=self.elapsed(), updates=updates, event=text)
        self.progress.done()
        print(f"trainer: {text}", file=sys.stderr, flush=True)

    def finish(self, params: Params, extra: dict) -> dict:
        self.progress.done()
        self.metrics.close()
        self.events.close()
        np.savez(os.path.join(self.cfg.out, "params.npz"), **params)
        cfg = self.cfg
        mode = "local" if cfg.local else cfg.mode
        title = f"{cfg.model} on {cfg.dataset}, {mode}" + ("" if cfg.local else f", {cfg.workers} workers") \
            + f", {cfg.optimizer}"
        plot = plot_run(cfg.out, self.metrics.rows, self.events.rows, title)
        wall = self.elapsed()
        updates = int(self.last.get("updates", 0))
        summary = {"mode": mode, "model": cfg.model, "parameters": self.model.parameters(),
                   "workers": 1 if cfg.local else cfg.workers, "optimizer": cfg.optimizer_spec(),
                   "final_test_acc": self.last.get("test_acc", float("nan")),
                   "final_test_loss": self.last.get("test_loss", float("nan")),
                   "updates": updates, "wall_s": round(wall, 3),
                   "updates_per_s": round(updates / wall, 2) if wall > 0 else None,
                   "steady_updates_per_s": steady_rate(self.metrics.rows),
                   f"reached_{TARGET_ACC}": self.reached, "events": [e["event"] for e in self.events.rows],
                   "first_step_s": self.first_step_s, "plot": plot, **extra}
        with open(os.path.join(cfg.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
        return summary


def steady_rate(rows: list[dict], low: float = 0.1, high: float = 0.9) -> float | None:
    """Applied updates per second between the evaluations at ``low`` and ``high`` of the run's
    updates: the rate with every worker running, without start-up and the tail of the last
    workers to finish. None if fewer than two evaluations fall in between."""
    total = int(rows[-1]["updates"]) if rows else 0
    inside = [r for r in rows if low * total <= int(r["updates"]) <= high * total]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    seconds = float(last["time_s"]) - float(first["time_s"])
    return round((int(last["updates"]) - int(first["updates"])) / seconds, 2) if seconds > 0 else None


def eval_every(cfg: Config, n_train: int) -> int:
    return max(1, int(cfg.updates_per_epoch(n_train) / max(1, cfg.evals_per_epoch)))
