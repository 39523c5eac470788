"""The history of a fault-injection workload: one record per client operation.

Workload model (so that every push is checkable in linear time): one float64 tensor of N zeros
with ``sgd, lr=1.0``. Push k sends the gradient ``-e_k`` (SGD does ``p -= lr * g``), so element k
of the tensor counts how many times push k was applied. Each k is used by exactly one push.

A pull records a content summary instead of the tensor: the indices that are non-zero, and any
element whose value is not exactly 0 or 1 (a double application made visible).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable

import numpy as np

OK, FAILED, UNKNOWN = "ok", "failed", "unknown"
PUSH, PULL = "push", "pull"


@dataclass
class Op:
    kind: str                     # PUSH or PULL
    client: int
    seq: int                      # per-client operation number, 0, 1, 2, ...
    start: float                  # time.monotonic() when the call was made
    k: int | None = None          # pushes: the one-hot index
    end: float | None = None      # None while running; unknown ops keep their end (the timeout)
    outcome: str | None = None    # OK, FAILED or UNKNOWN
    version: int | None = None    # OK ops: the store version returned
    linearizable: bool = True     # pulls: linearizable=True was asked
    nonzero: list[int] | None = None       # pulls: indices of non-zero elements
    odd: dict[int, float] | None = None    # pulls: elements that are neither 0.0 nor 1.0
    error: str = ""               # failed / unknown: exception class and message


def summarize(values: np.ndarray) -> tuple[list[int], dict[int, float]]:
    """The content summary of a pulled tensor: (non-zero indices, {index: value} for odd values)."""
    flat = np.asarray(values, dtype=np.float64).ravel()
    nonzero = np.flatnonzero(flat != 0.0)
    odd = nonzero[flat[nonzero] != 1.0]
    return nonzero.tolist(), {int(i): float(flat[i]) for i in odd}


def push_gradient(n: int, k: int) -> np.ndarray:
    """The gradient of push k: -1 at index k, so that sgd with lr=1.0 adds exactly 1.0 there."""
    g = np.zeros(n, np.float64)
    g[k] = -1.0
    return g


@dataclass
class History:
    """A thread-safe list of operations and timestamped fault events."""
    ops: list[Op] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(self, kind: str, client: int, seq: int, k: int | None = None,
              linearizable: bool = True) -> Op:
        op = Op(kind=kind, client=client, seq=seq, k=k, start=time.monotonic(),
                linearizable=linearizable)
        with self._lock:
            self.ops.append(op)
        return op

    @staticmethod
    def finish(op: Op, outcome: str, version: int | None = None, values: np.ndarray | None = None,
               error: BaseException | None = None) -> None:
        op.end = time.monotonic()
        op.outcome = outcome
        op.version = version
        if values is not None:
            op.nonzero, op.odd = summarize(values)
        if error is not None:
            op.error = f"{type(error).__name__}: {error}"[:200]

    def event(self, what: str) -> float:
        """Record a fault event (e.g. 'kill n1'); returns its time."""
        t = time.monotonic()
        with self._lock:
            self.events.append((t, what))
        return t

    def completed(self) -> list[Op]:
        with self._lock:
            return [op for op in self.ops if op.outcome is not None]

    def counts(self) -> dict[str, int]:
        ops = self.completed()
        return {"ops": len(ops), OK: sum(o.outcome == OK for o in ops),
                FAILED: sum(o.outcome == FAILED for o in ops),
                UNKNOWN: sum(o.outcome == UNKNOWN for o in ops)}

    def dump(self, path: str) -> None:
        """Write the history as JSON (for a failed run's post-mortem)."""
        with self._lock:
            data = {"ops": [asdict(o) for o in self.ops], "events": self.events}
        with open(path, "w") as f:
            json.dump(data, f)

    @classmethod
    def load(cls, path: str) -> "History":
        with open(path) as f:
            data = json.load(f)
        ops = []
        for d in data["ops"]:
            if d.get("odd"):
                d["odd"] = {int(k): v for k, v in d["odd"].items()}
            ops.append(Op(**d))
        return cls(ops=ops, events=[tuple(e) for e in data["events"]])


def first_ack_after(ops: Iterable[Op], t: float) -> float | None:
    """Seconds from t to the first acknowledged push that was both started and acknowledged after t
    (an upper bound on the outage: it includes that push's own latency)."""
    ends = [o.end for o in ops if o.kind == PUSH and o.outcome == OK and o.start >= t]
    return (min(ends) - t) if ends else None
