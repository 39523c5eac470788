"""Synchronous steps' bookkeeping as the state machine keeps it, per job (a sync step sequence's
name; "" is the store-wide default): the last step applied, and the contributions summed so far
for steps not yet applied (``push_sync``; ``push_step`` sums on the leader instead, aggregate.py).
A job in its initial state is never stored, so every replica's dict (and digest) is the same
whatever reads happened. Applying a step's mean to the tensors is the store's (machine.py).
"""
from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from raftps.errors import InvalidRequest
from raftps.tensor import NAME_RE


def check_job(job: Any) -> str:
    """A job's name (a sync step sequence's): None or "" is the store-wide default job. The
    message is the one of before the renaming, word for word: a result is kept in its client's
    session, so in the snapshot, and an entry logged then must give the same bits now."""
    if job is None or isinstance(job, str) and job == "":
        return ""
    if not isinstance(job, str) or not NAME_RE.fullmatch(job):
        raise InvalidRequest(f"bad sync group {job!r}: 1-200 characters from [A-Za-z0-9_.:/-], or \"\" "
                             "for the store-wide default")
    return job


class SyncJobs:
    """job -> {"applied": the last step applied, "buffers": {step: {"sum": {name: array}, "count": n,
    "workers": k, "ranks": sorted ranks that contributed, or None if unranked}}}."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}

    def applied(self, job: str = "") -> int:
        """The last step applied in ``job`` (-1 if none)."""
        return self.jobs.get(job, {}).get("applied", -1)

    def count(self, job: str, step: int) -> int:
        """Contributions received so far to a step not yet applied."""
        return self.jobs.get(job, {}).get("buffers", {}).get(step, {}).get("count", 0)

    def buffer(self, job: str, step: int) -> dict | None:
        return self.jobs.get(job, {}).get("buffers", {}).get(step)

    def add(self, job: str, step: int, workers: int, rank: int | None, grads: dict[str, np.ndarray]) -> dict | None:
        """Add one contribution to a step not yet applied; returns its buffer, or None if its rank
        had contributed (a restarted worker sending its step again: counted once)."""
        buf = self.buffer(job, step)
        if buf is not None:
            if sorted(buf["sum"]) != sorted(grads) or buf["workers"] != workers:
                raise InvalidRequest(f"sync step {step}: contribution for {sorted(grads)} with workers={workers} "
                                     f"does not match {sorted(buf['sum'])} with workers={buf['workers']}")
            if (buf["ranks"] is None) != (rank is None):
                raise InvalidRequest(f"sync step {step}: contributions with and without rank cannot be mixed")
            if rank is not None and rank in buf["ranks"]:
                return None
        else:
            buf = self._job(job)["buffers"][step] = {
                "sum": {}, "count": 0, "workers": workers, "ranks": None if rank is None else []}
        for name, grad in grads.items():
            prev = buf["sum"].get(name)
            buf["sum"][name] = grad.copy() if prev is None else prev + grad
        buf["count"] += 1
        if rank is not None:
            bisect.insort(buf["ranks"], rank)
        return buf

    def done(self, job: str, step: int) -> None:
        """Step ``step`` of ``job`` is applied, and with it every earlier one."""
        g = self._job(job)
        g["applied"] = step
        for old in [s for s in sorted(g["buffers"]) if s <= step]:
            del g["buffers"][old]

    def holding(self, name: str) -> tuple[str, int] | None:
        """(job, step) of the first step not yet applied whose sums hold tensor ``name``."""
        for job, g in sorted(self.jobs.items()):
            for step, buf in sorted(g["buffers"].items()):
                if name in buf["sum"]:
                    return job, step
        return None

    def _job(self, job: str) -> dict:
        g = self.jobs.get(job)
        if g is None:
            g = self.jobs[job] = {"applied": -1, "buffers": {}}
        return g

    def snapshot(self) -> list:
        return [[job, g["applied"], [[step, b["count"], b["workers"],
                                      None if b["ranks"] is None else list(b["ranks"]),   # insort mutates it
                                      sorted(b["sum"].items())]
                                     for step, b in sorted(g["buffers"].items())]]
                for job, g in sorted(self.jobs.items())]

    def restore(self, rows: Any, snapshot_format: int) -> None:
        if snapshot_format == 1:       # one store-wide job, unranked
            applied, buffers = rows
            rows = [["", applied, [[step, count, workers, None, sums] for step, count, workers, sums in buffers]]]
        self.jobs = {}
        for job, applied, buffers in rows:
            if applied == -1 and not buffers:
                continue              # the initial state is never stored
            self.jobs[job] = {"applied": applied, "buffers": {
                step: {"sum": {k: np.array(v) for k, v in sums}, "count": count, "workers": workers,
                       "ranks": None if ranks is None else list(ranks)}
                for step, count, workers, ranks, sums in buffers}}
