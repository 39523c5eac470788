"""metrics.csv / events.csv writers and the live progress line."""
from __future__ import annotations

import csv
import os
import sys
import time

METRICS = ["time_s", "updates", "version", "epoch", "train_loss", "test_loss", "test_acc",
           "staleness_mean", "bytes_pushed"]
EVENTS = ["time_s", "updates", "event"]


class CsvLog:
    """Appends rows and flushes each one, so a crashed run still leaves its metrics."""

    def __init__(self, path: str, columns: list[str]):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.columns = columns
        self.rows: list[dict] = []
        self._f = open(path, "w", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=columns)
        self._w.writeheader()
        self._f.flush()

    def write(self, **row) -> None:
        row = {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()}
        self.rows.append(row)
        self._w.writerow(row)
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class Progress:
    """One status line on stderr: redrawn in place on a terminal, a plain line every few
    seconds otherwise (logs and CI)."""

    def __init__(self, stream=sys.stderr, every: float | None = None):
        self.stream = stream
        self.tty = stream.isatty()
        self.every = every if every is not None else (0.25 if self.tty else 5.0)
        self._last = 0.0
        self._width = 0

    def show(self, force: bool = False, **f) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return
        self._last = now
        # no loss before a worker reported one, no accuracy before the first evaluation
        line = " | ".join([f"[{f.get('elapsed', 0):6.1f}s] step {f.get('done', 0)}/{f.get('total', 0)} "
                           f"epoch {f.get('epoch', 0):.2f}"]
                          + [f"{key} {f[key]:.4f}" for key in ("loss", "acc") if f.get(key) is not None]
                          + [f"{f.get('rate', 0):6.1f} push/s", f"version {f.get('version', '-')}",
                             f"leader {f.get('leader', '-')}"])
        if f.get("note"):
            line += f" | {f['note']}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
