"""Synchronous steps' bookkeeping as the state machine keeps it, per job (a sync step sequence's
name; "" is the store-wide default): the last step applied, and the contributions received so
far for steps not yet applied (``push_sync``; ``push_step`` sums on the leader instead,
aggregate.py). A step's ranked contributions are held apart and added up in rank order when it
applies, never in log order: float addition is not associative, and the order contributions
reach the log is the order they arrived in, which changes run to run (``sum_in_order``, as
push_step's). Unranked ones have no identity that lasts from run to run (a client id is random):
they are added in log order, after the ranked ones.

A snapshot row holds a step's first contribution where the code of before held its running sum,
and the others, if any, in a sixth field: a state the code of before could write (one
contribution per open step) is the same bits under either. A running sum of several, from a
snapshot of before, is added first.
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


OLD_SUM = (-1, 0)    # the running sum of several contributions a snapshot of before held: added first


def sum_in_order(parts: dict[tuple, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """{name: sum of every part's array}, added in the parts' sorted key order into a fresh
    array (never into a part: they may be read-only frame buffers)."""
    sums: dict[str, np.ndarray] = {}
    for key in sorted(parts):
        for name, grad in parts[key].items():
            total = sums.get(name)
            if total is None:
                sums[name] = np.array(grad, copy=True, order="C")
            else:
                np.add(total, grad, out=total)        # the same bits as total + grad
    return sums


class SyncJobs:
    """job -> {"applied": the last step applied, "buffers": {step: {"parts": {order_key: {name:
    array}}, "count": n, "workers": k, "ranks": sorted ranks that contributed, or None if unranked}}}."""

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

    def total(self, job: str, step: int) -> dict[str, np.ndarray]:
        """The sum of a step's contributions, in their order (``order_key``); {} if none."""
        buf = self.buffer(job, step)
        return sum_in_order(buf["parts"]) if buf else {}

    def add(self, job: str, step: int, workers: int, rank: int | None, grads: dict[str, np.ndarray]) -> dict | None:
        """Add one contribution to a step not yet applied; returns its buffer, or None if its rank
        had contributed (a restarted worker sending its step again: counted once)."""
        buf = self.buffer(job, step)
        if buf is not None:
            names = _names(buf)
            if names != sorted(grads) or buf["workers"] != workers:
                raise InvalidRequest(f"sync step {step}: contribution for {sorted(grads)} with workers={workers} "
                                     f"does not match {names} with workers={buf['workers']}")
            if (buf["ranks"] is None) != (rank is None):
                raise InvalidRequest(f"sync step {step}: contributions with and without rank cannot be mixed")
            if rank is not None and rank in buf["ranks"]:
                return None
        else:
            buf = self._job(job)["buffers"][step] = {
                "parts": {}, "count": 0, "workers": workers, "ranks": None if rank is None else []}
        # a copy: the entry's arrays may be views of a payload buffer that is reused
        key = (0, rank) if rank is not None else (1, buf["count"])       # by rank; unranked in log order
        buf["parts"][key] = {name: np.array(grad, copy=True) for name, grad in grads.items()}
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
                if name in _names(buf):
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
                                      *_held(b["parts"])]
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
                row[0]: {"parts": _parts(*row), "count": row[1], "workers": row[2],
                         "ranks": None if row[3] is None else list(row[3])}
                for row in buffers}}


def _names(buf: dict) -> list[str]:
    """The tensor names a step's contributions carry (every one carries the same)."""
    return sorted(next(iter(buf["parts"].values()), {}))


def _held(parts: dict[tuple, dict[str, np.ndarray]]) -> list:
    """A step's contributions in a snapshot row: the first's arrays, then the others', if any."""
    keys = sorted(parts)
    first = [sorted(parts[keys[0]].items())]
    return first + ([[[list(k), sorted(parts[k].items())] for k in keys[1:]]] if len(keys) > 1 else [])


def _parts(step: int, count: int, workers: int, ranks: list | None, first: list,
           others: list | None = None) -> dict[tuple, dict[str, np.ndarray]]:
    """A snapshot row's contributions (``_held``); a row of before holds one running sum."""
    if others is None and count > 1:
        return {OLD_SUM: {k: np.array(v) for k, v in first}}
    key = (0, ranks[0]) if ranks else (1, 0)     # the first contribution: the lowest rank, or the first logged
    parts = {key: {k: np.array(v) for k, v in first}}
    for other, arrays in others or []:
        parts[tuple(other)] = {k: np.array(v) for k, v in arrays}
    return parts
